"""Print the run config for one selector x seed of ``make compare`` (YAML on stdout): the main
job's defaults (``defs/run_config/cpu_quick.yaml``) with the selector and seeds replaced.

    python -m cluster_pipeline.compare_config <selector> <seed> <asset>[,<asset>...]

Only the listed assets' config is printed (Dagster refuses config for assets not in the run).
"""

import sys

import yaml

from cluster_pipeline.core.selection import SELECTORS
from cluster_pipeline.defs.jobs import CPU_QUICK_CONFIG


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3 or args[0] not in SELECTORS or not args[1].isdigit():
        sys.exit(f"usage: python -m cluster_pipeline.compare_config <{'|'.join(SELECTORS)}> "
                 "<seed> <asset>[,<asset>...]")
    selector, seed, assets = args[0], int(args[1]), set(args[2].split(","))
    ops = {k: dict(v) for k, v in CPU_QUICK_CONFIG["ops"].items()}
    ops["peripheral_subsets"] = {"config": {**ops["peripheral_subsets"]["config"],
                                            "selector": selector, "seed": seed}}
    ops["trained_checkpoint"] = {"config": {**ops["trained_checkpoint"]["config"], "seed": seed}}
    ops = {k: v for k, v in ops.items() if k in assets}
    print(yaml.safe_dump({"ops": ops, "loggers": CPU_QUICK_CONFIG.get("loggers", {})}))


if __name__ == "__main__":
    main()

"""Print the run config for one selector x ratio x seed of ``make compare`` (YAML on stdout).

    cluster-pipeline compare-config <selector> <seed> <asset>[,<asset>...] [--ratio R]

The main job's defaults (``defs/run_config/cpu_quick.yaml``) with the selector and seeds
replaced; only the listed assets' config is printed (Dagster refuses config for assets not in
the run).
"""

import argparse

import yaml

from cluster_pipeline.core.selection import SELECTORS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("selector", choices=SELECTORS)
    parser.add_argument("seed", type=int)
    parser.add_argument("assets", help="comma-separated asset names of the run")
    parser.add_argument(
        "--ratio",
        type=float,
        default=None,
        help="selection ratio r (default: the main job's; full data uses 1)",
    )


def compare_config(selector: str, seed: int, assets: set[str], ratio: float | None = None) -> dict:
    """The run config of one selector x ratio x seed (see the module docstring): the seed is
    both the selection seed and the training seed (data order)."""
    from cluster_pipeline.defs.jobs import CPU_QUICK_CONFIG

    ops = {k: dict(v) for k, v in CPU_QUICK_CONFIG["ops"].items()}
    subsets = {**ops["peripheral_subsets"]["config"], "selector": selector, "seed": seed}
    if selector == "full":
        subsets["ratio"] = 1.0
    elif ratio is not None:
        subsets["ratio"] = ratio
    ops["peripheral_subsets"] = {"config": subsets}
    ops["trained_checkpoint"] = {"config": {**ops["trained_checkpoint"]["config"], "seed": seed}}
    return {
        "ops": {k: v for k, v in ops.items() if k in assets},
        "loggers": CPU_QUICK_CONFIG.get("loggers", {}),
    }


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    from cluster_pipeline.defs.stages import STAGES

    assets = set(args.assets.split(","))
    unknown = sorted(assets - set(STAGES))
    if unknown:
        parser.error(f"unknown asset(s) {', '.join(unknown)}; choose from {', '.join(STAGES)}")
    print(yaml.safe_dump(compare_config(args.selector, args.seed, assets, args.ratio)))

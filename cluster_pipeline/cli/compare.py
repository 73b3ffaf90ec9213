"""Print the run config for one selector x seed of ``make compare`` (YAML on stdout).

    cluster-pipeline compare-config <selector> <seed> <asset>[,<asset>...]

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


def compare_config(selector: str, seed: int, assets: set[str]) -> dict:
    """The run config of one selector x seed (see the module docstring)."""
    from cluster_pipeline.defs.jobs import CPU_QUICK_CONFIG

    ops = {k: dict(v) for k, v in CPU_QUICK_CONFIG["ops"].items()}
    ops["peripheral_subsets"] = {
        "config": {**ops["peripheral_subsets"]["config"], "selector": selector, "seed": seed}
    }
    ops["trained_checkpoint"] = {"config": {**ops["trained_checkpoint"]["config"], "seed": seed}}
    return {
        "ops": {k: v for k, v in ops.items() if k in assets},
        "loggers": CPU_QUICK_CONFIG.get("loggers", {}),
    }


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    print(yaml.safe_dump(compare_config(args.selector, args.seed, set(args.assets.split(",")))))

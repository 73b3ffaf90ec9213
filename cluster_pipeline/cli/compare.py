"""Print the run config for one selector x ratio x seed of ``make compare`` (YAML on stdout).

    cluster-pipeline compare-config <selector> <seed> <asset>[,<asset>...] [--ratio R]
        [--profile P]

A size profile's run config (default ``cpu_quick``, the main job's) with the selector and seeds
replaced; only the listed assets' config is printed (Dagster refuses config for assets not in
the run).
"""

import argparse

import yaml

from cluster_pipeline.cli import UserError
from cluster_pipeline.cli.run_config import asset_list
from cluster_pipeline.selection.selectors import REGISTRY, SELECTORS, needs_targets
from cluster_pipeline.storage.names import PERIPHERAL_SUBSETS, TRAINED_CHECKPOINT


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``compare-config`` arguments: selector, seed, the assets and the options."""
    from cluster_pipeline.defs.profiles import DEFAULT_PROFILE

    parser.add_argument("selector", choices=SELECTORS)
    parser.add_argument("seed", type=int)
    parser.add_argument("assets", help="comma-separated asset names of the run")
    parser.add_argument(
        "--ratio",
        type=float,
        default=None,
        help="selection ratio r (default: the profile's; full data uses 1)",
    )
    parser.add_argument("--profile", default=DEFAULT_PROFILE, help="size profile")
    parser.add_argument(
        "--target",
        default=None,
        help="the target set of a targeted selector (rds, less, cluster_less): a benchmark name "
        "or a folder; left out for the other selectors, which refuse one",
    )


def compare_config(
    selector: str,
    seed: int,
    assets: list[str],
    ratio: float | None = None,
    profile: str | None = None,
    target: str | None = None,
) -> dict:
    """The run config of one selector x ratio x seed (see the module docstring): the seed is
    both the selection seed and the training seed (data order); ``target``: the target set of
    a targeted selector (rds, less, cluster_less).

    Raises:
        UnknownProfileError: ``profile`` is not a known size profile.
    """
    from cluster_pipeline.defs.profiles import DEFAULT_PROFILE, profile_run_config

    config = profile_run_config(profile or DEFAULT_PROFILE, assets)
    ops = config["ops"]
    if PERIPHERAL_SUBSETS in ops:
        subsets = {**ops[PERIPHERAL_SUBSETS]["config"], "selector": selector, "seed": seed}
        if not REGISTRY[selector].budgeted:  # r bounds nothing it keeps (full)
            subsets["ratio"] = 1.0
        elif ratio is not None:
            subsets["ratio"] = ratio
        if target is not None and needs_targets(selector):  # the others refuse one
            subsets["target"] = target
        ops[PERIPHERAL_SUBSETS] = {"config": subsets}
    if TRAINED_CHECKPOINT in ops:
        ops[TRAINED_CHECKPOINT] = {"config": {**ops[TRAINED_CHECKPOINT]["config"], "seed": seed}}
    return config


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Print the run config of one comparison run (YAML), validated; exit 2 on bad values."""
    from cluster_pipeline.defs.run_checks import check_run_config

    try:
        config = compare_config(
            args.selector,
            args.seed,
            asset_list(args.assets) or [],
            args.ratio,
            args.profile,
            args.target,
        )
        check_run_config(config)  # refuse a bad ratio or seed now, not inside the run
    except ValueError as e:  # an unknown profile, a value outside its bounds
        raise UserError(str(e)) from None
    print(yaml.safe_dump(config, sort_keys=False), end="")

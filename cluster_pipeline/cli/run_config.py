"""Print a size profile's run config (YAML on stdout): what ``make run`` passes.

    cluster-pipeline run-config [<profile>] [--assets <asset>[,<asset>...]]

The same config is the default of ``main_job`` (``main_job_<profile>`` for other profiles) in the
launchpad. ``--assets`` keeps only those stages' config (Dagster refuses config for assets not
in the run).
"""

import argparse

import yaml

from cluster_pipeline.cli import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``run-config`` arguments: the size profile and the assets to print."""
    from cluster_pipeline.defs.profiles import DEFAULT_PROFILE, PROFILES

    parser.add_argument(
        "profile",
        nargs="?",
        default=DEFAULT_PROFILE,
        help=f"size profile, one of {', '.join(PROFILES)} (default {DEFAULT_PROFILE})",
    )
    parser.add_argument("--assets", help="comma-separated asset names of the run")


def asset_list(assets: str | None) -> list[str] | None:
    """The stage names of a comma-separated list (None: all).

    Raises:
        UserError: an unknown asset name (the message lists the stages).
    """
    from cluster_pipeline.defs.stages import STAGES

    if assets is None:
        return None
    names = [name.strip() for name in assets.split(",") if name.strip()]
    unknown = sorted(set(names) - set(STAGES))
    choose = f"choose from {', '.join(STAGES)}"
    if not names:
        raise UserError(f"--assets names no asset; {choose}")
    if unknown:
        raise UserError(f"unknown asset(s) {', '.join(repr(n) for n in unknown)}; {choose}")
    return names


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Print a profile's run config (YAML), restricted to ``--assets``."""
    from cluster_pipeline.defs.profiles import UnknownProfileError, profile_run_config

    try:
        config = profile_run_config(args.profile, asset_list(args.assets))
    except UnknownProfileError as e:
        raise UserError(str(e)) from None
    print(yaml.safe_dump(config, sort_keys=False), end="")

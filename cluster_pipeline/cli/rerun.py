"""Run the pipeline again from a run config it logged: an MLflow run's ``run_config.yaml``, or the
"Repeat it" block of an export's card.

    cluster-pipeline rerun <run_config.yaml> --dataset <name> [--dry-run]

The file is a Dagster run config (``ops: <stage>: config:`` for every stage to materialize, and
``resources:``, e.g. the base model). All seven stages run as ``main_job``, the five of the
selection chain as ``selection_job`` (each with ``sample_lineage``), any other set with ``dagster
asset materialize --select``; for partition <name>, in the Dagster instance `make` uses
($DAGSTER_HOME, else .dagster_home), the dataset registered first as `make run` registers it.
``--dry-run`` prints the command instead.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from cluster_pipeline.cli import UserError, instance_home

# The top-level keys of a Dagster run config.
_RUN_CONFIG_KEYS = ("ops", "resources", "execution", "loggers")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``rerun`` arguments: the run config file, ``--dataset``, ``--dry-run``."""
    parser.add_argument("run_config", type=Path, help="the run config (YAML) to run again")
    parser.add_argument("--dataset", required=True, help="the dataset partition to run it for")
    parser.add_argument(
        "--dry-run", action="store_true", help="print the command instead of running it"
    )


def read_run_config(path: Path) -> dict[str, Any]:
    """The run config in ``path``, checked: a YAML mapping whose keys are a Dagster run
    config's, with ``ops`` naming pipeline stages only.

    Raises:
        UserError: the file is missing or not YAML (the line is named), not a mapping, has
            another top-level key, no stage, a stage that is not one of the pipeline's, or a
            knob its stage does not have or a value it refuses (:func:`_check_knobs`).
    """
    from cluster_pipeline.defs.stages import STAGES

    if not path.is_file():
        raise UserError(f"{path} is not a file: give the run_config.yaml an MLflow run logged")
    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise UserError(f"{path} is not valid YAML: {e}") from None
    if not isinstance(config, dict):
        raise UserError(f"{path} is not a run config (a YAML mapping with `ops:`)")
    unknown = [k for k in config if k not in _RUN_CONFIG_KEYS]
    if unknown:
        raise UserError(
            f"{path}: {', '.join(map(repr, unknown))} is not a run config key (those are "
            f"{', '.join(_RUN_CONFIG_KEYS)})"
        )
    ops = config.get("ops")
    if not isinstance(ops, dict) or not ops:
        raise UserError(f"{path} names no stage under `ops:`; stages: {', '.join(STAGES)}")
    strangers = [k for k in ops if k not in STAGES]
    if strangers:
        raise UserError(
            f"{path}: {', '.join(map(repr, strangers))} under `ops:` is not a stage of the "
            f"pipeline ({', '.join(STAGES)})"
        )
    _check_knobs(path, ops)
    return config


def _check_knobs(path: Path, ops: dict[str, Any]) -> None:
    """Every stage's ``config:`` names knobs of that stage, each with a value it takes, before
    Dagster starts (which would answer a misspelled knob with a traceback listing every knob).

    Raises:
        UserError: a stage's entry is not ``config: {...}``, a knob is unknown (named with the
            nearest one), or a value is refused (the knob and why).
    """
    from cluster_pipeline.defs.partition_settings import unknown_knobs
    from cluster_pipeline.defs.run_checks import validate_stages

    configs: dict[str, dict[str, Any]] = {}
    for stage, entry in ops.items():
        entry = {} if entry is None else entry  # `stage:` alone: its defaults
        config = entry.get("config", {}) if isinstance(entry, dict) else None
        config = {} if config is None else config
        if not isinstance(entry, dict) or set(entry) - {"config"} or not isinstance(config, dict):
            raise UserError(f"{path}: ops.{stage} must be `config:` and its knobs")
        configs[stage] = config
    unknown = unknown_knobs(configs)
    if unknown:
        raise UserError(
            f"{path}: {'; '.join(f'ops.{u}' for u in unknown)}: not a knob of the pipeline; "
            "correct the name (the stages' knobs: `cluster-pipeline run-config`)"
        )
    # The values, as every launch checks them (bounds, finite numbers, another selector's knob).
    _, problems = validate_stages({"ops": {s: {"config": c} for s, c in configs.items()}}, configs)
    if problems:
        raise UserError(f"{path}: {'; '.join(problems)}")


def dagster_command(config: dict[str, Any], path: Path, dataset: str) -> list[str]:
    """The ``dagster`` command line that runs the stages of ``config`` (read from ``path``)
    for ``dataset``: ``job execute`` of ``main_job`` or ``selection_job`` where the stages are
    exactly theirs, else ``asset materialize --select`` (module docstring)."""
    from cluster_pipeline.defs.stages import SELECTION_STAGES, STAGES

    dagster = str(Path(sys.executable).parent / "dagster")
    stages = [s for s in STAGES if s in config["ops"]]
    module = ["-m", "cluster_pipeline.definitions"]
    job = {tuple(STAGES): "main_job", tuple(SELECTION_STAGES): "selection_job"}.get(tuple(stages))
    if job is not None:
        tags = json.dumps({"dagster/partition": dataset})
        return [dagster, "job", "execute", *module, "-j", job, "-c", str(path), "--tags", tags]
    select = ",".join(stages)
    return [
        *[dagster, "asset", "materialize", *module],
        *["--partition", dataset, "--select", select, "-c", str(path)],
    ]


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Register the dataset and run the stages of the run config for it (module docstring)."""
    from cluster_pipeline.cli import register
    from cluster_pipeline.storage.layout import default_data_dir

    config = read_run_config(args.run_config)
    command = dagster_command(config, args.run_config.absolute(), args.dataset)
    if args.dry_run:
        print(shlex.join(command))  # a line to paste into a shell as it is
        return
    # As `make run`: the instance folder prepared and the dataset registered.
    sync = argparse.Namespace(action="sync", data_dir=default_data_dir(), require=args.dataset)
    register.run(sync, parser)
    env = {
        **os.environ,
        "DAGSTER_HOME": str(instance_home()),
        # As `make run`: Dagster 1.13 marks `dagster job execute` superseded by `dg launch`.
        "PYTHONWARNINGS": "ignore:Function `job_execute_command` is superseded",
    }
    done = subprocess.run(command, env=env)
    if done.returncode != 0:
        raise SystemExit(done.returncode)

"""List or register dataset partitions without the Dagster daemon.

    cluster-pipeline datasets                      # list datasets and their state
    cluster-pipeline datasets sync                 # add a partition per dataset found
    cluster-pipeline datasets sync --require NAME  # ... and fail unless NAME exists

The ``dataset_folders_sensor`` does the same while ``dagster dev`` runs. Partitions live in the
Dagster instance at ``$DAGSTER_HOME``; unset, that is ``<project>/.dagster_home`` as in the
Makefile.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from cluster_pipeline.cli import UserError, instance_home
from cluster_pipeline.data.datasets import discover_datasets, refused_datasets
from cluster_pipeline.data.formats import SUPPORTED_SUFFIXES, compressed_note
from cluster_pipeline.defs.instance import INSTANCE_SETTINGS
from cluster_pipeline.defs.partitions import DATASETS
from cluster_pipeline.storage.layout import DataLayout, default_data_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``datasets`` arguments: ``list`` or ``sync``, the data folder, ``--require``."""
    parser.add_argument("action", nargs="?", choices=["list", "sync"], default="list")
    parser.add_argument("--data-dir", default=default_data_dir())
    parser.add_argument(
        "--require",
        metavar="NAME",
        help="exit with an error unless dataset "
        "NAME is found (built in, or a folder data/raw/NAME/ with data files)",
    )


def prepare_instance_home(home: Path) -> Path:
    """The instance folder, as `make` prepares it: created if missing (which Dagster refuses),
    with the project's dagster.yaml unless a non-empty one is there. Returns ``home``."""
    home.mkdir(parents=True, exist_ok=True)
    settings = home / "dagster.yaml"
    if not settings.exists() or settings.stat().st_size == 0:
        shutil.copyfile(INSTANCE_SETTINGS, settings)
    return home


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """List the dataset folders (registered, unregistered, refused and why) or register them as
    partitions of the Dagster instance (``sync``)."""
    import dagster as dg

    raw_dir = DataLayout.at(args.data_dir).raw_dir
    found = discover_datasets(raw_dir)
    refused = refused_datasets(raw_dir)
    if args.require and args.require in refused:
        raise UserError(f"dataset {args.require!r} cannot be registered: {refused[args.require]}.")
    if args.require and args.require not in found:
        folder = raw_dir / args.require
        files = ", ".join(SUPPORTED_SUFFIXES)
        if folder.is_dir():
            note = compressed_note(folder) or "put the dataset's files there"
            raise UserError(
                f"dataset {args.require!r}: {folder} holds no {files} file (eval.json and "
                f"fields.json are settings, not data); {note}."
            )
        raise UserError(
            f"dataset {args.require!r} not found: no folder {folder} with {files} files. "
            f"Datasets found: {', '.join(found)}."
        )
    home = prepare_instance_home(instance_home())
    os.environ["DAGSTER_HOME"] = str(home)
    with dg.DagsterInstance.get() as instance:
        known = set(instance.get_dynamic_partitions(DATASETS))
        new = [n for n in found if n not in known]
        if args.action == "sync":
            for name, reason in refused.items():
                print(f"skipping data/raw/{name}/: {reason}", file=sys.stderr)
            if new:
                instance.add_dynamic_partitions(DATASETS, new)
                print(f"registered new dataset partitions: {', '.join(new)}")
            else:
                print(f"dataset partitions up to date: {', '.join(found)}")
            return
        for name in found:
            print(f"{name}\t{'not registered (run sync)' if name in new else 'registered'}")
        for name in sorted(known - set(found)):
            print(f"{name}\tregistered, but its folder {raw_dir / name} is gone (its tables stay)")
        for name, reason in refused.items():
            print(f"{name}\trefused: {reason}")

"""Register dataset partitions without the Dagster daemon.

    python -m cluster_pipeline.datasets          # list datasets found and registered
    python -m cluster_pipeline.datasets sync     # add a partition for each dataset found

The ``dataset_folders_sensor`` does the same while ``dagster dev`` runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from cluster_pipeline.core.datasets import discover_datasets
from cluster_pipeline.defs.partitions import dataset_partitions
from cluster_pipeline.defs.resources import default_data_dir


def main(argv: list[str] | None = None) -> None:
    import dagster as dg

    parser = argparse.ArgumentParser(description="List or register dataset partitions.")
    parser.add_argument("command", nargs="?", choices=["list", "sync"], default="list")
    parser.add_argument("--data-dir", default=default_data_dir())
    args = parser.parse_args(argv)
    found = discover_datasets(Path(args.data_dir) / "raw")
    with dg.DagsterInstance.get() as instance:
        known = set(instance.get_dynamic_partitions(dataset_partitions.name))
        if args.command == "sync":
            new = [n for n in found if n not in known]
            if new:
                instance.add_dynamic_partitions(dataset_partitions.name, new)
            known |= set(new)
        for name in found:
            print(f"{name}\t{'registered' if name in known else 'not registered (run sync)'}")


if __name__ == "__main__":
    main()

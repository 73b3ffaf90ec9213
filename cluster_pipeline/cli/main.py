"""``cluster-pipeline``: register dataset partitions, trace samples, export the selection, and
print run configs (a size profile's, a comparison's), from a shell.

    cluster-pipeline datasets [list|sync] [--require NAME]
    cluster-pipeline lineage <dataset> (<sample_id>... | --selected | --diff OLD NEW) [--json]
    cluster-pipeline export <dataset> [--out DIR] [--overwrite]
    cluster-pipeline report <dataset>
    cluster-pipeline run-config [<profile>] [--assets <asset>[,<asset>...]]
    cluster-pipeline rerun <run_config.yaml> --dataset <name> [--dry-run]
    cluster-pipeline reexecute <run_id> [--dry-run]
    cluster-pipeline compare-config <selector> <seed> <asset>[,<asset>...]
    cluster-pipeline dev -- [dagster dev arguments...]
    cluster-pipeline mlflow [--host H] [--port P] [-- mlflow ui arguments...]
"""

import argparse
import signal

from cluster_pipeline.cli import (
    UserError,
    compare,
    dev,
    export,
    mlflow_ui,
    reexecute,
    register,
    report,
    rerun,
    run_config,
    trace,
)
from cluster_pipeline.data.formats import DatasetFormatError

COMMANDS = {
    "datasets": register,
    "lineage": trace,
    "export": export,
    "report": report,
    "run-config": run_config,
    "rerun": rerun,
    "reexecute": reexecute,
    "compare-config": compare,
    "dev": dev,
    "mlflow": mlflow_ui,
}


def main(argv: list[str] | None = None) -> None:
    """``cluster-pipeline``: dispatch to the subcommand; a :class:`~cluster_pipeline.cli.UserError`
    prints one line and exits with status 2."""
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` ends a listing quietly
    parser = argparse.ArgumentParser(
        prog="cluster-pipeline", description=(__doc__ or "").split("\n\n")[0].replace("``", "`")
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")
    for name, module in COMMANDS.items():
        doc = (module.__doc__ or "").strip()
        sub = commands.add_parser(
            name,
            # The docstring's first paragraph, whole (its first line can stop mid-sentence).
            help=" ".join(doc.split("\n\n")[0].split()).replace("``", "`"),
            description=doc.replace("``", "`"),  # the docstring's reST literals, as Markdown
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(sub)
        sub.set_defaults(run=module.run)
    args = parser.parse_args(argv)
    try:
        args.run(args, parser)
    except (UserError, DatasetFormatError, FileNotFoundError) as e:
        # What a user can cause gets one line and status 2 (as argparse's own errors), no
        # traceback; anything else is a bug and keeps its traceback.
        parser.exit(2, f"cluster-pipeline {args.command}: error: {e}\n")


if __name__ == "__main__":
    main()

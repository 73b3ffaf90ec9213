"""``python -m cluster_pipeline.cli`` is ``cluster-pipeline``."""

from cluster_pipeline.cli.main import main

main()

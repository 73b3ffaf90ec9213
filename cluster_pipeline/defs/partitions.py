"""The dataset partitions, declared once and imported by every asset.

Partitions are dynamic: one per dataset, added by the ``dataset_folders_sensor`` when a folder
appears under ``data/raw/`` (or by ``cluster-pipeline datasets sync``). The built-in
``python_stdlib`` is always registered.
"""

import dagster as dg

DATASETS = "datasets"
"""Name of the dynamic partitions definition: one partition per dataset."""

dataset_partitions = dg.DynamicPartitionsDefinition(name=DATASETS)

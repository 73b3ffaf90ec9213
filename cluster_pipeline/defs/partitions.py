"""The dataset partitions, declared once and imported by every asset.

Partitions are dynamic: one per dataset, added by the ``dataset_folders_sensor`` when a folder
appears under ``data/raw/`` (or by ``python -m cluster_pipeline.datasets sync``). The built-in
``python_stdlib`` is always registered.
"""

import dagster as dg

dataset_partitions = dg.DynamicPartitionsDefinition(name="datasets")

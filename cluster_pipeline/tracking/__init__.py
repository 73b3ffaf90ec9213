"""Experiment tracking: the runs of training and selection as MLflow runs. A
Dagster-free wrapper around ``mlflow.MlflowClient`` with explicit run ids (no active-run
state: several runs live in one process and every torchrun rank is a process of its own), the
data folder's own store (SQLite and an artifact folder under ``<data>/mlflow/``) and the target
a job file carries to rank 0. Every call is guarded: the first that fails logs one warning and
turns the tracker into a no-op, so a tracking server that is down never fails or stalls the
pipeline. Its settings are checked before any MLflow call: what cannot mean
anything is refused at the run's start, a store that cannot be opened as it is warns once.
Imports only ``storage``; its modules are listed in docs/design.md, "Code layout".
"""

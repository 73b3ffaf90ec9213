"""Where everything lives under the data folder: the one module that knows the paths.

::

    <data>/raw/<dataset>/...                  inputs (tracked), plus the dataset's eval.json
    <data>/eval/                              benchmark files (mbpp_reworded.json, mmlu.jsonl)
    <data>/models/<name>/                     the built-in base model, converted once
    <data>/tables/<asset>/<dataset>/          one Delta table per stage and dataset
    <data>/cache/embeddings/<dataset>/<key>/  resumable chunks of an embedding pass
    <data>/shards/<dataset>/<hash[:16]>/      shard manifests, a folder per content hash
    <data>/checkpoints/<dataset>/<name>/      fine-tuned checkpoints (see training/checkpointing.py)
    <data>/proxies/<dataset>/                 s2l's proxy runs, manifests and checkpoints
    <data>/reports/<dataset>/                 eval_report.md/.json, plots, evals/ (cache)
    <data>/exports/<dataset>/                 the selection as a `datasets` dataset (cli export)
    <data>/locks/<dataset>.lock, .json        the partition's run lock and its holder
    <data>/settings/<dataset>.json            the settings the partition was last launched with
    <data>/mlflow/mlflow.db, artifacts/       the MLflow tracking store (tracking/tracker.py)

The data folder is ``$CLUSTER_PIPELINE_DATA_DIR`` if set, else ``<project>/data``
(docs/design.md, "Storage layout"). Generated paths name a dataset by :func:`storage_name`: the
name itself when it is plain ASCII (letters, digits, ``._-``), else a readable ASCII form with a
hash of the name (``my data`` -> ``my_data-b2167b0a``), because Delta and Parquet readers take
paths as URLs and mangle spaces and accents. Inputs stay under ``raw/<name>/`` as the user named
them.
"""

from __future__ import annotations

import hashlib
import os
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path

from cluster_pipeline.storage.names import RAW_INSTRUCTIONS

PROJECT_ROOT = Path(__file__).resolve().parents[2]
DATA_DIR_ENV = "CLUSTER_PIPELINE_DATA_DIR"
# Public evaluation sets shipped beside the project on its build machines (absent elsewhere).
SHARED_EVAL_DIR = PROJECT_ROOT.parent / "shared" / "datasets" / "eval"


_PLAIN = re.compile(r"^[A-Za-z0-9._-]+$")


def storage_name(dataset: str) -> str:
    """The folder name of a dataset's generated files (module docstring). Distinct names give
    distinct folders."""
    if _PLAIN.match(dataset) and not dataset.startswith("."):
        return dataset
    ascii_ = unicodedata.normalize("NFKD", dataset).encode("ascii", "ignore").decode()
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", ascii_).strip("._") or "dataset"
    return f"{slug}-{hashlib.sha256(dataset.encode()).hexdigest()[:8]}"


def default_data_dir() -> str:
    """``$CLUSTER_PIPELINE_DATA_DIR`` if set, else ``<project>/data``."""
    return os.environ.get(DATA_DIR_ENV) or str(PROJECT_ROOT / "data")


@dataclass(frozen=True)
class DataLayout:
    """Paths under one data folder. Methods only name paths; writers create what they write."""

    root: Path

    @classmethod
    def at(cls, data_dir: str | Path) -> DataLayout:
        """The layout of the data folder ``data_dir`` (resolved to an absolute path)."""
        return cls(Path(data_dir).resolve())

    @property
    def raw_dir(self) -> Path:
        """``raw/``: one folder per dataset partition."""
        return self.root / "raw"

    @property
    def models_dir(self) -> Path:
        """``models/``: base models converted once (the built-in GGUF as safetensors)."""
        return self.root / "models"

    @property
    def eval_dir(self) -> Path:
        """``eval/``: benchmark files (``mbpp_reworded.json``, ``mmlu.jsonl``)."""
        return self.root / "eval"

    def table_uri(self, asset: str, dataset: str) -> str:
        """The Delta table of stage ``asset`` for ``dataset`` (every version lives there)."""
        return str(self.root / "tables" / asset / storage_name(dataset))

    def embeddings_dir(self, dataset: str) -> Path:
        """Every per-sample embedding cache of ``dataset``, one folder per key."""
        return self.root / "cache" / "embeddings" / storage_name(dataset)

    def embedding_cache_dir(self, dataset: str, key: str) -> Path:
        """The per-sample embedding cache of ``dataset`` under ``key`` (model, tokenizer and
        settings)."""
        return self.embeddings_dir(dataset) / key

    def shards_dir(self, dataset: str, manifest_set_sha256: str) -> Path:
        """The folder of one manifest set (named by its content hash)."""
        return self.root / "shards" / storage_name(dataset) / manifest_set_sha256[:16]

    def checkpoints_dir(self, dataset: str) -> Path:
        """The checkpoints of ``dataset``, one folder each."""
        return self.root / "checkpoints" / storage_name(dataset)

    def proxies_dir(self, dataset: str) -> Path:
        """s2l's proxy runs of ``dataset``: their shard manifests and checkpoints (kept apart
        from ``checkpoints/``, which holds the fine-tuned models the report compares)."""
        return self.root / "proxies" / storage_name(dataset)

    def reports_dir(self, dataset: str) -> Path:
        """``eval_report``'s Markdown, JSON and plots for ``dataset``."""
        return self.root / "reports" / storage_name(dataset)

    def exports_dir(self, dataset: str) -> Path:
        """The default folder of ``cluster-pipeline export <dataset>``: the selected subset as a
        ``datasets`` dataset (``integrations/hf_datasets.py``)."""
        return self.root / "exports" / storage_name(dataset)

    @property
    def mlflow_dir(self) -> Path:
        """``mlflow/``: the local MLflow tracking store, ``mlflow.db`` (SQLite) and
        ``artifacts/`` (tracking/tracker.py), shared by every dataset (runs carry the dataset
        as a tag)."""
        return self.root / "mlflow"

    def partition_lock(self, dataset: str) -> Path:
        """The lock file a run of ``dataset`` holds while it runs (storage/run_lock.py)."""
        return self.root / "locks" / f"{storage_name(dataset)}.lock"

    def partition_settings(self, dataset: str) -> Path:
        """The settings ``dataset`` was last launched with (storage/partition_settings.py)."""
        return self.root / "settings" / f"{storage_name(dataset)}.json"

    def eval_cache_dir(self, dataset: str) -> Path:
        """The evaluation cache of ``dataset``: one outcome per model and settings."""
        return self.reports_dir(dataset) / "evals"

    def datasets_with_tables(self, asset: str = RAW_INSTRUCTIONS) -> list[str]:
        """Datasets that have a table of ``asset`` (for error messages)."""
        folder = self.root / "tables" / asset
        return sorted(p.name for p in folder.glob("*")) if folder.is_dir() else []

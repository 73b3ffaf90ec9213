"""Where everything lives under the data folder: the one module that knows the paths.

::

    <data>/raw/<dataset>/...                  inputs (tracked), plus the dataset's eval.json
    <data>/eval/                              benchmark files (mbpp_reworded.json, mmlu.jsonl)
    <data>/models/<name>/                     the built-in base model, converted once
    <data>/tables/<asset>/<dataset>/          one Delta table per stage and dataset
    <data>/cache/embeddings/<dataset>/<key>/  resumable chunks of an embedding pass
    <data>/shards/<dataset>/<hash[:16]>/      shard manifests, a folder per content hash
    <data>/checkpoints/<dataset>/<name>/      fine-tuned checkpoints (see core/checkpoints.py)
    <data>/reports/<dataset>/                 eval_report.md/.json, plots, evals/ (cache)

The data folder is ``$CLUSTER_PIPELINE_DATA_DIR`` if set, else ``<project>/data``
(docs/design.md, "Storage layout").
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]
DATA_DIR_ENV = "CLUSTER_PIPELINE_DATA_DIR"
# Public evaluation sets shipped beside the project on its build machines (absent elsewhere).
SHARED_EVAL_DIR = PROJECT_ROOT.parent / "shared" / "datasets" / "eval"


def default_data_dir() -> str:
    """``$CLUSTER_PIPELINE_DATA_DIR`` if set, else ``<project>/data``."""
    return os.environ.get(DATA_DIR_ENV) or str(PROJECT_ROOT / "data")


@dataclass(frozen=True)
class DataLayout:
    """Paths under one data folder. Methods only name paths; writers create what they write."""

    root: Path

    @classmethod
    def at(cls, data_dir: str | Path) -> DataLayout:
        return cls(Path(data_dir).resolve())

    @property
    def raw_dir(self) -> Path:
        return self.root / "raw"

    @property
    def models_dir(self) -> Path:
        return self.root / "models"

    @property
    def eval_dir(self) -> Path:
        return self.root / "eval"

    def table_uri(self, asset: str, dataset: str) -> str:
        """The Delta table of stage ``asset`` for ``dataset`` (every version lives there)."""
        return str(self.root / "tables" / asset / dataset)

    def embedding_cache_dir(self, dataset: str, key: str) -> Path:
        return self.root / "cache" / "embeddings" / dataset / key

    def shards_dir(self, dataset: str, manifest_set_sha256: str) -> Path:
        return self.root / "shards" / dataset / manifest_set_sha256[:16]

    def checkpoints_dir(self, dataset: str) -> Path:
        return self.root / "checkpoints" / dataset

    def reports_dir(self, dataset: str) -> Path:
        return self.root / "reports" / dataset

    def eval_cache_dir(self, dataset: str) -> Path:
        return self.reports_dir(dataset) / "evals"

    def datasets_with_tables(self, asset: str = "raw_instructions") -> list[str]:
        """Datasets that have a table of ``asset`` (for error messages)."""
        folder = self.root / "tables" / asset
        return sorted(p.name for p in folder.glob("*")) if folder.is_dir() else []

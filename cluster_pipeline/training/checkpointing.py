"""The checkpoint catalogue: what a finished fine-tuning run leaves, and how to read it back.

A finished checkpoint is a folder ``<data>/checkpoints/<dataset>/<name>/`` holding the
``save_pretrained`` output (safetensors + tokenizer) and ``training_info.json``: base model,
the shard manifests trained on (rank, path, content hash), the training job (settings and
provenance: selector, ratio, seeds, data fraction, table versions), git commit, steps, seconds,
tokens and final loss. Beside it, ``<name>.metrics.jsonl`` holds one line per optimizer step
(written by rank 0 as training goes), and ``<name>.checkpoints/`` the resumable intermediate
checkpoints. The folder appears atomically (written elsewhere, then renamed), so a folder with a
``training_info.json`` is complete. Training writes these files; lineage, evaluation and the
asset metadata read them through this module only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TRAINING_INFO = "training_info.json"


def metrics_path(checkpoint: str | Path) -> Path:
    """The per-step metrics file of a checkpoint folder (a sibling, ``<name>.metrics.jsonl``)."""
    return Path(f"{checkpoint}.metrics.jsonl")


def intermediate_dir(checkpoint: str | Path) -> Path:
    """Where the resumable ``step_<n>/`` checkpoints of a run live."""
    return Path(f"{checkpoint}.checkpoints")


def read_metrics(checkpoint: str | Path) -> list[dict[str, Any]]:
    """The per-step records of a run (keys: step, epoch, lr, loss, loss_per_rank, grad_norm,
    tokens, step_seconds, elapsed_seconds), oldest first; [] if the file is absent. A torn
    last line (a run killed while writing) is skipped."""
    path = metrics_path(checkpoint)
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


@dataclass(frozen=True)
class Checkpoint:
    """One finished checkpoint folder and its ``training_info.json``."""

    path: Path
    info: dict[str, Any]

    @property
    def manifest_sha256(self) -> list[str]:
        """Content hashes of the shard manifests it was trained on, in rank order."""
        return [m["sha256"] for m in self.info.get("manifests", [])]

    @property
    def provenance(self) -> dict[str, Any]:
        """Selector, ratio, seeds, data fraction and table versions recorded at launch ({} for
        checkpoints written before provenance was recorded)."""
        return self.info.get("config", {}).get("provenance", {})

    @property
    def settings(self) -> dict[str, Any]:
        """The training settings the checkpoint was trained with."""
        config = self.info.get("config", {})
        return config.get("settings", config)

    @property
    def train_seconds(self) -> float | None:
        return self.info.get("train_seconds")

    @property
    def data_fraction(self) -> float | None:
        return self.provenance.get("data_fraction")

    def mean_grad_cosine(self) -> float | None:
        """Mean over logged steps of the mean inter-rank cosine of the ranks' local gradients
        (``grad_cosine`` in the metrics file; None if never logged)."""
        values = [r["grad_cosine"] for r in read_metrics(self.path) if "grad_cosine" in r]
        return float(sum(values) / len(values)) if values else None

    def loss_curve(self) -> list[tuple[int, float]]:
        """(optimizer step, mean loss over ranks) per step."""
        return [(r["step"], r["loss"]) for r in read_metrics(self.path)]


def read_checkpoint(path: str | Path) -> Checkpoint | None:
    """The checkpoint at ``path``, or None if the folder is not a finished checkpoint."""
    info_path = Path(path) / TRAINING_INFO
    try:
        return Checkpoint(Path(path), json.loads(info_path.read_text()))
    except (FileNotFoundError, NotADirectoryError, ValueError):
        return None


def list_checkpoints(root: Path) -> list[Checkpoint]:
    """Every finished checkpoint directly under ``root`` (a dataset's checkpoint folder),
    oldest first by the time its ``training_info.json`` was written."""
    if not root.is_dir():
        return []
    found = [c for c in (read_checkpoint(p.parent) for p in root.glob(f"*/{TRAINING_INFO}")) if c]
    return sorted(found, key=lambda c: ((c.path / TRAINING_INFO).stat().st_mtime_ns, c.path.name))


def checkpoints_by_manifest(checkpoints: list[Checkpoint]) -> dict[str, list[str]]:
    """manifest sha256 -> paths of the checkpoints trained on that manifest."""
    out: dict[str, list[str]] = {}
    for ckpt in checkpoints:
        for sha in ckpt.manifest_sha256:
            out.setdefault(sha, []).append(str(ckpt.path))
    return out


def finished_for(path: str | Path, manifest_sha256: list[str]) -> Checkpoint | None:
    """The finished checkpoint at ``path`` if it was trained on exactly these manifests (in
    rank order), else None."""
    ckpt = read_checkpoint(path)
    return ckpt if ckpt is not None and ckpt.manifest_sha256 == list(manifest_sha256) else None

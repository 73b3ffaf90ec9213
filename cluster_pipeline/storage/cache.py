"""Content-addressed caching: every stage that skips work it has already done keys it here.

Three stages reuse earlier results when nothing that determines them changed:

- ``proxy_embeddings``: the chunk folder is named by :func:`stable_hash` of the model's
  :func:`model_fingerprint`, the settings that change the numbers and the sample ids;
- ``trained_checkpoint``: the checkpoint folder is named by the manifests' hash and
  :func:`stable_hash` of base model, data version and training settings, so a re-run resumes or
  reuses it;
- ``eval_report``: one :class:`JsonCache` entry per model (path + :func:`file_stamp`) and
  evaluation settings.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from cluster_pipeline.storage import atomic

# Files that define a model's behaviour and are small enough to hash in full.
_HASHED_SUFFIXES = (".json", ".jinja", ".txt", ".model")
_WEIGHT_SUFFIXES = (".safetensors", ".bin")


def stable_hash(*parts: Any, length: int = 20) -> str:
    """First ``length`` hex digits of sha256 over ``parts`` as canonical JSON (sorted keys;
    objects JSON cannot encode use ``str``). Equal inputs give equal keys in any process."""
    text = json.dumps(parts, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def model_fingerprint(model_path: str) -> str:
    """sha256 over a model folder's config/tokenizer files (content) and weight files (name,
    size, mtime); a hub id hashes as itself."""
    h = hashlib.sha256(model_path.encode())
    folder = Path(model_path)
    if folder.is_dir():
        for p in sorted(folder.iterdir()):
            if p.suffix in _HASHED_SUFFIXES:
                h.update(p.name.encode() + p.read_bytes())
            elif p.suffix in _WEIGHT_SUFFIXES:
                st = p.stat()
                h.update(f"{p.name}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()


def file_stamp(path: str | Path) -> str:
    """``path|mtime_ns`` of a file, or ``path|`` if it does not exist: a key that changes when
    the file is rewritten in place."""
    p = Path(path)
    return f"{p}|{p.stat().st_mtime_ns if p.exists() else ''}"


class JsonCache:
    """JSON documents under a folder, one file per key, written atomically."""

    def __init__(self, folder: Path):
        self.folder = folder

    def path(self, key: str) -> Path:
        """The file of ``key``."""
        return self.folder / f"{key}.json"

    def get(self, key: str) -> Any | None:
        """The stored document, or None if absent or unreadable (a torn write is a miss)."""
        try:
            return json.loads(self.path(key).read_text())
        except (FileNotFoundError, ValueError):
            return None

    def put(self, key: str, value: Any) -> Path:
        """Store ``value`` under ``key`` atomically (a temporary file renamed); returns the file."""
        self.folder.mkdir(parents=True, exist_ok=True)
        return atomic.write_text(self.path(key), json.dumps(value, default=str))

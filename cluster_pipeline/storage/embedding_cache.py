"""The embedding pass's files: resumable chunks of one pass, and the per-sample cache they are
stored into (docs/design.md, "Storage layout" and "Incremental refresh").

A pass writes ``chunk_<i>.parquet`` files (:data:`CHUNK_SCHEMA`) into its folder, each renamed
into place when complete, so a killed pass resumes from the chunks it finished. The cache keeps
one Delta row per ``sample_id`` under a folder keyed by model, tokenizer and settings; a refresh
embeds only the samples it lacks. polars and deltalake only: the Dagster assets read it without
loading torch.
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from cluster_pipeline.storage.atomic import atomic_folder
from cluster_pipeline.storage.cache import model_fingerprint, stable_hash
from cluster_pipeline.storage.disk import is_disk_full, naming_full_disk, require_space

CHUNK_SCHEMA = {
    "sample_id": pl.String,
    "n_tokens": pl.Int64,
    "n_response_tokens": pl.Int64,
    "truncated": pl.Boolean,
    # What truncation cut: "prompt_start", "response_end", both joined by "+", or null.
    "truncation": pl.String,
    "skip_reason": pl.String,
    "mean_loss": pl.Float32,
    "embedding": pl.List(pl.Float32),
    "hidden_mean": pl.List(pl.Float32),
}


# Bumped when the chunk schema changes, so cached chunks of an older schema are not reused.
CHUNK_FORMAT = 3


PASS_STATS = "pass_stats.json"


# In a cache folder: the Delta table of embedded samples, and one line of pass_stats per pass.
CACHE_TABLE = "samples"


PASS_LOG = "passes.jsonl"


# The list of samples a pass embeds, in its folder.
PASS_IDS = "sample_ids.parquet"


def chunk_path(chunk_dir: Path, index: int) -> Path:
    """The file of chunk ``index`` of a pass."""
    return chunk_dir / f"chunk_{index:06d}.parquet"


def n_chunks(n_samples: int, chunk_size: int) -> int:
    """Chunks of a pass over ``n_samples``: ceil(n / chunk_size)."""
    return math.ceil(n_samples / chunk_size)


def chunks_done(chunk_dir: Path, n_samples: int, chunk_size: int) -> int:
    """How many of the pass's chunk files already exist."""
    return sum(chunk_path(chunk_dir, i).exists() for i in range(n_chunks(n_samples, chunk_size)))


def read_pass_stats(chunk_dir: Path) -> dict[str, Any]:
    """samples, tokens, seconds (slowest rank), world_size, peak memory, ``packed`` and
    ``warnings`` of the pass that wrote the chunks ({} before it finished)."""
    path = chunk_dir / PASS_STATS
    return json.loads(path.read_text()) if path.exists() else {}


def gather_chunks(chunk_dir: Path, sample_ids: list[str], chunk_size: int) -> pl.DataFrame:
    """Concatenate the chunk files of a finished pass, in sample order.

    Raises:
        FileNotFoundError: a chunk is missing (the pass did not finish).
        ValueError: the chunks hold other samples than ``sample_ids`` (another pass's files).
    """
    total = n_chunks(len(sample_ids), chunk_size)
    missing = [i for i in range(total) if not chunk_path(chunk_dir, i).exists()]
    if missing:
        raise FileNotFoundError(f"{chunk_dir}: chunks {missing[:5]} of {total} are missing")
    frame = pl.concat([pl.read_parquet(chunk_path(chunk_dir, i)) for i in range(total)])
    if frame["sample_id"].to_list() != list(sample_ids):
        raise ValueError(f"{chunk_dir}: the chunks do not hold the expected samples in order")
    return frame


class CacheUnreadable(RuntimeError):
    """The per-sample cache's files are damaged (deleted, truncated or edited by hand)."""


def _unreadable(cache_dir: Path, e: BaseException) -> CacheUnreadable:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return CacheUnreadable(
        f"the embedding cache {cache_dir / CACHE_TABLE} cannot be read ({type(e).__name__}: "
        f"{first[:300]}); re-run proxy_embeddings with recompute: true to rebuild it (the cache "
        "is replaced only once the new pass has finished; the proxy_embeddings table is "
        "untouched)"
    )


def _read_cache(cache_dir: Path, read):
    """``read()`` on the cache table, its failures (Python errors and the Rust panics of a
    damaged Delta table, which pyo3 raises as BaseException) as :class:`CacheUnreadable`."""
    try:
        return read()
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as e:  # noqa: BLE001  (pyo3's PanicException is a BaseException)
        if is_disk_full(e):  # a full disk, not a damaged cache: the caller names it
            raise
        raise _unreadable(cache_dir, e) from e


def pending_ids(cache_dir: Path, sample_ids: list[str]) -> list[str]:
    """The ``sample_ids`` (in their order) the cache folder has no embedding for.

    Raises:
        CacheUnreadable: the cache table is damaged.
    """
    table = cache_dir / CACHE_TABLE
    if not (table / "_delta_log").exists():
        return list(sample_ids)
    cached = set(
        _read_cache(cache_dir, lambda: pl.read_delta(str(table), columns=["sample_id"]))[
            "sample_id"
        ].to_list()
    )
    return [s for s in sample_ids if s not in cached]


def write_pass_ids(pass_dir: Path, sample_ids: list[str]) -> Path:
    """Write the samples a pass embeds (read back by :func:`run_pass`)."""
    pass_dir.mkdir(parents=True, exist_ok=True)
    path = pass_dir / PASS_IDS
    pl.DataFrame({"sample_id": sample_ids}, schema={"sample_id": pl.String}).write_parquet(path)
    return path


def store_pass(
    cache_dir: Path, pass_dir: Path, sample_ids: list[str], chunk_size: int, replace: bool = False
) -> dict[str, Any]:
    """Add a finished pass's chunks to the cache table, log its stats (returned:
    :func:`read_pass_stats`), and remove its folder.

    Appending is one Delta commit, so a crash leaves the cache as it was or with the whole
    pass. ``replace``: the pass becomes the whole cache (``recompute``); the new table is
    written beside the old one and swapped in, so a failure before this point, or a damaged
    old table, loses nothing that was readable.

    Raises:
        FileNotFoundError / ValueError: as :func:`gather_chunks`.
        CacheUnreadable: appending to a damaged cache table failed.
        DiskFull: the cache's disk lacks the room for the pass's rows (checked first, the
            cache left as it was), or ran out while writing.
    """
    import shutil

    chunks = gather_chunks(pass_dir, sample_ids, chunk_size)
    table, log = cache_dir / CACHE_TABLE, cache_dir / PASS_LOG
    stats = read_pass_stats(pass_dir)
    line = json.dumps(stats) + "\n"
    what, needed = f"add the embedding pass to the cache {table}", int(chunks.estimated_size())
    require_space(cache_dir, needed, what)
    if replace:
        # What a replacement killed mid-way left (the cache is written under the partition's
        # run lock, so no other writer's folder is removed).
        for stale in cache_dir.glob(f".{CACHE_TABLE}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        with naming_full_disk(cache_dir, needed, what), atomic_folder(table) as fresh:
            chunks.write_delta(str(fresh))
        log.write_text(line)
    else:
        with naming_full_disk(cache_dir, needed, what):
            _read_cache(cache_dir, lambda: chunks.write_delta(str(table), mode="append"))
        with log.open("a") as f:
            f.write(line)
    shutil.rmtree(pass_dir, ignore_errors=True)
    return stats


def cached_pass_stats(cache_dir: Path) -> dict[str, float]:
    """Totals over every pass logged in a cache folder: samples, tokens, seconds (each pass's
    slowest rank), passes, and the peaks ``peak_rss_bytes`` / ``peak_cuda_bytes`` (the largest
    rank's, maximum over the passes that recorded them). {} before the first pass. Lines that
    are not JSON objects (a log edited by hand) are left out: the figures are informative, not
    needed."""
    path = cache_dir / PASS_LOG
    if not path.exists():
        return {}
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    totals = {
        key: float(sum(float(r.get(key, 0.0)) for r in rows))
        for key in ("samples", "tokens", "seconds")
    }
    # The largest rank's peak memory over the passes that recorded one (bytes).
    peaks = {
        key: max(float(r[key]) for r in rows if key in r)
        for key in ("peak_rss_bytes", "peak_cuda_bytes")
        if any(key in r for r in rows)
    }
    return {**totals, **peaks, "passes": float(len(rows))}


def read_cached(cache_dir: Path, sample_ids: list[str]) -> pl.DataFrame:
    """The cached chunk rows (:data:`CHUNK_SCHEMA`) of ``sample_ids``, in that order.

    Raises:
        FileNotFoundError: some samples have no cached row (names how many and one of them).
        CacheUnreadable: the cache table is damaged.
    """
    wanted = pl.DataFrame({"sample_id": sample_ids}, schema={"sample_id": pl.String})
    table = cache_dir / CACHE_TABLE
    if not (table / "_delta_log").exists():
        raise FileNotFoundError(f"{cache_dir}: no embeddings cached yet")
    cached = _read_cache(
        cache_dir,
        lambda: (
            pl.scan_delta(str(table))
            .join(wanted.lazy(), on="sample_id", how="semi")
            .unique("sample_id", keep="last", maintain_order=True)
            .collect()
        ),
    )
    frame = wanted.join(cached, on="sample_id", how="left", maintain_order="left")
    missing = frame.filter(pl.col("n_tokens").is_null())["sample_id"]
    if len(missing):
        raise FileNotFoundError(
            f"{cache_dir}: {len(missing)} samples (e.g. {missing[0]!r}) have no cached embedding"
        )
    return frame.select(list(CHUNK_SCHEMA))


def cache_key(model_path: str, cache_fields: dict) -> str:
    """The cache folder's key: what changes the numbers (the model's files, the settings that
    change the embeddings, the chunk format), not the pool, so a refresh after new data embeds
    only the new samples."""
    return stable_hash(model_fingerprint(model_path), cache_fields, CHUNK_FORMAT)


@dataclass(frozen=True)
class PendingPass:
    """The samples a pass must embed, the folder its chunks go to (named by those samples, so
    a killed pass resumes its chunks), the file listing them, and whether its chunks are all
    written already."""

    pass_dir: Path
    sample_ids: list[str]
    ids_file: Path
    finished: bool


def pending_pass(
    cache_dir: Path, sample_ids: list[str], chunk_size: int, recompute: bool
) -> PendingPass | None:
    """The pass the cache at ``cache_dir`` needs for ``sample_ids``: every sample with
    ``recompute`` (the cache is replaced only once the pass has finished), else those it lacks;
    None when it lacks none.

    Raises:
        CacheUnreadable: the cache's files are damaged (the message names the folder).
    """
    cache_dir.mkdir(parents=True, exist_ok=True)
    pending = list(sample_ids) if recompute else pending_ids(cache_dir, sample_ids)
    if not pending:
        return None
    pass_dir = cache_dir / f"pass_{stable_hash(pending)}"
    ids_file = write_pass_ids(pass_dir, pending)
    finished = chunks_done(pass_dir, len(pending), chunk_size) >= n_chunks(len(pending), chunk_size)
    return PendingPass(pass_dir, pending, ids_file, finished)


def pool_seconds(cache_dir: Path, n_samples: int) -> float:
    """What one pass over ``n_samples`` costs at the rate the cache's passes measured
    (seconds; model load excluded): the selection cost of a pool, cached or not."""
    totals = cached_pass_stats(cache_dir)
    return totals.get("seconds", 0.0) / max(totals.get("samples", 0.0), 1.0) * n_samples

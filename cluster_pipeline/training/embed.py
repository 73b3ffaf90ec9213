"""Data-parallel gradient-proxy embedding pass (docs/design.md, step 1), the torchrun entry point.

Launch lines::

    # one process
    python -m cluster_pipeline.training.embed --config embed_job.json
    # W processes on one machine (gloo on CPU, nccl on GPUs)
    torchrun --standalone --nproc_per_node=W -m cluster_pipeline.training.embed \
        --config embed_job.json
    # several machines: same command on each, with
    torchrun --nnodes=2 --node_rank=R --rdzv_backend=c10d --rdzv_endpoint=HOST:29400 \
        --nproc_per_node=W -m cluster_pipeline.training.embed --config embed_job.json

The job file is an :class:`~cluster_pipeline.training.config.EmbedJob`. The training split of the
``raw_instructions`` table version it names (or the samples its ``sample_ids_file`` lists) is cut
into fixed chunks of ``chunk_size`` samples (in table order); rank r embeds chunks i with
i % world_size == r, each written atomically as ``chunk_<i>.parquet`` in ``chunk_dir``. A chunk
file that exists is done, so a killed run restarted with the same job embeds only the missing
chunks.

Per-sample cache (incremental refresh): embeddings are kept in a Delta table per (model,
tokenizer, settings) folder, one row per ``sample_id`` (a content hash, so an edited sample is a
new id). :func:`pending_ids` lists the samples it lacks, a pass embeds only those, and
:func:`store_pass` appends them; :func:`read_cached` then gives the rows of any pool, in its
order, and :func:`assemble_table` adds the normalised columns. A nightly refresh after new data
therefore costs in proportion to the new samples, not to the pool.
"""

if __name__ == "__main__":
    # Before torch loads (seconds): a rank must not outlive a launcher killed meanwhile.
    from cluster_pipeline.training.fate import die_with_parent

    die_with_parent()

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import torch
from torch.distributed.elastic.multiprocessing.errors import record

from cluster_pipeline.core.datasets import EMBEDDING_COLUMNS, read_instructions
from cluster_pipeline.core.embedding import embed_samples, l2_normalise
from cluster_pipeline.core.modeling import load_model_and_tokenizer
from cluster_pipeline.core.packing import can_pack
from cluster_pipeline.core.tables import series_to_matrix, vectors_to_series
from cluster_pipeline.core.tokenization import encode_rows
from cluster_pipeline.training.config import EmbedJob, EmbedSettings
from cluster_pipeline.training.distributed import all_gather_floats, run_entry_point
from cluster_pipeline.training.fate import check_alive

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
# The representations a pass stores, by name: raw column (normalised: "<column>_normalised").
REPRESENTATIONS = {"gradient_proxy": "embedding", "hidden_mean": "hidden_mean"}


PASS_STATS = "pass_stats.json"
# In a cache folder: the Delta table of embedded samples, and one line of pass_stats per pass.
CACHE_TABLE = "samples"
PASS_LOG = "passes.jsonl"
# The list of samples a pass embeds, in its folder.
PASS_IDS = "sample_ids.parquet"


def chunk_path(chunk_dir: Path, index: int) -> Path:
    return chunk_dir / f"chunk_{index:06d}.parquet"


def n_chunks(n_samples: int, chunk_size: int) -> int:
    return math.ceil(n_samples / chunk_size)


def chunks_done(chunk_dir: Path, n_samples: int, chunk_size: int) -> int:
    """How many of the pass's chunk files already exist."""
    return sum(chunk_path(chunk_dir, i).exists() for i in range(n_chunks(n_samples, chunk_size)))


def read_pass_stats(chunk_dir: Path) -> dict[str, float]:
    """samples, tokens, seconds (slowest rank) and world_size of the pass that wrote the
    chunks ({} before it finished)."""
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


def read_train_split(uri: str, version: int) -> pl.DataFrame:
    """The training split of a raw_instructions version, in table order: the columns a sample
    is rendered from and its source file and line (named when it cannot be rendered)."""
    frame = read_instructions(uri, version, ["split", *EMBEDDING_COLUMNS])
    return frame.filter(pl.col("split") == "train").drop("split")


@dataclass(frozen=True)
class EmbeddingTable:
    """The ``proxy_embeddings`` table of a finished pass and what it holds.

    Attributes:
        frame: :data:`CHUNK_SCHEMA` plus ``embedding_normalised`` and
            ``hidden_mean_normalised`` (List(Float32), L2-normalised; null where skipped), one
            row per training sample in table order.
        embedded: samples with an embedding.
        skipped: skip reason -> count.
        hidden_size: d.
        truncated: truncation kind -> count of embedded samples that truncation cut.
    """

    frame: pl.DataFrame
    embedded: int
    skipped: dict[str, int]
    hidden_size: int
    truncated: dict[str, int]


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
) -> dict[str, float]:
    """Add a finished pass's chunks to the cache table, log its stats (returned:
    :func:`read_pass_stats`), and remove its folder.

    Appending is one Delta commit, so a crash leaves the cache as it was or with the whole
    pass. ``replace``: the pass becomes the whole cache (``recompute``); the new table is
    written beside the old one and swapped in, so a failure before this point, or a damaged
    old table, loses nothing that was readable.

    Raises:
        FileNotFoundError / ValueError: as :func:`gather_chunks`.
        CacheUnreadable: appending to a damaged cache table failed.
    """
    import shutil

    chunks = gather_chunks(pass_dir, sample_ids, chunk_size)
    table, log = cache_dir / CACHE_TABLE, cache_dir / PASS_LOG
    stats = read_pass_stats(pass_dir)
    line = json.dumps(stats) + "\n"
    if replace:
        fresh, old = cache_dir / f"{CACHE_TABLE}.new", cache_dir / f"{CACHE_TABLE}.old"
        shutil.rmtree(fresh, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
        chunks.write_delta(str(fresh))
        if table.exists():
            table.rename(old)
        fresh.rename(table)
        shutil.rmtree(old, ignore_errors=True)
        log.write_text(line)
    else:
        _read_cache(cache_dir, lambda: chunks.write_delta(str(table), mode="append"))
        with log.open("a") as f:
            f.write(line)
    shutil.rmtree(pass_dir, ignore_errors=True)
    return stats


def cached_pass_stats(cache_dir: Path) -> dict[str, float]:
    """Totals over every pass logged in a cache folder: samples, tokens, seconds (each pass's
    slowest rank), passes. {} before the first pass. Lines that are not JSON objects (a log
    edited by hand) are left out: the figures are informative, not needed."""
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
    return {**totals, "passes": float(len(rows))}


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


def assemble_table(chunks: pl.DataFrame) -> EmbeddingTable:
    """Add the L2-normalised embeddings to a pool's chunk rows (:data:`CHUNK_SCHEMA`, e.g. from
    :func:`read_cached`).

    Raises:
        ValueError: no sample was embedded (every one was skipped).
    """
    ok = chunks["skip_reason"].is_null().to_numpy()
    if not ok.any():
        raise ValueError(
            "no sample has a response token within max_length; raise max_length "
            "or check the responses"
        )
    frame, d = chunks, 0
    for column in REPRESENTATIONS.values():
        matrix = series_to_matrix(chunks.filter(pl.Series(ok))[column])
        d = int(matrix.shape[1])
        normalised = np.zeros((chunks.height, d), dtype=np.float32)
        normalised[ok] = l2_normalise(matrix)
        name = f"{column}_normalised"
        frame = frame.with_columns(vectors_to_series(name, normalised)).with_columns(
            pl.when(pl.col("skip_reason").is_null()).then(pl.col(name)).alias(name)
        )
    skipped = frame.filter(pl.Series(~ok)).group_by("skip_reason").len().sort("skip_reason")
    cut = (
        frame.filter(pl.Series(ok) & pl.col("truncation").is_not_null())
        .group_by("truncation")
        .len()
        .sort("truncation")
    )
    return EmbeddingTable(
        frame,
        int(ok.sum()),
        dict(zip(skipped["skip_reason"], skipped["len"], strict=True)),
        d,
        dict(zip(cut["truncation"], cut["len"], strict=True)),
    )


def embed_frame(
    model,
    tokenizer,
    frame: pl.DataFrame,
    settings: EmbedSettings,
    lm_head_chunk_rows: int = 1024,
    on_batch=None,
) -> pl.DataFrame:
    """Embed every sample of ``frame`` (columns sample_id, system, prompt, response, and
    optionally messages), encoded under ``settings`` (max_length, truncation, response_turns).

    Returns a frame with :data:`CHUNK_SCHEMA`, rows in the order of ``frame``. Samples with no
    response token get a ``skip_reason`` and a null embedding.
    """
    encoded = encode_rows(tokenizer, frame, settings)
    n = len(encoded)
    out, _ = embed_samples(
        model,
        encoded,
        tokenizer.pad_token_id,
        max_batch_size=settings.max_batch_size,
        max_batch_tokens=settings.max_batch_tokens,
        packing=settings.packing,
        max_packed_length=settings.max_packed_length,
        chunk_rows=lm_head_chunk_rows,
        autocast_dtype=torch.bfloat16 if settings.bf16 else None,
        on_batch=on_batch,
    )
    emb, hmean, loss = out.embedding, out.hidden_mean, out.mean_loss
    n_resp = np.array([e.n_response_tokens for e in encoded], dtype=np.int64)
    skip = [e.skip_reason for e in encoded]
    vectors = [None if skip[i] else emb[i].tolist() for i in range(n)]
    means = [None if skip[i] else hmean[i].tolist() for i in range(n)]
    return pl.DataFrame(
        {
            "sample_id": frame["sample_id"],
            "n_tokens": [len(e) for e in encoded],
            "n_response_tokens": n_resp,
            "truncated": [e.truncated for e in encoded],
            "truncation": [e.truncation_kind for e in encoded],
            "skip_reason": skip,
            "mean_loss": [None if skip[i] else float(loss[i]) for i in range(n)],
            "embedding": vectors,
            "hidden_mean": means,
        },
        schema=CHUNK_SCHEMA,
    )


@record
def main(argv: list[str] | None = None) -> None:
    run_entry_point(EmbedJob, run_pass, argv, __doc__ or "")


def run_pass(job: EmbedJob, env, report) -> None:
    """This rank's share of the pass: embed its missing chunks, then (rank 0) write the pass's
    throughput to ``pass_stats.json``."""
    cfg = job.settings
    chunk_dir = Path(job.chunk_dir)
    chunk_dir.mkdir(parents=True, exist_ok=True)
    # Half-written chunks of a killed run were never renamed, so never counted as done.
    for orphan in chunk_dir.glob(f"chunk_*.tmp-rank{env.rank}"):
        orphan.unlink(missing_ok=True)
    frame = read_train_split(job.instructions_uri, job.instructions_version)
    if job.sample_ids_file:
        wanted = pl.read_parquet(job.sample_ids_file)["sample_id"]
        frame = frame.filter(pl.col("sample_id").is_in(wanted.implode()))
    total = n_chunks(frame.height, cfg.chunk_size)
    mine = [i for i in range(total) if i % env.world_size == env.rank]
    todo = [i for i in mine if not chunk_path(chunk_dir, i).exists()]
    already = chunks_done(chunk_dir, frame.height, cfg.chunk_size)
    report.info(
        f"embedding {frame.height} samples in {total} chunks on {env.world_size} rank(s); "
        f"{already} chunk(s) already done"
    )
    torch.manual_seed(0)
    model, tokenizer = load_model_and_tokenizer(job.model_path, device=str(env.device))
    progress_file = chunk_dir / f"progress_rank{env.rank}.json"
    progress_file.unlink(missing_ok=True)  # counts of an earlier, interrupted run
    state: dict[str, Any] = {"samples": 0, "tokens": 0, "start": time.time(), "last": 0.0}
    done_before = sum(
        min(cfg.chunk_size, frame.height - i * cfg.chunk_size)
        for i in range(total)
        if chunk_path(chunk_dir, i).exists()
    )

    def on_batch(samples: int, tokens: int) -> None:
        state["samples"] += samples
        state["tokens"] += tokens
        now = time.time()
        if now - state["last"] < job.progress_every_s:
            return
        state["last"] = now
        progress_file.write_text(
            json.dumps({"samples": state["samples"], "tokens": state["tokens"]})
        )
        if env.is_main:
            samples_all, tokens_all = 0, 0
            for p in chunk_dir.glob("progress_rank*.json"):
                counts = json.loads(p.read_text())
                samples_all += counts["samples"]
                tokens_all += counts["tokens"]
            elapsed = now - state["start"]
            done = done_before + samples_all
            rate = samples_all / elapsed if elapsed > 0 else 0.0
            eta = (frame.height - done) / rate if rate > 0 else float("nan")
            report.info(
                f"embedded {done}/{frame.height} samples, {tokens_all / elapsed:.0f} tokens/s, "
                f"ETA {eta:.0f} s"
            )

    if cfg.packing and not can_pack(model):
        report.info(
            f"packing is on but {type(model).__name__} attends across packed samples "
            "(core/packing.can_pack): embedding with padded batches"
        )
    for i in todo:
        rows = frame.slice(i * cfg.chunk_size, cfg.chunk_size)
        out = embed_frame(model, tokenizer, rows, cfg, job.lm_head_chunk_rows, on_batch)
        target = chunk_path(chunk_dir, i)
        tmp = target.with_name(f"{target.name}.tmp-rank{env.rank}")
        out.write_parquet(tmp)
        check_alive(f"write embedding chunk {target}")
        os.replace(tmp, target)
    elapsed = time.time() - state["start"]
    totals = [state["samples"], state["tokens"], elapsed]
    gathered = all_gather_floats([float(x) for x in totals], env)
    report.info(
        f"embedding pass done: {sum(g[0] for g in gathered):.0f} samples, "
        f"{sum(g[1] for g in gathered) / max(max(g[2] for g in gathered), 1e-9):.0f} tokens/s"
    )
    if env.is_main:
        (chunk_dir / PASS_STATS).write_text(
            json.dumps(
                {
                    "samples": sum(g[0] for g in gathered),
                    "tokens": sum(g[1] for g in gathered),
                    "seconds": max(g[2] for g in gathered),
                    "world_size": env.world_size,
                }
            )
        )


if __name__ == "__main__":
    main()

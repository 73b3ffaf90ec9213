"""One rank's share of the gradient-proxy embedding pass (docs/design.md, step 1): the training
split cut into chunks of ``chunk_size``, rank r embedding chunks i with i mod W = r, each chunk
written when complete (resumable), throughput and progress reported. With
``EmbedJob.gradients`` the same chunks hold less's projected per-sample gradients instead
(training/gradient_pass.py). The ``python -m`` entry
point is :mod:`cluster_pipeline.recipes.embed`.
"""

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import torch

from cluster_pipeline.data.attention import use_packed_attention
from cluster_pipeline.data.datasets import read_train_split
from cluster_pipeline.data.packing import pack_check_cached
from cluster_pipeline.data.tokenization import (
    encode_rows,
    end_of_turn_ids,
    generation_header,
    without_end_of_turn,
)
from cluster_pipeline.data.tokenization import response_only as without_prompt
from cluster_pipeline.launch.fate import check_alive
from cluster_pipeline.models.loading import load_model_and_tokenizer
from cluster_pipeline.selection.embedding import embed_samples
from cluster_pipeline.storage.atomic import atomic_file, write_text
from cluster_pipeline.storage.disk import naming_full_disk, require_space
from cluster_pipeline.storage.embedding_cache import (
    CHUNK_SCHEMA,
    PASS_STATS,
    chunk_path,
    chunks_done,
    n_chunks,
)
from cluster_pipeline.training.config import EmbedJob, EmbedSettings
from cluster_pipeline.training.distributed import all_gather_floats, step_eta
from cluster_pipeline.training.memory import peak_memory_bytes


def embed_frame(
    model,
    tokenizer,
    frame: pl.DataFrame,
    settings: EmbedSettings,
    lm_head_chunk_rows: int = 1024,
    on_batch=None,
    response_only: bool = False,
    end_of_turn: bool = True,
    pooling: str = "response_mean",
) -> pl.DataFrame:
    """Embed every sample of ``frame`` (columns sample_id, system, prompt, response, and
    optionally messages), encoded under ``settings`` (max_length, truncation, response_turns).
    ``response_only``: each sample's response tokens without its prompt
    (:func:`~cluster_pipeline.data.tokenization.response_only`, ifd's unconditioned pass), so
    ``mean_loss`` is the loss of the response alone over the same tokens. ``end_of_turn=False``:
    the trained turns' closing tokens are not scored
    (:func:`~cluster_pipeline.data.tokenization.without_end_of_turn`, ifd's passes).
    ``pooling``: what ``hidden_mean`` pools (selection/embedding.py).

    Returns a frame with :data:`CHUNK_SCHEMA`, rows in the order of ``frame``. Samples with no
    response token get a ``skip_reason`` and a null embedding.
    """
    encoded = encode_rows(tokenizer, frame, settings)
    if not end_of_turn:
        closing = end_of_turn_ids(tokenizer)
        encoded = [without_end_of_turn(e, closing) for e in encoded]
    if response_only:
        header = generation_header(tokenizer)
        encoded = [without_prompt(e, tokenizer, header) for e in encoded]
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
        pooling="position_weighted" if pooling == "position_weighted" else "response_mean",
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


def run_pass(job: EmbedJob, env, report) -> None:
    """This rank's share of the pass: embed its missing chunks, then (rank 0) write the pass's
    throughput to ``pass_stats.json``."""
    cfg = job.settings
    chunk_dir = Path(job.chunk_dir)
    chunk_dir.mkdir(parents=True, exist_ok=True)
    # Half-written chunks of a killed run were never renamed, so never counted as done; each
    # rank clears only the chunks it owns (another rank may be writing its own now).
    for orphan in chunk_dir.glob(".chunk_*.tmp-*"):
        if int(orphan.name.split("_")[1].split(".")[0]) % env.world_size == env.rank:
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
    report.doing(f"loading the model {job.model_path}", say=False)
    model, tokenizer = load_model_and_tokenizer(job.model_path, device=str(env.device))
    gradients = None
    if job.gradients is not None:  # less's gradient pass (training/gradient_pass.py)
        from cluster_pipeline.training.gradient_pass import GradientModel

        gradients = GradientModel(model, job.gradients, env.device)
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
        # Whole or not at all (rank 0 reads the other ranks' files as they write them), and a
        # full disk named as for the chunks.
        with naming_full_disk(chunk_dir, None, f"write the pass's progress {progress_file}"):
            write_text(
                progress_file, json.dumps({"samples": state["samples"], "tokens": state["tokens"]})
            )
        if env.is_main:
            samples_all, tokens_all = 0, 0
            for p in chunk_dir.glob("progress_rank*.json"):
                counts = json.loads(p.read_text())
                samples_all += counts["samples"]
                tokens_all += counts["tokens"]
            elapsed = now - state["start"]
            done = done_before + samples_all
            report.info(
                f"embedded {done}/{frame.height} samples, {tokens_all / elapsed:.0f} tokens/s"
                + step_eta(samples_all, frame.height - done, elapsed)
            )
            report.doing(f"embedding samples ({done}/{frame.height} done)", say=False)

    # Whether this pass's batches were packed, and why not where the gate refused: the pass's
    # figures carry both to proxy_embeddings' metadata, not only to the log.
    packed: bool | None = None
    pass_warnings: list[str] = []
    if gradients is None:
        # The pass owns its model: packed batches attend with the variable-length kernel on a
        # GPU for the whole pass (data/attention.py), checked once (embed_samples reuses it).
        report.info(f"packed rows attend with {use_packed_attention(model, env.device.type)}")
        check = pack_check_cached(model) if cfg.packing else None
        packed = check is not None and check.ok
        if check is not None and not check.ok:
            pass_warnings.append(
                check.reason(type(model).__name__)
                + " (data/packing.pack_check): embedding with padded batches"
            )
            report.warning(pass_warnings[-1])
    report.doing(f"embedding samples ({done_before}/{frame.height} done)", say=False)
    for i in todo:
        rows = frame.slice(i * cfg.chunk_size, cfg.chunk_size)
        if gradients is not None:
            from cluster_pipeline.training.gradient_pass import gradient_frame

            out = gradient_frame(gradients, tokenizer, rows, cfg, on_batch)
        else:
            out = embed_frame(
                model,
                tokenizer,
                rows,
                cfg,
                job.lm_head_chunk_rows,
                on_batch,
                job.response_only,
                job.end_of_turn,
                job.pooling,
            )
        target = chunk_path(chunk_dir, i)
        what, needed = f"write embedding chunk {target}", int(out.estimated_size())
        require_space(chunk_dir, needed, what)
        # A torn chunk is removed (it would keep the disk full), and a step that died meanwhile
        # must not gain a chunk: raising inside atomic_file removes it.
        with naming_full_disk(chunk_dir, needed, what), atomic_file(target) as tmp:
            out.write_parquet(tmp)
            check_alive(what)
    elapsed = time.time() - state["start"]
    totals = [state["samples"], state["tokens"], elapsed, *peak_memory_bytes()]
    gathered = all_gather_floats([float(x) for x in totals], env)
    report.info(
        f"embedding pass done: {sum(g[0] for g in gathered):.0f} samples, "
        f"{sum(g[1] for g in gathered) / max(max(g[2] for g in gathered), 1e-9):.0f} tokens/s"
    )
    if env.is_main:
        stats_file = chunk_dir / PASS_STATS
        stats = {
            "samples": sum(g[0] for g in gathered),
            "tokens": sum(g[1] for g in gathered),
            "seconds": max(g[2] for g in gathered),
            "world_size": env.world_size,
            # The largest rank's peaks (bytes; CUDA 0 on the CPU).
            "peak_rss_bytes": max(g[3] for g in gathered),
            "peak_cuda_bytes": max(g[4] for g in gathered),
            # Rank 0's verdict (every rank holds the same model): packed batches, and the
            # packing gate's refusal (None: a gradient pass, which pads).
            "packed": packed,
            "warnings": pass_warnings,
        }
        with naming_full_disk(chunk_dir, None, f"write the pass's figures {stats_file}"):
            write_text(stats_file, json.dumps(stats))

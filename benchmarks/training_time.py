"""Training wall time: full data vs a CluSTER subset of about 40 %, same settings, same run.

    python benchmarks/training_time.py [--samples 256] [--ratio 0.4] [--max-length 128]

Builds a pool from the built-in python_stdlib dataset, embeds it with SmolLM2-135M-Instruct
(the real proxy embedding), clusters it into K = 2 balanced clusters, and trains twice under
``torchrun --nproc_per_node=2`` with identical settings: once on all samples (``full``, weight 1),
once on the peripheral subset with r = --ratio (re-weighted). Prints both wall times (torchrun
start to exit, and the training loop alone) and their ratio; target <= 0.45 at ~40 % of the data.
"""

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path

from arguments import fraction, positive_int

from cluster_pipeline.launch.torchrun import RECIPES, torchrun_command

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--samples", type=positive_int, default=256)
    p.add_argument("--ratio", type=fraction, default=0.4)
    p.add_argument("--max-length", type=positive_int, default=128)
    p.add_argument("--batch-size", type=positive_int, default=4)
    args = p.parse_args()

    from cluster_pipeline.data.datasets import build_instruction_table
    from cluster_pipeline.data.stdlib_dataset import iter_stdlib_samples
    from cluster_pipeline.models.loading import (
        BUILTIN_MODEL,
        load_model_and_tokenizer,
        resolve_model,
    )
    from cluster_pipeline.selection.clustering import balanced_kmeans
    from cluster_pipeline.selection.embedding_table import l2_normalise
    from cluster_pipeline.selection.selectors import select
    from cluster_pipeline.selection.sharding import allocate
    from cluster_pipeline.storage.tables import series_to_matrix, write_table
    from cluster_pipeline.training.config import EmbedSettings, TrainJob, TrainSettings
    from cluster_pipeline.training.embedding_pass import embed_frame

    work = Path(tempfile.mkdtemp(prefix="training_time_"))
    model_path = resolve_model(BUILTIN_MODEL, ROOT / "data" / "models")
    frame, _ = build_instruction_table(iter_stdlib_samples(), 0.0, None, args.samples, seed=0)
    table = write_table(frame, work / "raw")

    t0 = time.perf_counter()
    model, tokenizer = load_model_and_tokenizer(model_path)
    emb = embed_frame(
        model,
        tokenizer,
        frame.select("sample_id", "system", "prompt", "response"),
        EmbedSettings(max_length=args.max_length),
    )
    del model
    emb = emb.filter(emb["skip_reason"].is_null())
    x = l2_normalise(series_to_matrix(emb["embedding"]))
    clusters = balanced_kmeans(x, 2, seed=0)
    embed_s = time.perf_counter() - t0
    ids = emb["sample_id"].to_numpy()

    results = {}
    for selector, r in (("full", 1.0), ("peripheral", args.ratio)):
        sel = select(clusters.labels, clusters.sq_distance, 2, selector, r, seed=0)
        alloc = allocate("bench", ids, clusters.labels, sel, 2, seed=0)
        paths = [str(m.write(work / selector)) for m in alloc.manifests]
        out = work / f"ckpt_{selector}"
        settings = TrainSettings(
            max_length=args.max_length,
            per_device_batch_size=args.batch_size,
            gradient_accumulation_steps=1,
            learning_rate=5e-5,
        )
        TrainJob(
            settings=settings,
            model_path=model_path,
            instructions_uri=table.uri,
            instructions_version=table.version,
            manifests=paths,
            output_dir=str(out),
        ).dump(work / f"{selector}.json")
        cmd = torchrun_command(RECIPES["train"], 2, ["--config", str(work / f"{selector}.json")])
        start = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        wall = time.perf_counter() - start
        info = json.loads((out / "training_info.json").read_text())
        results[selector] = {
            "samples": 2 * alloc.shard_size,
            "fraction": 2 * alloc.shard_size / len(ids),
            "wall_s": wall,
            "train_s": info["train_seconds"],
            "steps": info["steps"],
        }

    f, c = results["full"], results["peripheral"]
    print(
        f"pool N={len(ids)} (python_stdlib), max_length={args.max_length}, K=2 ranks, "
        f"batch {args.batch_size}/rank, 1 epoch; embedding + clustering {embed_s:.1f} s"
    )
    for name, r in results.items():
        print(
            f"{name:>10}: {r['samples']:4d} samples ({100 * r['fraction']:.1f}%), "
            f"{r['steps']} steps, "
            f"wall {r['wall_s']:.1f} s, training loop {r['train_s']:.1f} s"
        )
    print(
        f"ratio CluSTER/full: wall {c['wall_s'] / f['wall_s']:.3f}, training loop "
        f"{c['train_s'] / f['train_s']:.3f} (target <= 0.45 at {100 * c['fraction']:.0f}% data)"
    )
    print(
        f"selection + CluSTER training vs full training: "
        f"{(embed_s + c['wall_s']) / f['wall_s']:.3f}"
    )


if __name__ == "__main__":
    main()

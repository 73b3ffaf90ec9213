"""Embedding pass vs a plain forward pass of the same model, on the same samples and batches.

    python benchmarks/embedding_throughput.py [--samples 256] [--max-length 256] [--bf16]

Each mode runs in its own fresh process (so peak RSS is per mode): ``forward`` is
``model(input_ids, attention_mask, position_ids)``, the full forward with its (B, L, V) logits,
as any training or scoring loop calls it; ``embed`` is :func:`cluster_pipeline.selection.embedding.
embed_batch`, the gradient-proxy embedding. Both see the built-in SmolLM2-135M-Instruct and
the first ``--samples`` samples of the built-in python_stdlib dataset, encoded and batched by
length identically. Prints tokens/s for both and their ratio (target >= 0.9) and peak RSS.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from itertools import islice
from pathlib import Path

from arguments import positive_int

ROOT = Path(__file__).resolve().parents[1]


def _batches(tokenizer, n: int, max_length: int, batch_size: int, batch_tokens: int):
    from cluster_pipeline.data.stdlib_dataset import iter_stdlib_samples
    from cluster_pipeline.data.tokenization import collate, encode_sample, length_batches

    encoded = [
        encode_sample(tokenizer, s.system, s.prompt, s.response, max_length)
        for s in islice(iter_stdlib_samples(), n)
    ]
    encoded = [e for e in encoded if e.skip_reason is None]
    groups = length_batches([len(e) for e in encoded], batch_size, batch_tokens)
    return [collate([encoded[i] for i in g], tokenizer.pad_token_id) for g in groups]


def run_mode(args) -> dict:
    import torch

    from cluster_pipeline.models.loading import (
        BUILTIN_MODEL,
        load_model_and_tokenizer,
        resolve_model,
    )
    from cluster_pipeline.selection.embedding import embed_batch

    path = resolve_model(BUILTIN_MODEL, ROOT / "data" / "models")
    model, tokenizer = load_model_and_tokenizer(path)
    batches = _batches(tokenizer, args.samples, args.max_length, args.batch_size, args.batch_tokens)
    autocast = torch.bfloat16 if args.bf16 else None

    def step(batch):
        if args.mode == "embed":
            embed_batch(model, batch, autocast_dtype=autocast)
        else:
            with (
                torch.inference_mode(),
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16),
            ):
                model(
                    input_ids=batch["input_ids"],
                    attention_mask=batch["attention_mask"],
                    position_ids=batch["position_ids"],
                    use_cache=False,
                )

    step(batches[0])  # warm-up
    tokens = sum(int(b["attention_mask"].sum()) for b in batches)
    best = float("inf")
    for _ in range(args.repeats):
        start = time.perf_counter()
        for b in batches:
            step(b)
        best = min(best, time.perf_counter() - start)
    return {
        "mode": args.mode,
        "tokens": tokens,
        "batches": len(batches),
        "seconds": best,
        "tokens_per_s": tokens / best,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--samples", type=positive_int, default=256)
    p.add_argument("--max-length", type=positive_int, default=256)
    p.add_argument("--batch-size", type=positive_int, default=16)
    p.add_argument("--batch-tokens", type=positive_int, default=8192)
    p.add_argument("--repeats", type=positive_int, default=2)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--mode", choices=["forward", "embed"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mode:
        print(json.dumps(run_mode(args)))
        return
    results = {}
    for mode in ("forward", "embed"):
        cmd = [sys.executable, __file__, "--mode", mode] + sys.argv[1:]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        results[mode] = json.loads(out.strip().splitlines()[-1])
    f, e = results["forward"], results["embed"]
    print(
        f"samples={args.samples} max_length={args.max_length} tokens={f['tokens']} "
        f"batches={f['batches']} bf16={args.bf16}"
    )
    for r in (f, e):
        print(
            f"{r['mode']:>8}: {r['tokens_per_s']:8.1f} tokens/s  ({r['seconds']:.2f} s)  "
            f"peak RSS {r['peak_rss_mib']:.0f} MiB"
        )
    print(
        f"ratio embed/forward tokens/s = {e['tokens_per_s'] / f['tokens_per_s']:.3f} "
        "(target >= 0.9)"
    )


if __name__ == "__main__":
    main()

"""How many samples each truncation policy keeps trainable, per dataset.

    python benchmarks/sequence_counts.py [--max-length 256 512] [--datasets NAME ...]

For the built-in python_stdlib dataset and each shared training pool (../shared/datasets/train/),
every sample is encoded with the built-in SmolLM2-135M-Instruct tokenizer exactly as the
embedding pass, training and held-out loss encode it (:func:`cluster_pipeline.data.
tokenization.encode_conversation`), once per ``truncation`` policy, and the counts printed:
trainable samples, skipped by reason, truncated by kind, and the trainable count relative to
``skip`` (the baseline policy, measured in the same run). Tokenization only, no model: about
one minute per 10,000 samples on one CPU core.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

from arguments import positive_int

ROOT = Path(__file__).resolve().parents[1]
SHARED_TRAIN = ROOT.parent / "shared" / "datasets" / "train"


def _samples(name: str):
    from cluster_pipeline.data.formats import read_dataset_folder
    from cluster_pipeline.data.stdlib_dataset import iter_stdlib_samples

    if name == "python_stdlib":
        return list(iter_stdlib_samples())
    matches = sorted(SHARED_TRAIN.glob(f"{name}.*"))
    if not matches:
        sys.exit(f"{SHARED_TRAIN}/{name}.* not found")
    folder = Path("/tmp") / f"sequence_counts_{name}"
    folder.mkdir(exist_ok=True)
    link = folder / matches[0].name
    if not link.exists():
        link.symlink_to(matches[0])
    return list(read_dataset_folder(folder))


def main() -> None:
    from transformers import AutoTokenizer

    from cluster_pipeline.data.formats import conversation
    from cluster_pipeline.data.tokenization import TRUNCATIONS, encode_conversation

    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--max-length", type=positive_int, nargs="+", default=[256, 512])
    p.add_argument(
        "--datasets",
        nargs="+",
        default=[
            "python_stdlib",
            "icliniq_medical",
            "alpaca_cherry_5pct",
            "gpteacher_codegen",
            "fastchat_identity_sharegpt",
        ],
    )
    p.add_argument("--model", default=str(ROOT / "data" / "models" / "smollm2-135m-instruct"))
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "sequence_counts.json")
    args = p.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    rows = []
    for name in args.datasets:
        start = time.perf_counter()
        samples = _samples(name)
        convs = [conversation(s.system, s.prompt, s.response, s.messages) for s in samples]
        for max_length in args.max_length:
            base = None
            for truncation in TRUNCATIONS:
                enc = [encode_conversation(tokenizer, c, max_length, truncation) for c in convs]
                ok = sum(e.skip_reason is None for e in enc)
                base = ok if truncation == "skip" else base
                row = {
                    "dataset": name,
                    "samples": len(enc),
                    "max_length": max_length,
                    "truncation": truncation,
                    "trainable": ok,
                    "vs_skip": round(ok / base, 4) if base else None,
                    "skipped": dict(Counter(e.skip_reason for e in enc if e.skip_reason)),
                    "truncated": dict(
                        Counter(
                            e.truncation_kind
                            for e in enc
                            if e.skip_reason is None and e.truncation_kind
                        )
                    ),
                }
                rows.append(row)
                print(
                    f"{name:28s} L={max_length:4d} {truncation:12s} trainable {ok:5d}/{len(enc)}"
                    f" ({row['vs_skip']}x skip)  skipped {row['skipped']}  truncated "
                    f"{row['truncated']}",
                    flush=True,
                )
        print(f"  ({time.perf_counter() - start:.0f} s)", flush=True)
    args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

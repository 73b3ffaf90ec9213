"""What a run pays before its steps do any work: loading the Definitions, and starting each step
process with the executor's fork server against a fresh Python per step (``spawn``).

    python benchmarks/step_start.py [--runs 3]

1. **Loading the Definitions** (what every ``dagster`` CLI run, code server and daemon does first):
   median wall seconds of a fresh ``python -c "from cluster_pipeline.definitions import defs;
   defs()"`` against a fresh ``python -c "import dagster"`` (the baseline, measured in the same
   run), and which of torch, transformers and matplotlib it imported (none, since
   2026-12-03).
2. **A whole CLI run of the selection chain** (``raw_instructions`` to ``shard_manifests``, five
   steps) on 60 short records and the test suite's tiny random model (2 layers, hidden size 32:
   built here, no download), so that starting the steps, not their work, is what is timed; the
   executor's ``start_method`` is ``spawn`` (the baseline: Dagster's default) and the project's
   default fork server that preloads every stage module; runs interleaved, medians and their
   ratio.

About 4 minutes on 2 CPU cores with ``--runs 3``, in a temporary data folder and Dagster instance
(``product_runs.ProductRun``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from arguments import positive_int
from product_runs import ROOT, ProductRun

sys.path.insert(0, str(ROOT))
from cluster_pipeline_tests.helpers import (  # noqa: E402  (the tests' tiny model and records)
    RUN_CONFIG,
    build_model,
    build_tokenizer,
    tiny_records,
    write_jsonl,
)

CHAIN = [
    "raw_instructions",
    "proxy_embeddings",
    "balanced_clusters",
    "peripheral_subsets",
    "shard_manifests",
]
LOAD = (
    "import json, sys\n"
    "from cluster_pipeline.definitions import defs\n"
    "defs()\n"
    "print(json.dumps([m for m in ('torch', 'transformers', 'matplotlib') if m in sys.modules]))"
)
SPAWN = {"start_method": {"spawn": {}}}


def _seconds(cmd: list[str]) -> tuple[float, str]:
    start = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
    return time.perf_counter() - start, out.stdout


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--runs", type=positive_int, default=3)
    args = p.parse_args()

    bare, load, heavy = [], [], ""
    for _ in range(args.runs):
        bare.append(_seconds([sys.executable, "-c", "import dagster"])[0])
        seconds, heavy = _seconds([sys.executable, "-c", LOAD])
        load.append(seconds)
    b, d = statistics.median(bare), statistics.median(load)
    print(f"python -c 'import dagster'        {b:6.2f} s (baseline)")
    imported = json.loads(heavy)
    print(f"load the Definitions              {d:6.2f} s ({d / b:.2f}x; imports {imported})")

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        records = work / "samples.jsonl"
        write_jsonl(records, tiny_records(60))
        model = work / "model"
        tokenizer = build_tokenizer()
        build_model(len(tokenizer), pad_token_id=tokenizer.pad_token_id).save_pretrained(model)
        tokenizer.save_pretrained(model)
        run = ProductRun(work / "p", "tiny", source=records, model=str(model))
        times: dict[str, list[float]] = {"spawn": [], "forkserver": []}
        for i in range(args.runs):
            for method in times:
                config: dict = {"ops": {s: RUN_CONFIG["ops"].get(s, {}) for s in CHAIN}}
                if method == "spawn":
                    config["execution"] = {"config": SPAWN}
                times[method].append(run.materialize(",".join(CHAIN), config, f"{method}{i}"))
    spawn, fork = statistics.median(times["spawn"]), statistics.median(times["forkserver"])
    runs = {m: ", ".join(f"{t:.1f}" for t in ts) for m, ts in times.items()}
    print(f"selection chain, spawn            {spawn:6.2f} s (baseline; runs {runs['spawn']})")
    print(
        f"selection chain, fork server      {fork:6.2f} s ({fork / spawn:.2f}x; "
        f"runs {runs['forkserver']})"
    )


if __name__ == "__main__":
    main()

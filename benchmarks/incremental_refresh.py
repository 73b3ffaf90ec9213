"""Incremental refresh: after 1 % new samples, the embedding pass embeds only those.

    python benchmarks/incremental_refresh.py [--samples 1000] [--new-fraction 0.01]

Runs the product's own assets (``raw_instructions`` -> ``proxy_embeddings``, through
``dg.materialize`` and torchrun, with SmolLM2-135M-Instruct, the built-in model) on the built-in
python_stdlib dataset: first on ``--samples`` samples, then after appending ``--new-fraction``
more to the same source file (the nightly refresh's situation). Prints, for both runs, the
samples embedded, the embedding pass's own seconds (the slowest rank, model loading excluded) and
the step's wall seconds (process start and model loading included), and the refresh / full
ratios. Target: the refresh costs <= 3 % of a full pass. Finally compares the refreshed table
with a full recompute of the grown pool (max |difference| of the embeddings).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from arguments import fraction, positive_int

ROOT = Path(__file__).resolve().parents[1]


def _write(path: Path, samples) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for s in samples:
            f.write(json.dumps({"instruction": s.prompt, "input": "", "output": s.response}) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument(
        "--samples", type=positive_int, default=1000, help="first pool size (default 1000)"
    )
    p.add_argument("--new-fraction", type=fraction, default=0.01, help="added share (default 0.01)")
    p.add_argument(
        "--max-length", type=positive_int, default=128, help="tokens per sample (default 128)"
    )
    args = p.parse_args()
    if args.samples < 10 or not 0 < args.new_fraction <= 1:
        p.error("need --samples >= 10 and 0 < --new-fraction <= 1")

    import dagster as dg
    import numpy as np

    from cluster_pipeline.data.stdlib_dataset import iter_stdlib_samples
    from cluster_pipeline.defs.assets.proxy_embeddings import proxy_embeddings
    from cluster_pipeline.defs.assets.raw_instructions import raw_instructions
    from cluster_pipeline.defs.partitions import DATASETS
    from cluster_pipeline.defs.resources import BaseModelResource, StorageResource, TorchrunResource

    added = max(1, round(args.samples * args.new_fraction))
    pool = []
    for s in iter_stdlib_samples():
        pool.append(s)
        if len(pool) == args.samples + added:
            break
    work = Path(tempfile.mkdtemp(prefix="incremental_refresh_"))
    data = work / "data"
    (data / "models").parent.mkdir(parents=True, exist_ok=True)
    # The built-in model converted once for this checkout (data/models), not again.
    (data / "models").symlink_to(ROOT / "data" / "models", target_is_directory=True)
    source = data / "raw" / "stdlib" / "samples.jsonl"
    resources = {
        "storage": StorageResource(data_dir=str(data)),
        "base_model": BaseModelResource(),
        "torchrun": TorchrunResource(),
        "pipes_subprocess_client": dg.PipesSubprocessClient(),
    }

    def materialize(instance, **embed) -> dict:
        config = {
            "raw_instructions": {"config": {"max_train_samples": None, "heldout_fraction": 0.0}},
            "proxy_embeddings": {"config": {"max_length": args.max_length, **embed}},
        }
        start = time.perf_counter()
        result = dg.materialize(
            [raw_instructions, proxy_embeddings],
            partition_key="stdlib",
            instance=instance,
            resources=resources,
            run_config={"ops": config},
        )
        assert result.success
        wall = time.perf_counter() - start
        mat = result.asset_materializations_for_node("proxy_embeddings")[-1]
        meta = {k: v.value for k, v in mat.metadata.items()}
        step = next(
            e for e in result.all_events if e.is_step_success and e.step_key == "proxy_embeddings"
        )
        return {
            "embedded_now": int(str(meta["samples_embedded_now"])),
            "reused": int(str(meta["samples_reused"])),
            "pass_s": float(str(meta["embedding_seconds"])),
            "step_s": step.step_success_data.duration_ms / 1000,
            "run_s": wall,
        }

    def embeddings() -> tuple[list[str], np.ndarray]:
        import polars as pl

        from cluster_pipeline.storage.tables import series_to_matrix

        frame = pl.read_delta(str(data / "tables" / "proxy_embeddings" / "stdlib"))
        frame = frame.filter(pl.col("skip_reason").is_null())
        return frame["sample_id"].to_list(), series_to_matrix(frame["embedding"])

    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(DATASETS, ["stdlib"])
        _write(source, pool[: args.samples])
        full = materialize(instance)
        _write(source, pool)
        refresh = materialize(instance)
        ids_r, x_r = embeddings()
        again = materialize(instance, recompute=True)
        ids_f, x_f = embeddings()
    same_rows = ids_r == ids_f
    diff = float(np.abs(x_r - x_f).max()) if same_rows else float("nan")
    print(
        f"first run: {full['embedded_now']} samples embedded, pass {full['pass_s']:.1f} s, "
        f"step {full['step_s']:.1f} s"
    )
    print(
        f"refresh after {added} new source samples ({100 * added / args.samples:.1f} %): "
        f"{refresh['embedded_now']} embedded, {refresh['reused']} from the cache, pass "
        f"{refresh['pass_s']:.1f} s, step {refresh['step_s']:.1f} s"
    )
    print(
        f"    refresh / full: samples {refresh['embedded_now'] / full['embedded_now']:.3f}, pass "
        f"seconds {refresh['pass_s'] / full['pass_s']:.3f} (target <= 0.03), step seconds "
        f"{refresh['step_s'] / full['step_s']:.3f} (process start and model load included); "
        f"a full recompute of the grown pool: pass {again['pass_s']:.1f} s, step "
        f"{again['step_s']:.1f} s"
    )
    print(
        f"    refreshed table vs full recompute: same samples in the same order: {same_rows}; "
        f"max |embedding difference| {diff:.1e} (target <= 1e-5)"
    )


if __name__ == "__main__":
    main()

"""Cluster, select and shard a pool larger than memory, streaming its embeddings from Delta.

    python benchmarks/selection_out_of_core.py --n 1000000            # in-memory vs streaming
    python benchmarks/selection_out_of_core.py --n 10000000 --skip-in-memory

Each run writes a synthetic ``proxy_embeddings``-shaped Delta table (``sample_id``,
``skip_reason``, ``embedding_normalised``: N x d float32, K blobs of Dirichlet-random sizes,
about unit norm) under ``--work``, then, each in a fresh process so peak RSS is its own:

- **in memory** (the baseline, the product's path before streaming): the whole (N, d) matrix
  read into memory, k-means on the same seeded 65,536-row sample, distances, and the capacity
  step as one OR-Tools min-cost flow over all N x K arcs;
- **streaming** (the product's path, ``core.clustering.cluster_table``): two passes over the
  table, the capacity step by dual prices + boundary flow + certificate, then peripheral
  selection, the K shard manifests, and the ``balanced_clusters`` table written to Delta.

Both share the centroids (same sample, same faiss seed), so their capacity-step costs are
directly comparable (target: equal within 1e-6 relative). Targets: peak RSS <= 6 GiB and
<= 15 min at 10M x 1,024 on a 2-core machine.

Disk: 10M x 1,024 float32 is 40 GB in memory, more than this machine's free disk. The values are
therefore drawn on a grid of 255 levels (int8 times a scale, stored as float32), which Parquet's
dictionary encoding keeps at about 1 byte per value (10 GB for 10M rows). Every byte read back is
still float32: the reader, the memory and the arithmetic are those of real embeddings.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from arguments import positive_int

ROWS_PER_WRITE = 200_000


def rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def generate(table: Path, n: int, d: int, k: int, seed: int) -> dict:
    import numpy as np
    import pyarrow as pa
    from deltalake import write_deltalake

    start = time.perf_counter()
    shutil.rmtree(table, ignore_errors=True)
    rng = np.random.default_rng(seed)
    sizes = rng.dirichlet(np.full(k, 2.0))
    # Blob centres and noise on the int8 grid; value = level * scale, |row| about 1.
    scale = np.float32(1.0 / (40.0 * np.sqrt(d)))
    centres = rng.integers(-40, 41, size=(k, d)).astype(np.int16)
    for lo in range(0, n, ROWS_PER_WRITE):
        b = min(ROWS_PER_WRITE, n - lo)
        blob = rng.choice(k, size=b, p=sizes)
        levels = centres[blob] + rng.integers(-48, 49, size=(b, d), dtype=np.int16)
        values = (np.clip(levels, -127, 127).astype(np.float32) * scale).ravel()
        offsets = pa.array(np.arange(0, b * d + 1, d, dtype=np.int32))
        ids = pa.array([f"{i:016x}" for i in range(lo, lo + b)])
        batch = pa.table(
            {
                "sample_id": ids,
                "skip_reason": pa.nulls(b, type=pa.string()),
                "embedding_normalised": pa.ListArray.from_arrays(offsets, pa.array(values)),
            }
        )
        write_deltalake(str(table), batch, mode="append")
    disk = sum(f.stat().st_size for f in table.rglob("*.parquet"))
    return {"seconds": round(time.perf_counter() - start, 1), "disk_gib": round(disk / 2**30, 2)}


def _sample_centroids(x_or_sample, k: int, seed: int):
    from cluster_pipeline.selection.clustering import kmeans

    return kmeans(x_or_sample, k, seed).centroids


def _kmeans_search_cost(sample, k: int, seed: int) -> dict:
    """The product's k-means search (k-means++, 10 runs, up to 300 iterations) on the
    clustering's own sample, timed again on its own, against the search it replaced (one
    random initialisation, 25 iterations), measured in the same process."""
    import faiss
    import numpy as np

    from cluster_pipeline.selection.clustering import kmeans

    t0 = time.perf_counter()
    fit = kmeans(sample, k, seed)
    t1 = time.perf_counter()
    n, d = sample.shape
    old = faiss.Kmeans(
        d, k, niter=25, seed=seed, min_points_per_centroid=1, max_points_per_centroid=-(-n // k)
    )
    old_inertia = float(old.train(np.ascontiguousarray(sample, dtype=np.float32)))
    t2 = time.perf_counter()
    return {
        "kmeans_s": round(t1 - t0, 2),
        "kmeans_old_s": round(t2 - t1, 2),
        "kmeans_inertia": fit.inertia,
        "kmeans_old_inertia": old_inertia,
        "kmeans_restart_iterations": list(fit.restart_iterations),
        "kmeans_sample": n,
    }


def in_memory(table: Path, k: int, seed: int) -> dict:
    import numpy as np

    from cluster_pipeline.selection.clustering import (
        capacity,
        capacity_assignment_flow,
        squared_distances,
    )
    from cluster_pipeline.storage.tables import TableRef

    ref = TableRef(str(table), _version(table))
    t0 = time.perf_counter()
    ids, x = ref.read_vectors("embedding_normalised", keep="skip_reason")
    t1 = time.perf_counter()
    n = len(x)
    # The same seeded sample cluster_stream draws: rng.choice over the table's rows.
    rng = np.random.default_rng(seed)
    rows = np.sort(rng.choice(n, size=min(n, 65536), replace=False))
    centroids = _sample_centroids(x[rows], k, seed)
    dist = np.concatenate(
        [squared_distances(x[lo : lo + 65536], centroids) for lo in range(0, n, 65536)]
    )
    t2 = time.perf_counter()
    labels = capacity_assignment_flow(dist, capacity(n, k, 1.0))
    t3 = time.perf_counter()
    cost = float(dist[np.arange(n), labels].astype(np.float64).sum())
    return {
        "read_s": round(t1 - t0, 1),
        "kmeans_and_distances_s": round(t2 - t1, 1),
        "capacity_s": round(t3 - t2, 1),
        "total_s": round(t3 - t0, 1),
        "peak_rss_gib": round(rss_gib(), 2),
        "cost": cost,
        "centroids": centroids.tolist(),
        "sizes": np.bincount(labels, minlength=k).tolist(),
    }


def streaming(table: Path, out: Path, k: int, seed: int) -> dict:
    import polars as pl

    from cluster_pipeline.selection.clustering import cluster_table
    from cluster_pipeline.selection.selectors import select
    from cluster_pipeline.selection.sharding import allocate, manifest_set_hash
    from cluster_pipeline.storage.tables import TableRef, write_table

    ref = TableRef(str(table), _version(table))
    t0 = time.perf_counter()
    streamed = cluster_table(ref, "embedding_normalised", k, alpha=1.0, seed=seed)
    result = streamed.result
    t1 = time.perf_counter()
    selection = select(result.labels, result.sq_distance, k, "peripheral", 0.5, seed)
    t2 = time.perf_counter()
    allocation = allocate("bench", streamed.sample_ids.to_numpy(), result.labels, selection, k)
    digest = manifest_set_hash(allocation.manifests)
    t3 = time.perf_counter()
    frame = streamed.sample_ids.to_frame().with_columns(
        pl.Series("cluster", result.labels),
        pl.Series("kmeans_cluster", result.kmeans_labels),
        pl.Series("sq_distance", result.sq_distance),
    )
    shutil.rmtree(out, ignore_errors=True)
    write_table(frame, out)
    t4 = time.perf_counter()
    search = _kmeans_search_cost(streamed.kmeans_sample, k, seed)
    return {
        **search,
        "clustering_s": round(t1 - t0, 1),
        "selection_s": round(t2 - t1, 2),
        "manifests_s": round(t3 - t2, 1),
        "write_clusters_s": round(t4 - t3, 1),
        "total_s": round(t4 - t0, 1),
        "peak_rss_gib": round(rss_gib(), 2),
        "cost": result.cost,
        "lower_bound": result.lower_bound,
        "optimality_gap": result.optimality_gap,
        "boundary_samples": result.boundary_samples,
        "kmeans_cost_increase_pct": round(100 * result.cost_increase, 2),
        "centroids": result.centroids.tolist(),
        "sizes": result.sizes.tolist(),
        "cap": result.cap,
        "selected": int(selection.n_selected),
        "shard_size": allocation.shard_size,
        "manifests_hash": digest[:12],
    }


def _version(table: Path) -> int:
    from deltalake import DeltaTable

    return DeltaTable(str(table)).version()


def _child(args: list[str]) -> dict:
    done = subprocess.run(
        [sys.executable, __file__, *args], check=False, capture_output=True, text=True
    )
    if done.returncode:
        sys.exit(f"{' '.join(args)} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--n", type=positive_int, default=1_000_000, help="rows (default 1,000,000)")
    p.add_argument("--d", type=positive_int, default=1024, help="embedding width (default 1,024)")
    p.add_argument("--k", type=positive_int, default=8, help="clusters K (default 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", type=Path, default=Path("/tmp/cluster_pipeline_ooc"))
    p.add_argument("--skip-in-memory", action="store_true", help="only the streaming path")
    p.add_argument(
        "--keep", action="store_true", help="keep the generated table (and reuse a kept one)"
    )
    p.add_argument(
        "--stage", choices=["generate", "in_memory", "streaming"], help=argparse.SUPPRESS
    )
    args = p.parse_args()
    if args.n < args.k or args.k < 1 or args.d < 1 or args.seed < 0:
        p.error("need 1 <= K <= N, d >= 1 and seed >= 0")
    table, out = args.work / f"embeddings_{args.n}x{args.d}", args.work / "balanced_clusters"
    if args.stage == "generate":
        print(json.dumps(generate(table, args.n, args.d, args.k, args.seed)))
        return
    if args.stage == "in_memory":
        print(json.dumps(in_memory(table, args.k, args.seed)))
        return
    if args.stage == "streaming":
        print(json.dumps(streaming(table, out, args.k, args.seed)))
        return
    common = ["--n", str(args.n), "--d", str(args.d), "--k", str(args.k), "--seed", str(args.seed)]
    common += ["--work", str(args.work)]
    if args.keep and (table / "_delta_log").exists():
        from cluster_pipeline.storage.tables import TableRef

        rows = TableRef(str(table), _version(table)).row_count()
        if rows != args.n:
            p.error(f"{table} holds {rows} rows, not {args.n}: remove it or drop --keep")
        disk = sum(f.stat().st_size for f in table.rglob("*.parquet")) / 2**30
        gen = {"seconds": "0 (kept from an earlier run)", "disk_gib": round(disk, 2)}
    else:
        gen = _child([*common, "--stage", "generate"])
    gib = args.n * args.d * 4 / 2**30
    print(
        f"N={args.n:,} x d={args.d:,} float32 ({gib:.1f} GiB in memory, {gen['disk_gib']} GiB "
        f"on disk), K={args.k}: generated in {gen['seconds']} s"
    )
    s = _child([*common, "--stage", "streaming"])
    print(
        f"streaming: clustering {s['clustering_s']} s, selection {s['selection_s']} s, manifests "
        f"{s['manifests_s']} s, balanced_clusters table {s['write_clusters_s']} s; total "
        f"{s['total_s']} s (ratio to the 10M target of 15 min {s['total_s'] / 900:.2f}); peak RSS "
        f"{s['peak_rss_gib']} GiB (ratio to the 10M target of 6 GiB {s['peak_rss_gib'] / 6:.2f}; "
        f"peak RSS / size of the embeddings in memory {s['peak_rss_gib'] / gib:.3f})"
    )
    print(
        f"    capacity step: cost {s['cost']:.6f}, certified optimal within "
        f"{s['optimality_gap']:.1e} relative (LP bound {s['lower_bound']:.6f}); "
        f"{s['boundary_samples']:,} samples by flow; sizes {s['sizes']} (cap {s['cap']}); "
        f"k-means cost +{s['kmeans_cost_increase_pct']}%; {s['selected']:,} selected, shard "
        f"size {s['shard_size']:,}"
    )
    print(
        f"    k-means on the {s['kmeans_sample']:,}-row sample (inside clustering, timed again "
        f"alone): k-means++ x 10 runs, up to 300 iterations {s['kmeans_s']} s (iterations per "
        f"run {s['kmeans_restart_iterations']}, inertia {s['kmeans_inertia']:.2f}) vs one random "
        f"start x 25 iterations {s['kmeans_old_s']} s (inertia {s['kmeans_old_inertia']:.2f}): "
        f"ratio {s['kmeans_s'] / max(s['kmeans_old_s'], 1e-9):.1f}x the seconds, inertia "
        f"{s['kmeans_inertia'] / s['kmeans_old_inertia']:.4f}x"
    )
    if not args.skip_in_memory:
        m = _child([*common, "--stage", "in_memory"])
        import numpy as np

        same = float(np.abs(np.array(m["centroids"]) - np.array(s["centroids"])).max())
        rel = (s["cost"] - m["cost"]) / m["cost"]
        print(
            f"in memory: read {m['read_s']} s, k-means + distances {m['kmeans_and_distances_s']} "
            f"s, capacity step (flow over all N x K arcs) {m['capacity_s']} s; total "
            f"{m['total_s']} s; peak RSS {m['peak_rss_gib']} GiB"
        )
        print(
            f"    streaming / in memory: clustering seconds "
            f"{s['clustering_s'] / m['total_s']:.2f}, peak RSS "
            f"{s['peak_rss_gib'] / m['peak_rss_gib']:.2f}; capacity cost {s['cost']:.6f} vs "
            f"{m['cost']:.6f} (relative difference {rel:.1e}, target |.| <= 1e-6; centroids "
            f"differ by at most {same:.1e})"
        )
    if not args.keep:
        shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()

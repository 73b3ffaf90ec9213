"""Clustering + selection + shard manifests at scale, on synthetic clustered embeddings.

    python benchmarks/selection_scale.py --n 75000 --d 576
    python benchmarks/selection_scale.py --n 1000000 --d 1024

Each size runs in a fresh process. The embeddings are K Gaussian blobs of unequal size
(float32, L2-normalised), generated in place, so the matrix itself is the memory baseline:
peak RSS is reported against it (target <= 2x). Stages timed: k-means (faiss), the exact
capacity step (min-cost flow), peripheral selection and the K shard manifests (built and
hashed). Targets on a 2-core machine: <= 10 s at 75k x 576, <= 3 min at 1M x 1024.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

from arguments import positive_int


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(n: int, d: int, k: int, seed: int) -> dict:
    import faiss  # noqa: F401  (load every library before the baseline reading)
    import numpy as np
    from ortools.graph.python import min_cost_flow  # noqa: F401

    from cluster_pipeline.selection.clustering import balanced_kmeans
    from cluster_pipeline.selection.selectors import select
    from cluster_pipeline.selection.sharding import allocate

    base_rss = rss_mib()
    rng = np.random.default_rng(seed)
    sizes = rng.dirichlet(np.full(k, 2.0)) * n
    sizes = np.maximum(sizes.astype(np.int64), 1)
    sizes[-1] = n - sizes[:-1].sum()
    centers = rng.standard_normal((k, d), dtype=np.float32)
    x = np.empty((n, d), dtype=np.float32)
    start = 0
    for c, size in enumerate(sizes):
        block = x[start : start + size]
        rng.standard_normal(block.shape, dtype=np.float32, out=block)
        block *= 0.7
        block += centers[c]
        start += size
    x /= np.sqrt(np.einsum("ij,ij->i", x, x))[:, None]  # no (N, d) temporary
    matrix_mib = x.nbytes / 2**20
    ids = np.array([f"{i:016x}" for i in range(n)])
    before = rss_mib()

    t0 = time.perf_counter()
    clusters = balanced_kmeans(x, k, alpha=1.0, seed=seed)
    t1 = time.perf_counter()
    selection = select(clusters.labels, clusters.sq_distance, k, "peripheral", r=0.5, seed=seed)
    t2 = time.perf_counter()
    allocation = allocate("bench", ids, clusters.labels, selection, k, seed)
    hashes = [m.sha256 for m in allocation.manifests]
    t3 = time.perf_counter()
    peak = rss_mib()
    return {
        "n": n,
        "d": d,
        "k": k,
        "matrix_mib": round(matrix_mib, 1),
        "clustering_s": round(t1 - t0, 2),
        "selection_s": round(t2 - t1, 3),
        "manifests_s": round(t3 - t2, 3),
        "total_s": round(t3 - t0, 2),
        "peak_rss_mib": round(peak, 1),
        "rss_before_stages_mib": round(before, 1),
        "interpreter_rss_mib": round(base_rss, 1),
        # Memory the data costs: peak minus the interpreter with its libraries loaded.
        "peak_over_matrix": round((peak - base_rss) / matrix_mib, 2),
        "capacity_cost_increase_pct": round(100 * clusters.cost_increase, 3),
        "sizes": clusters.sizes.tolist(),
        "shard_size": allocation.shard_size,
        "manifest_hash_0": hashes[0][:12],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--n", type=positive_int, nargs="+", default=[75_000, 1_000_000])
    p.add_argument("--d", type=positive_int, nargs="+", default=[576, 1024])
    p.add_argument("--k", type=positive_int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(run(args.n[0], args.d[0], args.k, args.seed)))
        return
    if len(args.n) != len(args.d):
        p.error("--n and --d need the same number of values")
    targets = {75_000: 10.0, 1_000_000: 180.0}
    for n, d in zip(args.n, args.d, strict=True):
        cmd = [
            sys.executable,
            __file__,
            "--child",
            "--n",
            str(n),
            "--d",
            str(d),
            "--k",
            str(args.k),
            "--seed",
            str(args.seed),
        ]
        r = json.loads(
            subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1]
        )
        target = targets.get(n)
        print(
            f"N={n:>9,} d={d:>5} K={args.k}: clustering {r['clustering_s']} s, selection "
            f"{r['selection_s']} s, manifests {r['manifests_s']} s, total {r['total_s']} s"
            + (f" (target <= {target:.0f} s, ratio {r['total_s'] / target:.2f})" if target else "")
        )
        print(
            f"    matrix {r['matrix_mib']} MiB, peak RSS {r['peak_rss_mib']} MiB = "
            f"interpreter {r['interpreter_rss_mib']} MiB + {r['peak_over_matrix']}x the matrix "
            f"(target <= 2x); capacity step raised the "
            f"k-means cost by {r['capacity_cost_increase_pct']}%; sizes {r['sizes']}"
        )


if __name__ == "__main__":
    main()

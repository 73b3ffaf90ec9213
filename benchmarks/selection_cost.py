"""What each selector costs: the paper's Table 4 (selection time), on one pool in one run.

    python benchmarks/selection_cost.py                  # gpteacher_codegen, 1,000 samples
    python benchmarks/selection_cost.py --pool 120 --selectors peripheral ifd   # a quick look

Every selector runs through the product itself: a temporary data folder and Dagster instance,
``cluster-pipeline datasets sync``, then ``dagster asset materialize`` of ``raw_instructions``,
``proxy_embeddings`` and ``balanced_clusters`` once, and of ``peripheral_subsets`` once per
selector (the run config of ``cluster-pipeline compare-config``), on the same pool (the first
--pool training samples of the shared ``gpteacher_codegen``, 4,535 records), the same model
(SmolLM2-135M-Instruct, float32) and the same data-parallel width (--world-size ranks of
``torchrun``, gloo on the CPU). Each selector's passes are the product's own, batched and
data-parallel: the embedding pass (one forward, the LM head on response positions only), ifd's
second forward without the prompts, rds's pass over the target set, s2l's proxy training and
its loss pass per checkpoint, less's LoRA warm-up and its per-sample gradient passes per
checkpoint (pool and targets). The target set of rds and less: the first --target-size
HumanEval problems with their reference solutions (``--target``).

A selector's cost is what its own inputs need, read from its ``peripheral_subsets``
materialization (``selection_passes``: each pass's seconds at the rate measured when it ran,
samples, backward passes, peak memory; ``selector_seconds``: scoring and ordering):

- CluSTER (``peripheral``): the embedding pass + balanced k-means and the capacity step
  (``balanced_clusters``' seconds) + its selection;
- ifd, rds: the embedding pass (ifd reads its conditioned loss, rds its mean hidden state) + their
  own pass + their selection; no clustering;
- s2l, less: their own passes + their selection; neither reads the embedding pass nor the
  clusters (the product runs them anyway, as the pipeline's order; they are not counted).

The peers run as their authors released them (issue 41: rds's own position-weighted pool pass,
ifd's two passes without the end-of-turn tokens, s2l's source split, less's released Adam
update); ``NAME@pre`` runs one under this project's rules before issue 41 (rds and ifd then
read the embedding pass instead of a pass of their own). The newer baselines: ``cluster_less``
(less's warm-up, gradients of its clusters' representatives only), ``cluster_ifd`` (ifd's
passes, the clustering), ``balanced_random`` and ``longest`` (no model pass). Which passes a
selector's cost holds is its record's: the embedding pass only where its inputs read it.

Printed: per selector its passes, forward and backward passes, peak resident memory of the
largest rank, seconds, and the ratio to CluSTER's seconds, beside the paper's ratios (Table 4,
Magicoder-75K on 7B models: CluSTER 0.19 h, IFD 1.62 h = 8.5x, LESS 2.79 h = 14.7x, S2L 0.95 h =
5.0x; RDS+ is not in the paper). Written to --out (JSON), again after each selector (a run
stopped midway keeps what it measured). The model load of each process is not counted (as in
the product's cost record).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from arguments import fraction, positive_int
from product_runs import ProductRun

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "datasets" / "train" / "gpteacher_codegen.json"
DATASET = "gpteacher_codegen"
SELECTORS = [
    "peripheral",
    "ifd",
    "rds",
    "s2l",
    "less",
    "cluster_less",
    "cluster_ifd",
    "balanced_random",
    "longest",
]
TARGETED = {"rds", "less", "cluster_less"}
# This project's rules before issue 41 (selection_quality.PRE_FIDELITY's).
PRE_FIDELITY = {
    "ifd": {"ifd_end_of_turn": True, "ifd_truncated": True},
    "rds": {"rds_selection": "round_robin_untaken", "rds_pooling": "response_mean"},
    "s2l": {"s2l_sources": False, "s2l_small_clusters": "algorithm_1"},
    "less": {"less_adam": "paper", "less_subtasks": "max"},
}
CHOICES = [*SELECTORS, *(f"{name}@pre" for name in PRE_FIDELITY)]
# Table 4 of the paper: selection hours on Magicoder-OSS-Instruct-75K, as a ratio to CluSTER's.
PAPER_RATIO = {"peripheral": 1.0, "ifd": 8.5, "less": 14.7, "s2l": 5.0}
# The selectors that read the clusters (their cost adds the clustering's seconds).
CLUSTERED = {"peripheral", "cluster_ifd"}


def _cost(selector: str, subsets: dict, clustering_seconds: float) -> dict:
    """The selector's own cost (module docstring) from its ``peripheral_subsets`` metadata: the
    passes its record holds (the embedding pass only where it read it)."""
    passes = list(subsets["selection_passes"])
    seconds = sum(p["seconds"] for p in passes) + subsets["selector_seconds"]
    if selector in CLUSTERED:
        seconds += clustering_seconds
    return {
        "selector": selector,
        "seconds": round(seconds, 1),
        # Seconds per pass name, summed over repeats (s2l's loss pass and less's gradient passes
        # run once per checkpoint).
        "passes": {
            name: round(sum(p["seconds"] for p in passes if p["name"] == name), 1)
            for name in dict.fromkeys(p["name"] for p in passes)
        },
        "selector_seconds": round(subsets["selector_seconds"], 2),
        "clustering_seconds": round(clustering_seconds, 1) if selector in CLUSTERED else 0.0,
        "forward": sum(p["samples"] for p in passes),
        "backward": sum(p["backward"] for p in passes),
        # None for a selector without a model pass (balanced_random, longest).
        "peak_rss_mib": max(((p.get("peak_rss_mib") or 0.0) for p in passes), default=0.0) or None,
        "selected": subsets["selected_samples"],
        "data_fraction": subsets["data_fraction"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument(
        "--pool", type=positive_int, default=1000, help="training samples (>= 1,000 for Table 4)"
    )
    p.add_argument("--selectors", nargs="+", default=SELECTORS, choices=CHOICES)
    p.add_argument("--max-length", type=positive_int, default=256)
    p.add_argument(
        "--world-size", type=positive_int, default=2, help="torchrun ranks of every pass"
    )
    p.add_argument("--ratio", type=fraction, default=0.5)
    p.add_argument("--target", default="humaneval", help="the targeted selectors' target set")
    p.add_argument("--target-size", type=positive_int, default=64)
    p.add_argument(
        "--pool-file", type=Path, default=SHARED, help="the gpteacher_codegen JSON (the shared one)"
    )
    p.add_argument("--work", type=Path, default=Path("/tmp/selection_cost"))
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "selection_cost.json")
    args = p.parse_args()
    if "peripheral" not in args.selectors:
        sys.exit("--selectors must include peripheral (CluSTER, the ratios' baseline)")
    if not args.pool_file.exists():
        sys.exit(f"{args.pool_file} not found: the shared datasets lie beside the project")
    if args.pool < 2 * args.world_size:
        sys.exit(f"--pool {args.pool}: too small for {args.world_size} ranks")
    targeted = [s for s in args.selectors if s.split("@")[0] in TARGETED]
    if targeted:  # refused now, not after the embedding pass the chain runs first
        from cluster_pipeline.evaluation.targets import target_problem

        problem = target_problem(args.target, None, "/".join(targeted))
        if problem:
            sys.exit(f"--target {args.target!r}: {problem}")

    from cluster_pipeline.cli.compare import compare_config
    from cluster_pipeline.defs.profiles import profile_run_config
    from cluster_pipeline.selection.selectors import REGISTRY

    product = ProductRun(args.work, DATASET, args.pool_file)
    chain = ["raw_instructions", "proxy_embeddings", "balanced_clusters"]
    config = profile_run_config("cpu_quick", chain)
    ops = config["ops"]
    ops["raw_instructions"]["config"].update(max_train_samples=args.pool, max_heldout=50)
    ops["proxy_embeddings"]["config"].update(max_length=args.max_length, world_size=args.world_size)
    print(f"[{DATASET}] pool {args.pool}, max_length {args.max_length}, {args.world_size} ranks")
    wall = product.materialize(",".join(chain), config, "chain")
    embedded = product.metadata("proxy_embeddings")
    clusters = product.metadata("balanced_clusters")
    print(
        f"  embedding pass + clustering: {wall:.0f} s wall (pass "
        f"{embedded['embedding_seconds']} s, clustering {clusters['seconds']} s)",
        flush=True,
    )

    results = []
    for name in args.selectors:
        selector, _, variant = name.partition("@")
        run = compare_config(
            selector,
            0,
            ["peripheral_subsets"],
            ratio=args.ratio,
            target=args.target,
        )
        subsets_config = run["ops"]["peripheral_subsets"]["config"]
        # Every knob of the selector given (its released defaults unless @pre): the partition
        # keeps a run's knobs for the next run (issue 43), so `ifd` after `ifd@pre` would
        # otherwise run as `ifd@pre`.
        subsets_config.update(
            {**REGISTRY[selector].knobs().model_dump(mode="json"), **subsets_config}
        )
        if selector in TARGETED:
            subsets_config["target_size"] = args.target_size
        if selector == "s2l":  # the paper's 100 trajectory clusters, at most half a small pool
            subsets_config["s2l_clusters"] = min(100, args.pool // 2)
        if variant == "pre":
            subsets_config.update(PRE_FIDELITY[selector])
        wall = product.materialize("peripheral_subsets", run, name.replace("@", "_"))
        cost = _cost(selector, product.metadata("peripheral_subsets"), float(clusters["seconds"]))
        cost["selector"] = name
        cost["wall_seconds"] = round(wall, 1)
        results.append(cost)
        print(f"  {name}: {cost['seconds']:.0f} s {cost['passes']}", flush=True)
        _write(args, embedded, clusters, results)  # a run stopped midway keeps what it measured

    base = next(r for r in results if r["selector"] == "peripheral")["seconds"]
    print(
        f"\n{'selector':>16} {'seconds':>8} {'ratio':>6} {'paper':>6} {'forward':>8} "
        f"{'backward':>8} {'peak MiB':>8}  passes (seconds)"
    )
    for r in results:
        r["ratio"] = round(r["seconds"] / base, 2)
        paper = PAPER_RATIO.get(r["selector"])
        print(
            f"{r['selector']:>16} {r['seconds']:>8.0f} {r['ratio']:>6.2f} "
            f"{(f'{paper:.1f}' if paper else '-'):>6} {r['forward']:>8} {r['backward']:>8} "
            f"{(r['peak_rss_mib'] or 0):>8.0f}  {r['passes']}"
        )
    _write(args, embedded, clusters, results)
    print(f"\nresults: {args.out}")


def _write(args, embedded: dict, clusters: dict, results: list[dict]) -> None:
    """The run's figures so far to --out (JSON); each selector's ratio to CluSTER's seconds
    once CluSTER (``peripheral``) is measured."""
    base = next((r["seconds"] for r in results if r["selector"] == "peripheral"), None)
    for r in results:
        if base:
            r["ratio"] = round(r["seconds"] / base, 2)
    args.out.write_text(
        json.dumps(
            {
                "dataset": DATASET,
                "pool": args.pool,
                "max_length": args.max_length,
                "world_size": args.world_size,
                "ratio": args.ratio,
                "target": args.target,
                "target_size": args.target_size,
                "embedding_pass_seconds": embedded["embedding_seconds"],
                "clustering_seconds": clusters["seconds"],
                "results": results,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()

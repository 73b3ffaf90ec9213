"""S2L's two departures one at a time (issue 41; docs/design.md, "The peers: departures from the
authors' released code"): the selected sets of a finished ``selection_quality.py`` run's s2l
selections, recomputed from its stored loss trajectories under each of the four settings of
``s2l_sources`` x ``s2l_small_clusters``.

    python benchmarks/s2l_knobs.py --product /tmp/selection_quality_XXXX/mixed/product

The run must have trained ``s2l`` and ``s2l@pre`` (``--peers s2l s2l@pre``). For each seed the
script reads the ``s2l_trajectories`` version of its ``s2l`` run (Delta time travel; one
version per s2l run, in run order), the pool's sources (``record_sources``: the record's
``source``/``dataset`` field, else its file), the balanced clusters and the run's knobs (its
YAML), then calls the product's ``source_split`` under each setting. It first checks that the
two settings the run used give the stored selections (the ``peripheral_subsets`` version of each
run), so the recomputation is the product's, then prints each setting's selected-set overlap
with the released one (shared samples, Jaccard) and writes them to --out (JSON). No model pass:
seconds.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

SETTINGS = (
    ("released", True, "set_aside"),
    ("sources only (algorithm_1)", True, "algorithm_1"),
    ("no sources (set_aside)", False, "set_aside"),
    ("earlier rule (@pre)", False, "algorithm_1"),
)


def run_order(product: Path) -> list[str]:
    """The product runs of the quality run, oldest first (their YAML files' names, ``chain``
    left out): the order of the Delta versions every run wrote."""
    files = sorted(product.glob("*.yaml"), key=os.path.getmtime)
    return [f.stem for f in files if f.stem != "chain"]


def main() -> None:
    import numpy as np
    import polars as pl
    import yaml

    from cluster_pipeline.defs.pass_runner import record_sources
    from cluster_pipeline.selection.selectors.base import per_cluster_budget
    from cluster_pipeline.selection.selectors.s2l import source_split

    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--product", type=Path, required=True, help="a quality run's <dataset>/product")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    product = args.product
    dataset = product.parent.name
    tables = product / "data" / "tables"
    runs = run_order(product)
    s2l_runs = [r for r in runs if r.startswith("s2l")]
    if not any(r.startswith("s2l_pre") for r in s2l_runs):
        raise SystemExit(f"{product}: no s2l@pre run (train --peers s2l s2l@pre)")

    pool = pl.read_delta(str(tables / "balanced_clusters" / dataset))
    raw = pl.read_delta(str(tables / "raw_instructions" / dataset)).join(
        pool.select("sample_id"), on="sample_id", how="semi"
    )
    raw = pool.select("sample_id").join(raw, on="sample_id", how="left")
    sources = record_sources(raw["source_file"].to_list(), raw["source_index"].to_list())
    labels = pool["cluster"].to_numpy()
    results: list[dict] = []
    for seed_run in [r for r in s2l_runs if not r.startswith("s2l_pre")]:
        seed = int(seed_run.rsplit("_", 1)[1])
        knobs = yaml.safe_load((product / f"{seed_run}.yaml").read_text())["ops"][
            "peripheral_subsets"
        ]["config"]
        trajectories_version = s2l_runs.index(seed_run)
        tr = pl.read_delta(str(tables / "s2l_trajectories" / dataset), version=trajectories_version)
        tr = pool.select("sample_id").join(tr, on="sample_id", how="left")
        trajectories = np.asarray(tr["loss_trajectory"].to_list(), dtype=np.float32)
        sizes = np.bincount(labels)
        budget = len(sizes) * per_cluster_budget(sizes, knobs["ratio"])

        def stored(run: str) -> set[str]:
            df = pl.read_delta(
                str(tables / "peripheral_subsets" / dataset), version=runs.index(run)
            )
            return set(df.filter(pl.col("selected"))["sample_id"].to_list())

        ids = pool["sample_id"].to_numpy()
        picked = {}
        for name, use_sources, small in SETTINGS:
            _, selected, _ = source_split(
                trajectories,
                sources if use_sources else None,
                budget,
                knobs["s2l_clusters"],
                seed,
                None,
                small == "set_aside",
            )
            picked[name] = set(ids[selected].tolist())
        for name, run in (("released", seed_run), ("earlier rule (@pre)", f"s2l_pre_{seed}")):
            if picked[name] != stored(run):
                raise SystemExit(f"seed {seed}: {name} does not give the stored selection of {run}")
        released = picked["released"]
        for name, _, _ in SETTINGS[1:]:
            shared = len(released & picked[name])
            jaccard = shared / len(released | picked[name])
            results.append(
                {
                    "seed": seed,
                    "setting": name,
                    "budget": budget,
                    "shared": shared,
                    "jaccard": round(jaccard, 3),
                }
            )
            print(f"seed {seed}: released vs {name}: {shared} of {budget}, Jaccard {jaccard:.3f}")
    if args.out:
        args.out.write_text(json.dumps({"product": str(product), "rows": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()

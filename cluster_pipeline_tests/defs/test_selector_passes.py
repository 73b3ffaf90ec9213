"""The selectors with passes of their own (rds: the target set) run through the assets on a
tiny random model and the 60-sample dataset: the pass is cached per sample, the subset is dealt
into random balanced shards with weight 1, and the cost record counts every forward pass."""

from collections import Counter

import dagster as dg
import polars as pl
import pytest

from cluster_pipeline.defs.partitions import DATASETS
from cluster_pipeline_tests.helpers import (
    meta,
    pipeline_assets,
    read,
    resources,
    run_config_for,
    step_failure,
    write_jsonl,
)

ASSETS = pipeline_assets()
CHAIN, SELECTION = ASSETS[:3], ASSETS[3:5]


@pytest.mark.slow
def test_rds_selects_towards_a_target_folder_through_the_assets(
    tiny_data_dir, tiny_model_dir, tmp_path
):
    res = resources(tiny_data_dir, tiny_model_dir)
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(DATASETS, ["tiny"])
        assert dg.materialize(
            CHAIN,
            partition_key="tiny",
            instance=instance,
            resources=res,
            run_config=run_config_for(CHAIN),
        ).success
        # The target set: four training samples of the pool itself, so each target's most
        # similar pool sample is its own copy (cosine 1): round 1 of the round-robin takes
        # exactly them, in target order.
        train = read(instance, "raw_instructions").filter(pl.col("split") == "train")
        targets = train.head(4)
        write_jsonl(
            tmp_path / "targets" / "t.jsonl",
            [
                {"instruction": p, "output": r}
                for p, r in zip(targets["prompt"], targets["response"], strict=True)
            ],
        )
        config = {"selector": "rds", "target": str(tmp_path / "targets"), "ratio": 0.5}
        result = dg.materialize(
            SELECTION,
            partition_key="tiny",
            instance=instance,
            resources=res,
            run_config=run_config_for(SELECTION, peripheral_subsets=config),
        )
        assert result.success
        subsets = read(instance, "peripheral_subsets")
        first = subsets.filter(pl.col("selection_rank") < 4).sort("selection_rank")
        assert first["sample_id"].to_list() == targets["sample_id"].to_list()
        assert first["selected"].all() and first["score"].to_numpy().min() > 0.9999
        assert subsets["score"].null_count() == 0 and (subsets["weight"] == 1.0).all()
        m = meta(instance, "peripheral_subsets")
        assert m["selection_target"] == str(tmp_path / "targets")
        assert m["selection_target_samples"] == 4
        assert [p["name"] for p in m["selection_passes"]] == ["embedding", "targets"]
        assert m["forward_passes"] == subsets.height + 4 and m["backward_passes"] == 0
        assert m["selection_passes"][1]["run_now"] == 4
        assert "selection_targets" in m["inputs"]
        # Random balanced shards (the paper's baselines): weight 1, every selected sample once.
        shards = read(instance, "shard_manifests")
        assert Counter(shards["sample_id"]) == Counter(
            subsets.filter(pl.col("selected"))["sample_id"]
        )
        assert (shards["weight"] == 1.0).all()
        assert all(c.passed for c in result.get_asset_check_evaluations())

        # Again: the target pass comes from its cache, the selection is the same.
        assert dg.materialize(
            SELECTION,
            partition_key="tiny",
            instance=instance,
            resources=res,
            run_config=run_config_for(SELECTION, peripheral_subsets=config),
        ).success
        again = meta(instance, "peripheral_subsets")
        assert again["selection_passes"][1]["run_now"] == 0
        assert read(instance, "peripheral_subsets")["selected"].equals(subsets["selected"])

        # A target set that does not exist is refused before any pass.
        bad = dg.materialize(
            SELECTION[:1],
            partition_key="tiny",
            instance=instance,
            resources=res,
            run_config=run_config_for(
                SELECTION[:1], peripheral_subsets={**config, "target": str(tmp_path / "none")}
            ),
            raise_on_error=False,
        )
        assert not bad.success
        assert "nor an existing folder" in step_failure(bad)[0]

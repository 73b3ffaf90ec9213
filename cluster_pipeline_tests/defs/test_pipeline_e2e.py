"""All seven assets materialized in-process on a tiny random model and a 60-sample dataset,
with torchrun at 2 processes for training. Asserts on the tables the stages wrote."""

import json
from collections import Counter
from pathlib import Path

import dagster as dg
import numpy as np
import polars as pl
import pytest

from cluster_pipeline.core.sharding import ShardManifest
from cluster_pipeline.defs.assets.balanced_clusters import balanced_clusters
from cluster_pipeline.defs.assets.eval_report import eval_report
from cluster_pipeline.defs.assets.peripheral_subsets import peripheral_subsets
from cluster_pipeline.defs.assets.proxy_embeddings import proxy_embeddings
from cluster_pipeline.defs.assets.raw_instructions import raw_instructions
from cluster_pipeline.defs.assets.shard_manifests import shard_manifests
from cluster_pipeline.defs.assets.trained_checkpoint import trained_checkpoint
from cluster_pipeline.defs.partitions import dataset_partitions
from cluster_pipeline.defs.resources import BaseModelResource, StorageResource, TorchrunResource

ASSETS = [raw_instructions, proxy_embeddings, balanced_clusters, peripheral_subsets,
          shard_manifests, trained_checkpoint, eval_report]

RUN_CONFIG = {
    "ops": {
        "raw_instructions": {"config": {"heldout_fraction": 0.1}},
        "proxy_embeddings": {"config": {"max_length": 64, "chunk_size": 16}},
        "balanced_clusters": {"config": {"num_clusters": 2, "alpha": 1.3}},
        "peripheral_subsets": {"config": {"ratio": 0.5}},
        "trained_checkpoint": {"config": {"max_length": 64, "per_device_batch_size": 2,
                                          "learning_rate": 1e-3}},
        "eval_report": {"config": {"max_length": 64, "benchmarks": ["humaneval"],
                                   "humaneval_problems": 2, "max_new_tokens": 8}},
    }
}


def resources(data_dir: Path, model_dir: Path) -> dict:
    return {
        "storage": StorageResource(data_dir=str(data_dir)),
        "base_model": BaseModelResource(model=str(model_dir)),
        "torchrun": TorchrunResource(),
        "pipes_subprocess_client": dg.PipesSubprocessClient(),
    }


def meta(instance, asset: str, partition: str = "tiny") -> dict:
    rec = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey(asset), asset_partitions=[partition]), limit=1
    ).records[0]
    return {k: v.value for k, v in rec.asset_materialization.metadata.items()}


def read(instance, asset: str) -> pl.DataFrame:
    m = meta(instance, asset)
    return pl.read_delta(str(m["table_uri"]), version=int(m["table_version"]))


@pytest.mark.slow
def test_all_seven_assets_on_a_tiny_model(tiny_data_dir, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(dataset_partitions.name, ["tiny"])
        result = dg.materialize(ASSETS, partition_key="tiny", instance=instance,
                                resources=resources(tiny_data_dir, tiny_model_dir),
                                run_config=RUN_CONFIG)
        assert result.success

        raw = read(instance, "raw_instructions")
        assert raw.height == 60 and (raw["split"] == "heldout").sum() == 6
        train_ids = set(raw.filter(pl.col("split") == "train")["sample_id"])

        emb = read(instance, "proxy_embeddings")
        assert set(emb["sample_id"]) == train_ids
        norms = np.linalg.norm(np.stack(emb["embedding_normalised"].to_list()), axis=1)
        np.testing.assert_allclose(norms, 1.0, rtol=1e-5)

        clusters = read(instance, "balanced_clusters")
        sizes = np.bincount(clusters["cluster"].to_numpy(), minlength=2)
        assert sizes.sum() == 54 and sizes.max() <= 36  # cap = ceil(1.3 * 54 / 2)

        subsets = read(instance, "peripheral_subsets")
        selected = subsets.filter(pl.col("selected"))
        assert selected.height == 2 * (int(sizes.min()) // 2)
        # Peripheral: every kept sample is at least as far as every dropped one in its cluster.
        for c in range(2):
            cl = subsets.filter(pl.col("cluster") == c)
            kept = cl.filter(pl.col("selected"))["sq_distance"]
            dropped = cl.filter(~pl.col("selected"))["sq_distance"]
            assert dropped.len() == 0 or kept.min() >= dropped.max()

        shards = read(instance, "shard_manifests")
        # Every selected sample appears in exactly one shard.
        assert Counter(shards["sample_id"]) == Counter(selected["sample_id"])
        # Shard sizes are equal.
        assert len(set(shards.group_by("rank").len()["len"].to_list())) == 1
        # Weights are n_c K / N.
        for rank, weight in shards.group_by("rank").agg(pl.col("weight").first()).iter_rows():
            assert weight == pytest.approx(sizes[rank] * 2 / 54)
        shard_meta = meta(instance, "shard_manifests")
        manifests = [ShardManifest.read(Path(p)) for p in shard_meta["manifest_paths"]]
        assert [m.sha256 for m in manifests] == list(shard_meta["manifest_sha256"])

        ckpt = Path(str(meta(instance, "trained_checkpoint")["checkpoint_path"]))
        model = AutoModelForCausalLM.from_pretrained(ckpt)
        assert model.config.hidden_size == 32
        info = json.loads((ckpt / "training_info.json").read_text())
        assert [m["sha256"] for m in info["manifests"]] == [m.sha256 for m in manifests]
        assert info["world_size"] == 2

        report = meta(instance, "eval_report")
        assert report["base/heldout_loss"] > 0 and report["tuned/heldout_loss"] > 0
        assert 0.0 <= report["tuned/humaneval_pass@1"] <= 1.0
        assert Path(str(report["report_path"])).read_text().startswith("## eval_report")
        checks = result.get_asset_check_evaluations()
        assert {c.check_name for c in checks} == {"capacity", "equal_shards", "coverage", "weights"}
        assert all(c.passed for c in checks)


@pytest.mark.slow
def test_a_failing_rank_fails_the_asset_with_its_error(tiny_data_dir, tiny_model_dir):
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(dataset_partitions.name, ["tiny"])
        ok = dg.materialize(ASSETS[:5], partition_key="tiny", instance=instance,
                            resources=resources(tiny_data_dir, tiny_model_dir), run_config={
                                "ops": {k: v for k, v in RUN_CONFIG["ops"].items()
                                        if k in {a.key.to_user_string() for a in ASSETS[:5]}}})
        assert ok.success
        before = read(instance, "shard_manifests")
        path = Path(meta(instance, "shard_manifests")["manifest_paths"][1])
        path.write_text(path.read_text().replace('"weight"', '"weight_typo"', 1))
        failed = dg.materialize(
            [trained_checkpoint], partition_key="tiny", instance=instance,
            resources=resources(tiny_data_dir, tiny_model_dir), raise_on_error=False,
            run_config={"ops": {"trained_checkpoint": RUN_CONFIG["ops"]["trained_checkpoint"]}},
        )
        assert not failed.success
        failure = next(e for e in failed.all_events if e.is_step_failure)
        data = failure.step_failure_data.user_failure_data
        assert "rank_1" in data.description and "weight_typo" in data.description
        assert "rank_1 failed first" in data.description
        assert "weight_typo" in data.metadata["rank_1"].value
        # Earlier tables are intact and readable.
        assert read(instance, "shard_manifests").equals(before)

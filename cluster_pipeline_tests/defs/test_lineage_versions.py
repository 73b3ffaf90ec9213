"""The stages record, in each Delta commit, the table versions they read, so the lineage (asset
and command) joins the versions the manifests were built from after a stage is re-run (trial
defect 4); and training refuses, before torchrun starts, a manifest file that is not the one
shard_manifests recorded (trial defect 6)."""

import json
from pathlib import Path

import dagster as dg
import polars as pl
import pytest

from cluster_pipeline.cli.main import main
from cluster_pipeline.defs.assets.sample_lineage import sample_lineage
from cluster_pipeline.defs.partitions import DATASETS
from cluster_pipeline.selection.sharding import ShardManifest
from cluster_pipeline.storage.layout import DataLayout
from cluster_pipeline.storage.tables import table_inputs
from cluster_pipeline_tests.helpers import (
    materialize_partition,
    meta,
    pipeline_assets,
    read,
    resources,
    run_config_for,
    seed_embeddings,
    step_failure,
    tiny_records,
    write_jsonl,
)

pytestmark = pytest.mark.slow

ASSETS = pipeline_assets()
CHAIN = ["proxy_embeddings", "balanced_clusters", "peripheral_subsets", "shard_manifests"]


def test_lineage_after_a_rerun_and_training_preflight(
    tmp_path, tiny_model_dir, tiny_embedding_cache, capsys
):
    data = tmp_path / "data"
    write_jsonl(data / "raw" / "tiny" / "a.jsonl", tiny_records(60))
    seed_embeddings(tiny_embedding_cache, data)
    layout = DataLayout.at(data)
    res = resources(data, tiny_model_dir)
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(DATASETS, ["tiny"])
        assert materialize_partition([*ASSETS[:5], sample_lineage], instance, res).success
        # Each commit records what the stage's record names as its inputs.
        for stage in [*CHAIN, "sample_lineage"]:
            m = meta(instance, stage)
            recorded = {k: int(v["version"]) for k, v in m["inputs"].items()}
            assert table_inputs(str(m["table_uri"]), int(m["table_version"])) == recorded, stage

        # peripheral_subsets re-run alone with a smaller ratio (the trial's repro).
        cfg = run_config_for([ASSETS[3]], peripheral_subsets={"ratio": 0.25})
        assert materialize_partition([ASSETS[3]], instance, res, run_config=cfg).success
        assert int(meta(instance, "peripheral_subsets")["table_version"]) == 1
        assert materialize_partition([sample_lineage], instance, res).success
        notes = meta(instance, "sample_lineage")["version_notes"]
        assert (
            "- peripheral_subsets v1 is newer than the v0 shard_manifests v0 was built from: "
            "selection_rank, selected, copies, weight below are from v0"
        ) in notes
        in_shards = set(read(instance, "shard_manifests")["sample_id"])
        lineage = read(instance, "sample_lineage")
        assert set(lineage.filter(pl.col("selected"))["sample_id"]) == in_shards
        assert lineage.filter(pl.col("selected") != pl.col("rank").is_not_null()).height == 0
        main(["lineage", "tiny", "--selected", "--data-dir", str(data), "--json"])
        out = capsys.readouterr()
        assert {json.loads(line)["sample_id"] for line in out.out.splitlines()} == in_shards
        assert "# peripheral_subsets v1 is newer than the v0 shard_manifests v0" in out.err

        # A foreign manifest copied over rank 1's, then ids removed: refused before torchrun.
        m = meta(instance, "shard_manifests")
        rank_1, expected = Path(m["manifest_paths"][1]), m["manifest_sha256"][1]
        saved = rank_1.read_text()
        foreign = ShardManifest("other", 1, 2, "peripheral", 1.0, 0, ("x", "y"))
        rank_1.write_text(json.dumps(foreign.to_dict()))
        failed = materialize_partition([ASSETS[5]], instance, res, raise_on_error=False)
        assert step_failure(failed)[0] == (
            f"dataset 'tiny': {rank_1} holds rank 1's manifest {foreign.sha256[:12]}, not the "
            f"rank 1 manifest {expected[:12]} recorded by shard_manifests; materialize "
            "shard_manifests again"
        )
        edited = json.loads(saved)
        edited["sample_ids"] = edited["sample_ids"][3:]
        rank_1.write_text(json.dumps(edited))
        failed = materialize_partition([ASSETS[5]], instance, res, raise_on_error=False)
        message = step_failure(failed)[0]
        assert message.startswith(
            f"dataset 'tiny': {rank_1}: content hash mismatch (stored sha256 {expected[:12]}, "
        )
        assert message.endswith(
            "the manifest was modified after shard_manifests wrote it; materialize "
            "shard_manifests again"
        )
        # Nothing was launched: no checkpoint folder, no job file.
        assert not layout.checkpoints_dir("tiny").exists()

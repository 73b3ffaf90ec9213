"""Each stage's Dagster data version is its output's content, so an unchanged input is no update
for the eager selection chain (issue 43: a CLI re-read of unchanged files made the sensor re-run
every selection stage).

The kind, "materialized again": the same files read again, the files touched but unchanged,
the files changed, the same files read with another held-out split; and, through the whole
selection chain, every stage computed again from the same input."""

import os

import dagster as dg
import pytest

from cluster_pipeline.defs.partitions import DATASETS
from cluster_pipeline_tests.helpers import (
    materialize_partition,
    pipeline_assets,
    resources,
    run_config_for,
    seed_embeddings,
    tiny_records,
    write_jsonl,
)

ASSETS = pipeline_assets()
RAW, SELECTION = ASSETS[0], ASSETS[:5]


def _version(instance: dg.DagsterInstance, asset: str) -> str:
    record = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey(asset), asset_partitions=["tiny"]), limit=1
    ).records[0]
    materialization = record.asset_materialization
    assert materialization is not None and materialization.tags is not None
    return materialization.tags["dagster/data_version"]


def test_raw_instructions_is_versioned_by_its_rows(tiny_data_dir, tiny_model_dir):
    res = resources(tiny_data_dir, tiny_model_dir)
    source = tiny_data_dir / "raw" / "tiny" / "samples.jsonl"
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(DATASETS, ["tiny"])

        def read(**config) -> str:
            run_config = run_config_for([RAW], raw_instructions=config)
            assert materialize_partition([RAW], instance, res, run_config=run_config).success
            return _version(instance, "raw_instructions")

        first = read()
        assert read() == first  # the same files again
        os.utime(source, (1, 1))  # touched, not changed
        assert read() == first
        assert read(heldout_fraction=0.2) != first  # another split: other rows
        write_jsonl(source, tiny_records(61))  # a sample more
        assert read() != first


@pytest.mark.slow
def test_the_selection_chain_computed_again_keeps_every_data_version(
    tiny_data_dir, tiny_model_dir, tiny_embedding_cache
):
    seed_embeddings(tiny_embedding_cache, tiny_data_dir)
    res = resources(tiny_data_dir, tiny_model_dir)
    stages = [a.key.to_user_string() for a in SELECTION]
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(DATASETS, ["tiny"])
        assert materialize_partition(SELECTION, instance, res).success
        first = {s: _version(instance, s) for s in stages}
        assert materialize_partition(SELECTION, instance, res).success
        assert {s: _version(instance, s) for s in stages} == first
        # Another ratio: the subset and its shards change, the stages above them do not.
        config = run_config_for(SELECTION, peripheral_subsets={"ratio": 0.3})
        assert materialize_partition(SELECTION, instance, res, run_config=config).success
        again = {s: _version(instance, s) for s in stages}
        same = ["raw_instructions", "proxy_embeddings", "balanced_clusters"]
        assert {s: again[s] for s in same} == {s: first[s] for s in same}
        assert again["peripheral_subsets"] != first["peripheral_subsets"]
        assert again["shard_manifests"] != first["shard_manifests"]

"""proxy_embeddings as an asset: cache reuse, recompute, progress in the run log."""

import dagster as dg
import numpy as np
import polars as pl
import pytest

from cluster_pipeline.defs.assets.proxy_embeddings import proxy_embeddings
from cluster_pipeline.defs.assets.raw_instructions import raw_instructions
from cluster_pipeline.defs.partitions import DATASETS
from cluster_pipeline_tests.helpers import (
    materialize_partition,
    meta,
    read,
    resources,
    tiny_records,
    write_jsonl,
)

pytestmark = pytest.mark.slow


def _run(instance, data_dir, model_dir, **embed_cfg):
    cfg = {
        "ops": {"proxy_embeddings": {"config": {"max_length": 64, "chunk_size": 16, **embed_cfg}}}
    }
    result = materialize_partition(
        [raw_instructions, proxy_embeddings],
        instance,
        resources(data_dir, model_dir),
        run_config=cfg,
    )
    assert result.success
    return result


def test_cache_reuse_refresh_recompute_and_progress(tiny_data_dir, tiny_model_dir):
    """The second run reuses every cached sample; a refresh after new samples embeds exactly
    those, and its table equals a full recompute of the grown pool; other settings make another
    cache entry. (One test: each run launches a torchrun pass, 10-30 s.)"""
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(DATASETS, ["tiny"])
        first = _run(instance, tiny_data_dir, tiny_model_dir)
        m1 = meta(instance, "proxy_embeddings")
        t1 = read(instance, "proxy_embeddings")
        assert m1["samples_reused"] == 0 and m1["samples_embedded_now"] == 57
        assert m1["embedded"] == m1["dagster/row_count"] == 57
        # The pass packed its batches (the tiny fp32 Llama passes the gate) and says so.
        assert m1["packed"] is True and m1["warnings"] == []
        logs = [e.user_message for e in instance.all_logs(first.run_id)]
        assert any("embedded" in m and "tokens/s" in m and "ETA" in m for m in logs)

        _run(instance, tiny_data_dir, tiny_model_dir)
        m2 = meta(instance, "proxy_embeddings")
        assert m2["samples_reused"] == 57 and m2["samples_embedded_now"] == 0
        assert m2["cache_key"] == m1["cache_key"]
        assert m2["packed"] is None  # no pass ran
        t2 = read(instance, "proxy_embeddings")
        assert t2.equals(t1)

        # A refresh after 4 new records (a second file): only the new training samples are
        # embedded (the held-out split may take some of them).
        before = set(t1["sample_id"])
        write_jsonl(tiny_data_dir / "raw" / "tiny" / "more.jsonl", tiny_records(64)[60:])
        _run(instance, tiny_data_dir, tiny_model_dir)
        m3 = meta(instance, "proxy_embeddings")
        train = read(instance, "raw_instructions").filter(pl.col("split") == "train")
        after = train["sample_id"].to_list()
        new = set(after) - before
        assert len(new) >= 1 and m3["samples_embedded_now"] == len(new)
        assert m3["samples_reused"] == len(after) - len(new) and m3["embedded"] == len(after)
        refreshed = read(instance, "proxy_embeddings")

        _run(instance, tiny_data_dir, tiny_model_dir, recompute=True)
        assert meta(instance, "proxy_embeddings")["samples_embedded_now"] == len(after)
        full = read(instance, "proxy_embeddings")
        assert refreshed["sample_id"].to_list() == full["sample_id"].to_list() == after
        for column in ("embedding", "hidden_mean", "embedding_normalised"):
            np.testing.assert_allclose(
                np.stack(refreshed[column].to_list()), np.stack(full[column].to_list()), atol=1e-5
            )
        np.testing.assert_allclose(refreshed["mean_loss"], full["mean_loss"], atol=1e-5)
        # The first pool's samples still in training (the grown held-out split may take some),
        # recomputed, are the first pass's vectors.
        kept = full.join(t1, on="sample_id", suffix="_first")
        assert kept.height >= len(before) - 4
        np.testing.assert_allclose(
            np.stack(kept["embedding"].to_list()),
            np.stack(kept["embedding_first"].to_list()),
            atol=1e-5,  # packed with other neighbours: float sums in another order
        )

        # Other settings make another cache entry.
        _run(instance, tiny_data_dir, tiny_model_dir, max_length=48)
        assert meta(instance, "proxy_embeddings")["cache_key"] != m1["cache_key"]


def test_skipped_and_truncated_samples_are_counted_and_traced(tmp_path, tiny_model_dir):
    long = {"instruction": "Explain. " + "word " * 200, "input": "", "output": "Short."}
    data = tmp_path / "data"
    write_jsonl(data / "raw" / "tiny" / "a.jsonl", [long, *tiny_records(20)])
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(DATASETS, ["tiny"])
        skip = _run(instance, data, tiny_model_dir, truncation="skip")
        m = meta(instance, "proxy_embeddings")
        assert m["skipped"] == {"no_response_tokens": 1} and m["embedded"] == 18
        logs = [e.user_message for e in instance.all_logs(skip.run_id)]
        assert any(
            "(no_response_tokens, truncation=skip): " in msg and msg.endswith("a.jsonl:1")
            for msg in logs
        )
        _run(instance, data, tiny_model_dir, truncation="left")
        m = meta(instance, "proxy_embeddings")
        assert m["skipped"] == {} and m["embedded"] == 19
        assert m["truncated"] == {"prompt_start": 1}

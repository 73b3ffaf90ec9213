"""The per-sample embedding cache: what a refresh embeds, recompute without loss, damage named."""

import json

import polars as pl
import pytest

from cluster_pipeline.storage.embedding_cache import (
    CACHE_TABLE,
    CHUNK_SCHEMA,
    PASS_LOG,
    PASS_STATS,
    CacheUnreadable,
    cached_pass_stats,
    chunk_path,
    pending_ids,
    read_cached,
    store_pass,
)


def _pass(folder, ids, chunk_size=2, value=1.0, seconds=2.0):
    """A finished pass's folder: chunk files of ``ids`` (embedding [value, i]) and its stats."""
    folder.mkdir(parents=True)
    rows = [
        {
            "sample_id": s,
            "n_tokens": 10,
            "n_response_tokens": 4,
            "truncated": False,
            "truncation": None,
            "skip_reason": None,
            "mean_loss": 0.5,
            "embedding": [value, float(i)],
            "hidden_mean": [float(i), value],
        }
        for i, s in enumerate(ids)
    ]
    frame = pl.DataFrame(rows, schema=CHUNK_SCHEMA)
    for c, lo in enumerate(range(0, len(ids), chunk_size)):
        frame.slice(lo, chunk_size).write_parquet(chunk_path(folder, c))
    (folder / PASS_STATS).write_text(json.dumps({"samples": len(ids), "seconds": seconds}))
    return folder


def test_a_refresh_embeds_what_the_cache_lacks_and_reads_any_pool_in_order(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    assert pending_ids(cache, ["a", "b"]) == ["a", "b"]
    store_pass(cache, _pass(tmp_path / "p1", ["a", "b", "c"]), ["a", "b", "c"], 2)
    assert pending_ids(cache, ["d", "b", "e", "a"]) == ["d", "e"]
    store_pass(cache, _pass(tmp_path / "p2", ["d", "e"], value=2.0), ["d", "e"], 2)
    assert not (tmp_path / "p1").exists() and not (tmp_path / "p2").exists()
    frame = read_cached(cache, ["e", "a", "c"])
    assert frame.columns == list(CHUNK_SCHEMA)
    assert frame["sample_id"].to_list() == ["e", "a", "c"]
    assert frame["embedding"].to_list() == [[2.0, 1.0], [1.0, 0.0], [1.0, 2.0]]
    with pytest.raises(FileNotFoundError, match="1 samples \\(e.g. 'z'\\) have no cached"):
        read_cached(cache, ["a", "z"])
    assert cached_pass_stats(cache) == {
        "samples": 5.0,
        "tokens": 0.0,
        "seconds": 4.0,
        "passes": 2.0,
    }


def test_the_cache_keeps_the_largest_peak_memory_of_the_passes_that_recorded_one(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    old = _pass(tmp_path / "p1", ["a", "b"])  # a pass from before peaks were recorded
    store_pass(cache, old, ["a", "b"], 2)
    assert "peak_rss_bytes" not in cached_pass_stats(cache)
    for name, ids, rss in (("p2", ["c"], 3 * 2**20), ("p3", ["d"], 2 * 2**20)):
        folder = _pass(tmp_path / name, ids)
        stats = json.loads((folder / PASS_STATS).read_text())
        stats.update(peak_rss_bytes=rss, peak_cuda_bytes=0)
        (folder / PASS_STATS).write_text(json.dumps(stats))
        store_pass(cache, folder, ids, 2)
    totals = cached_pass_stats(cache)
    assert totals["peak_rss_bytes"] == 3 * 2**20 and totals["peak_cuda_bytes"] == 0.0
    assert totals["passes"] == 3.0


def test_recompute_replaces_the_cache_only_once_its_pass_is_complete(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    store_pass(cache, _pass(tmp_path / "p1", ["a", "b"]), ["a", "b"], 2)
    unfinished = _pass(tmp_path / "p2", ["a", "b", "c"], value=9.0)
    chunk_path(unfinished, 1).unlink()  # the pass died before its last chunk
    with pytest.raises(FileNotFoundError, match="missing"):
        store_pass(cache, unfinished, ["a", "b", "c"], 2, replace=True)
    assert read_cached(cache, ["a", "b"])["embedding"].to_list() == [[1.0, 0.0], [1.0, 1.0]]
    store_pass(cache, _pass(tmp_path / "p3", ["b", "c"], value=9.0), ["b", "c"], 2, replace=True)
    assert pending_ids(cache, ["a", "b", "c"]) == ["a"]
    assert read_cached(cache, ["c"])["embedding"].to_list() == [[9.0, 1.0]]
    assert cached_pass_stats(cache)["passes"] == 1.0


def test_a_damaged_cache_is_named_with_the_way_out_and_recompute_rebuilds_it(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    store_pass(cache, _pass(tmp_path / "p1", ["a", "b"]), ["a", "b"], 2)
    for part in (cache / CACHE_TABLE).glob("*.parquet"):
        part.write_bytes(part.read_bytes()[:40] + b"garbage")
    with pytest.raises(CacheUnreadable, match="recompute: true") as info:
        read_cached(cache, ["a"])
    assert str(cache / CACHE_TABLE) in str(info.value)
    with (cache / PASS_LOG).open("a") as f:
        f.write("not json\n[1, 2]\n")
    assert cached_pass_stats(cache)["passes"] == 1.0  # hand-edited lines left out
    store_pass(cache, _pass(tmp_path / "p2", ["a", "b"], value=3.0), ["a", "b"], 2, replace=True)
    assert read_cached(cache, ["b", "a"])["embedding"].to_list() == [[3.0, 1.0], [3.0, 0.0]]

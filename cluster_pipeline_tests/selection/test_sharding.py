"""Shard manifests: properties over random clusterings (hypothesis) and hashing."""

import json
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster_pipeline.selection.embedding_table import l2_normalise
from cluster_pipeline.selection.selectors import (
    REGISTRY,
    SELECTORS,
    SelectionInputs,
    SelectionParams,
    run_selector,
    select,
)
from cluster_pipeline.selection.sharding import (
    ManifestMismatch,
    ShardManifest,
    allocate,
    check_allocation,
    content_sha256,
    read_recorded_manifests,
)


@st.composite
def clusterings(draw):
    k = draw(st.integers(1, 5))
    sizes = draw(st.lists(st.integers(2, 30), min_size=k, max_size=k))
    labels = np.repeat(np.arange(k), sizes)
    seed = draw(st.integers(0, 2**16))
    labels = np.random.default_rng(seed).permutation(labels)
    dist = np.random.default_rng(seed + 1).random(len(labels)).astype(np.float32)
    return k, labels, dist, seed


@settings(max_examples=60, deadline=None)
@given(clusterings(), st.sampled_from(SELECTORS), st.sampled_from([0.5, 1.0]))
def test_allocation_properties(clustering, selector, r):
    k, labels, dist, seed = clustering
    ids = np.array([f"s{i:04d}" for i in range(len(labels))])
    # Every registered selector, with random inputs for those that read more than distances.
    rng = np.random.default_rng(seed + 2)
    inputs = SelectionInputs(
        labels,
        k,
        sq_distance=dist,
        hidden_mean=l2_normalise(rng.normal(size=(len(labels), 4)).astype(np.float32)),
        targets=l2_normalise(rng.normal(size=(3, 4)).astype(np.float32)),
        # Every IFD below 1, so ifd keeps its whole budget.
        mean_loss=rng.uniform(0.1, 1.0, len(labels)),
        unconditioned_loss=rng.uniform(1.0, 2.0, len(labels)),
        loss_trajectories=rng.uniform(0.5, 3.0, (len(labels), 3)).astype(np.float32),
        less_gradients=rng.normal(size=(len(labels), 2, 4)).astype(np.float32),
        less_target_gradients=rng.normal(size=(3, 2, 4)).astype(np.float32),
        less_learning_rates=np.array([2.0, 1.0]),
        lengths=rng.integers(5, 40, len(labels)),
        response_tokens=rng.integers(1, 20, len(labels)),
        sources=np.array(["a.jsonl", "b.jsonl", "c.jsonl"])[rng.integers(0, 3, len(labels))],
        extra={
            "cluster_less_labels": rng.integers(0, 3, len(labels)),
            "cluster_less_representatives": np.arange(min(4, len(labels))),
            "cluster_less_gradients": rng.normal(size=(min(4, len(labels)), 2, 4)).astype(
                np.float32
            ),
        },
    )
    sel = run_selector(selector, inputs, SelectionParams(r, seed, knobs={"s2l_clusters": 2}))
    alloc = allocate("ds", ids, labels, sel, k, seed)
    ms = alloc.manifests
    # Every shard has the same count.
    assert len({m.n_samples for m in ms}) == 1 and len(ms) == k
    entries = Counter(s for m in ms for s in m.sample_ids)
    selected = Counter({ids[i]: int(c) for i, c in enumerate(sel.copies) if c})
    # The union of the shards is the selected set (less the remainder of the global deal).
    assert not (entries - selected)
    assert sum((selected - entries).values()) == alloc.dropped < k
    # No sample twice except through uniform oversampling.
    if selector != "uniform":
        assert max(entries.values()) == 1
    # Clustered selectors: rank c holds only cluster c; weights follow n_c K / N.
    n_c = np.bincount(labels, minlength=k)
    for m in ms:
        if REGISTRY[selector].reweighted:
            assert m.weight == pytest.approx(n_c[m.rank] * k / len(labels))
        else:
            assert m.weight == 1.0
        if REGISTRY[selector].clustered:
            idx = np.searchsorted(ids, list(m.sample_ids))
            assert (labels[idx] == m.rank).all()
    assert all(ok for ok, _ in check_allocation(ms, ids, labels, sel, alloc.dropped).values())


def test_manifest_roundtrip_and_tamper_detection(tmp_path):
    m = ShardManifest("ds", 0, 2, "peripheral", 1.25, 0, ("a", "b", "c"))
    path = m.write(tmp_path)
    assert ShardManifest.read(path) == m
    assert m.sha256 != ShardManifest("ds", 0, 2, "peripheral", 1.25, 0, ("b", "a", "c")).sha256
    assert m.sha256 != ShardManifest("ds", 0, 2, "peripheral", 1.0, 0, ("a", "b", "c")).sha256
    path.write_text(path.read_text().replace('"b"', '"x"'))
    with pytest.raises(ValueError, match="hash mismatch"):
        ShardManifest.read(path)


def test_check_allocation_catches_a_missing_sample():
    labels = np.array([0, 0, 1, 1])
    ids = np.array(["a", "b", "c", "d"])
    sel = select(labels, np.array([0.1, 0.2, 0.3, 0.4], np.float32), 2, "peripheral", 1.0)
    ms = allocate("ds", ids, labels, sel, 2).manifests
    broken = [ms[0], ShardManifest("ds", 1, 2, "peripheral", ms[1].weight, 0, ("c", "c"))]
    result = check_allocation(broken, ids, labels, sel, 0)
    assert not result["coverage"][0] and result["equal_shards"][0]


def _recorded(tmp_path):
    """Two ranks' manifests as shard_manifests writes and records them, and a foreign set (of
    another dataset) with the same shape."""
    ours = [
        ShardManifest("ds", 0, 2, "peripheral", 1.25, 0, ("a", "b", "c")),
        ShardManifest("ds", 1, 2, "peripheral", 0.75, 0, ("d", "e", "f")),
    ]
    foreign = [
        ShardManifest("other", 0, 2, "peripheral", 1.0, 0, ("p", "q", "r")),
        ShardManifest("other", 1, 2, "peripheral", 1.0, 0, ("s", "t", "u")),
    ]
    paths = [m.write(tmp_path / "ours") for m in ours]
    for m in foreign:
        m.write(tmp_path / "foreign")
    return ours, paths, [m.sha256 for m in ours], foreign


def test_recorded_manifests_refuse_every_kind_of_tampering(tmp_path):
    ours, paths, hashes, foreign = _recorded(tmp_path)
    assert read_recorded_manifests(paths, hashes, "ds") == ours
    rank_1 = paths[1]
    saved = rank_1.read_text()

    def refused() -> str:
        with pytest.raises(ManifestMismatch) as e:
            read_recorded_manifests(paths, hashes, "ds")
        rank_1.write_text(saved)
        return str(e.value)

    # A foreign manifest copied in (its own hash intact): named by file, found and expected.
    rank_1.write_text((tmp_path / "foreign" / "rank_1.json").read_text())
    assert refused() == (
        f"{rank_1} holds rank 1's manifest {foreign[1].sha256[:12]}, not the rank 1 manifest "
        f"{hashes[1][:12]} recorded by shard_manifests; materialize shard_manifests again"
    )
    # Ids removed, the stored hash left as it was: the file's own hash catches it.
    edited = json.loads(saved)
    edited["sample_ids"] = edited["sample_ids"][1:]
    rank_1.write_text(json.dumps(edited))
    content = content_sha256(("e", "f"), 0.75)
    assert refused() == (
        f"{rank_1}: content hash mismatch (stored sha256 {hashes[1][:12]}, content "
        f"{content[:12]}); the manifest was modified after shard_manifests wrote it; "
        "materialize shard_manifests again"
    )
    # A weight edited with the stored hash updated to match: the recorded hash catches it.
    edited = json.loads(saved)
    edited["weight"] = 1.0
    edited["sha256"] = content_sha256(("d", "e", "f"), 1.0)
    rank_1.write_text(json.dumps(edited))
    assert refused() == (
        f"{rank_1} holds rank 1's manifest {edited['sha256'][:12]}, not the rank 1 manifest "
        f"{hashes[1][:12]} recorded by shard_manifests; materialize shard_manifests again"
    )
    # The stored hash removed and an id changed: still the recorded hash.
    edited = json.loads(saved)
    del edited["sha256"]
    edited["sample_ids"][0] = "x"
    rank_1.write_text(json.dumps(edited))
    assert refused().startswith(f"{rank_1} holds rank 1's manifest ")
    # Deleted.
    rank_1.unlink()
    assert refused() == (
        f"the shard manifest of rank 1 of dataset 'ds', {rank_1}, is gone; materialize "
        "shard_manifests again"
    )
    # Not JSON (truncated).
    rank_1.write_text(saved[:40])
    message = refused()
    assert message.startswith(f"{rank_1}: not a shard manifest (JSONDecodeError(")
    assert message.endswith("); materialize shard_manifests again")
    # Two ranks swapped: each file is intact, but not its rank's.
    paths[0].write_bytes(saved.encode())
    rank_1.write_text(ours[0].write(tmp_path / "copy").read_text())
    with pytest.raises(ManifestMismatch) as e:
        read_recorded_manifests(paths, hashes, "ds")
    assert str(e.value) == (
        f"{paths[0]} holds rank 1's manifest {hashes[1][:12]}, not the rank 0 manifest "
        f"{hashes[0][:12]} recorded by shard_manifests; materialize shard_manifests again"
    )


def test_a_whitespace_only_reformat_is_accepted(tmp_path):
    # The hash is of the content (ordered ids and weight), not of the file's bytes.
    ours, paths, hashes, _ = _recorded(tmp_path)
    for path in paths:
        path.write_text(json.dumps(json.loads(path.read_text()), indent=4, sort_keys=True))
    assert read_recorded_manifests(paths, hashes, "ds") == ours
    compact = json.dumps(json.loads(paths[0].read_text()), separators=(",", ":"))
    paths[0].write_text(compact)
    assert read_recorded_manifests(paths, hashes, "ds") == ours

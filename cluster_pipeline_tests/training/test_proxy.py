"""s2l's proxy run (training/proxy.py): the pool dealt into token-balanced shards, settings
whose plan holds the steps asked for, and the checkpoints read back in step order."""

import json

import numpy as np
import pytest

from cluster_pipeline.training.checkpointing import TRAINING_INFO, TRAINING_STATE
from cluster_pipeline.training.config import EmbedSettings
from cluster_pipeline.training.plan import plan_packed, plan_padded
from cluster_pipeline.training.proxy import (
    ProxyRun,
    proxy_checkpoints,
    proxy_settings,
    proxy_shards,
)


def test_the_steps_must_be_a_multiple_of_the_checkpoints():
    assert ProxyRun(12, 4, 1e-4).every == 3
    with pytest.raises(ValueError, match="10 steps must be a positive multiple of its 4"):
        ProxyRun(10, 4, 1e-4)


def test_every_sample_is_in_one_shard_with_weight_1():
    ids = np.array([f"s{i}" for i in range(7)])
    lengths = np.array([5, 9, 3, 7, 2, 8, 4])
    allocation = proxy_shards("d", ids, lengths, world_size=2)
    shards = [m.sample_ids for m in allocation.manifests]
    assert sorted(shards[0] + shards[1]) == sorted(ids.tolist())
    assert [m.weight for m in allocation.manifests] == [1.0, 1.0]
    assert allocation.dropped == 0 and sum(allocation.tokens_per_rank) == 38


@pytest.mark.parametrize("packing", [True, False])
def test_the_settings_plan_at_least_the_steps_asked_for(packing):
    # 40 samples of 30 tokens on 2 ranks: an epoch holds only a few steps, so the run needs
    # several epochs to reach 24 steps; both plans (packed, and padded, the fallback) do.
    ids = np.array([f"s{i}" for i in range(40)])
    lengths = np.full(40, 30)
    allocation = proxy_shards("d", ids, lengths, world_size=2)
    run = ProxyRun(24, 4, 1e-4)
    embed = EmbedSettings(max_length=64, packing=packing)
    settings = proxy_settings(embed, run, allocation)
    assert settings.max_steps == 24 and settings.save_every_steps == 6
    assert settings.keep_checkpoints == 4 and not settings.reweight
    assert settings.max_length == 64 and settings.packing == packing
    per_rank = [[30] * m.n_samples for m in allocation.manifests]
    padded = plan_padded(
        [len(x) for x in per_rank],
        settings.per_device_batch_size,
        settings.gradient_accumulation_steps,
        settings.epochs,
        settings.seed,
        settings.max_steps,
    )
    packed = plan_packed(
        per_rank,
        settings.max_tokens_per_micro_batch,
        settings.max_packed_length,
        settings.gradient_accumulation_steps,
        settings.epochs,
        settings.seed,
        settings.max_steps,
    )
    assert [len(p) for p in padded] == [24, 24] and [len(p) for p in packed] == [24, 24]


def test_the_checkpoints_are_the_intermediates_then_the_final_one(tmp_path):
    out = tmp_path / "run"
    assert proxy_checkpoints(out) == []  # not finished
    for step in (4, 2):
        folder = tmp_path / "run.checkpoints" / f"step_{step:07d}"
        folder.mkdir(parents=True)
        (folder / TRAINING_STATE).write_bytes(b"")
    out.mkdir()
    (out / TRAINING_INFO).write_text(json.dumps({"steps": 6}))
    found = proxy_checkpoints(out)
    assert [c.step for c in found] == [2, 4, 6]
    assert found[-1].path == out and found[0].path.name == "step_0000002"

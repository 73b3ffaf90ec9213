"""The torchrun training entry: re-weighting equals the stratified gradient, resume after a
kill reaches the same weights (and rank 0 logs every step, restored ones too, into MLflow), and
unequal shards are refused."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from cluster_pipeline.data.tokenization import collate, encode_sample
from cluster_pipeline.selection.sharding import ShardManifest
from cluster_pipeline.storage.layout import DataLayout
from cluster_pipeline.tracking.tracker import Tracker, local_store
from cluster_pipeline.training.config import TrainJob, TrainSettings
from cluster_pipeline.training.distributed import step_eta
from cluster_pipeline.training.loop import lr_lambda
from cluster_pipeline.training.plan import plan_padded
from cluster_pipeline_tests.helpers import torchrun, train_job

TRAIN = "cluster_pipeline.recipes.train"


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


ONE_STEP = dict(
    per_device_batch_size=2,
    max_steps=1,
    learning_rate=1e-3,
    warmup_ratio=0.0,
    schedule="constant",
    max_grad_norm=1e9,
)


def _shard_gradients(model, tok, cfg: TrainJob, table) -> list[dict[str, torch.Tensor]]:
    """Per shard manifest, the mean-token-loss gradient g_c of every trainable parameter, in
    one process."""
    import polars as pl

    rows = pl.read_delta(table.uri)
    grads = []
    for path in cfg.manifests:
        m = ShardManifest.read(Path(path))
        sub = rows.filter(pl.col("sample_id").is_in(m.sample_ids))
        sub = sub.join(
            pl.DataFrame({"sample_id": list(m.sample_ids)}).with_row_index("i"), on="sample_id"
        ).sort("i")
        enc = [
            encode_sample(tok, s, p, r, 64)
            for s, p, r in zip(sub["system"], sub["prompt"], sub["response"], strict=True)
        ]
        batch = collate(enc, tok.pad_token_id)
        model.zero_grad()
        model(
            **{k: batch[k] for k in ("input_ids", "attention_mask", "position_ids", "labels")}
        ).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    return grads


def _stratified_step(
    model, grads: list[dict[str, torch.Tensor]], shares: tuple[float, float] = (0.75, 0.25)
) -> None:
    """One AdamW step (lr 1e-3) on g = shares[0] g_0 + shares[1] g_1 (default: n_c = (3, 1) of
    N = 4), checking that this differs from the unweighted average (the test can tell the two
    apart)."""
    a, b = shares
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-3, weight_decay=0.0)
    for n, p in model.named_parameters():
        if p.requires_grad:
            p.grad = a * grads[0][n] + b * grads[1][n]
    opt.step()
    unweighted = {n: 0.5 * grads[0][n] + 0.5 * grads[1][n] for n in grads[0]}
    assert any(
        not torch.allclose(unweighted[n], a * grads[0][n] + b * grads[1][n]) for n in grads[0]
    )


def _config_drift(checkpoint: Path, base: Path) -> dict:
    """{key: (checkpoint's value, base's value)} where the two config.json files differ (the
    transformers version aside)."""
    ours, theirs = (json.loads((p / "config.json").read_text()) for p in (checkpoint, base))
    keys = (set(ours) | set(theirs)) - {"transformers_version"}
    return {k: (ours.get(k), theirs.get(k)) for k in keys if ours.get(k) != theirs.get(k)}


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode",
    [{}, {"parallelism": "fsdp"}, {"gradient_checkpointing": True}],
    ids=["ddp", "fsdp", "ddp_activation_checkpointing"],
)
def test_one_weighted_step_equals_the_stratified_full_gradient(tmp_path, tiny_model_dir, mode):
    """DDP, FSDP2 and activation checkpointing: one step with w = (1.5, 0.5) on 2 ranks equals
    one process applying 0.75 g_0 + 0.25 g_1."""
    # n_c = (3, 1) of N = 4, K = 2: w = n_c K / N = (1.5, 0.5).
    cfg, table = train_job(tmp_path, tiny_model_dir, [1.5, 0.5], per_rank=2, **ONE_STEP, **mode)
    done = torchrun(TRAIN, 2, ["--config", str(tmp_path / "train.json")])
    assert done.returncode == 0, done.stderr[-3000:]
    trained = _weights(Path(cfg.output_dir))

    from cluster_pipeline.models.loading import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer(str(tiny_model_dir))
    model.train()
    _stratified_step(model, _shard_gradients(model, tok, cfg, table))
    for n, p in model.named_parameters():
        torch.testing.assert_close(trained[n], p.detach(), rtol=1e-5, atol=1e-5)
    # Nothing of the training's own state (use_cache off, activation checkpointing, FSDP's
    # wrapping) leaks into the saved model's config: the checkpoint loads as the base does.
    assert _config_drift(Path(cfg.output_dir), tiny_model_dir) == {}


@pytest.mark.slow
@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_a_packed_step_on_ranks_of_unequal_samples_equals_the_token_stratified_gradient(
    tmp_path, tiny_model_dir, parallelism
):
    """Token balance leaves the ranks different sample counts: 5 and 3 samples here, packed
    into several micro-batches each (2 accumulated, at most 120 tokens). Each rank's loss is
    its w_c x token-mean over its whole step, so one step with w = (1.2, 0.8) equals one process
    applying 0.6 g_0 + 0.4 g_1, g_c the token-mean gradient of shard c (docs/design.md, step 5).
    """
    cfg, table = train_job(
        tmp_path,
        tiny_model_dir,
        [1.2, 0.8],
        per_rank=[5, 3],
        packing=True,
        max_tokens_per_micro_batch=120,
        max_packed_length=64,
        gradient_accumulation_steps=2,
        epochs=1,
        **{k: v for k, v in ONE_STEP.items() if k != "per_device_batch_size"},
        parallelism=parallelism,
    )
    done = torchrun(TRAIN, 2, ["--config", str(tmp_path / "train.json")])
    assert done.returncode == 0, done.stderr[-3000:]
    info = json.loads((Path(cfg.output_dir) / "training_info.json").read_text())
    # One step per rank (the plan puts both shards' tokens in one step), several micro-batches.
    assert info["steps"] == 1 and info["packed"] is True
    metrics = json.loads(Path(cfg.output_dir + ".metrics.jsonl").read_text().splitlines()[0])
    assert metrics["samples_per_rank"] == [5, 3]
    assert 0 < metrics["useful_compute_fraction"] <= 1
    trained = _weights(Path(cfg.output_dir))

    from cluster_pipeline.models.loading import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer(str(tiny_model_dir))
    model.train()
    _stratified_step(model, _shard_gradients(model, tok, cfg, table), (0.6, 0.4))
    for n, p in model.named_parameters():
        torch.testing.assert_close(trained[n], p.detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_one_weighted_lora_step_equals_the_stratified_adapter_gradient(
    tmp_path, tiny_model_dir, parallelism
):
    """LoRA: the same equivalence on the adapter parameters; the checkpoint holds the merged
    weights (loadable as a plain model) and the adapter beside them, recorded in provenance."""
    from cluster_pipeline.models.loading import load_model_and_tokenizer
    from cluster_pipeline.training.parallel import apply_lora

    lora = dict(lora_r=4, lora_alpha=8, lora_target_modules=["q_proj", "v_proj"])
    cfg, table = train_job(
        tmp_path,
        tiny_model_dir,
        [1.5, 0.5],
        per_rank=2,
        parallelism=parallelism,
        **ONE_STEP,
        **lora,
    )
    done = torchrun(TRAIN, 2, ["--config", str(tmp_path / "train.json")])
    assert done.returncode == 0, done.stderr[-3000:]
    trained = _weights(Path(cfg.output_dir))

    model, tok = load_model_and_tokenizer(str(tiny_model_dir))
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    model = apply_lora(model, cfg.settings)
    model.train()
    _stratified_step(model, _shard_gradients(model, tok, cfg, table))
    merged = model.merge_and_unload()
    changed = 0
    for n, p in merged.named_parameters():
        torch.testing.assert_close(trained[n], p.detach(), rtol=1e-5, atol=1e-6)
        changed += not torch.equal(trained[n], base[n])
    assert changed == 4  # q_proj and v_proj of both layers, and nothing else
    info = json.loads((Path(cfg.output_dir) / "training_info.json").read_text())
    assert info["adapter"]["r"] == 4 and sorted(info["adapter"]["target_modules"]) == [
        "q_proj",
        "v_proj",
    ]
    assert (Path(cfg.output_dir) / "adapter" / "adapter_model.safetensors").exists()
    assert _config_drift(Path(cfg.output_dir), tiny_model_dir) == {}


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode",
    [{"parallelism": "ddp"}, {"parallelism": "fsdp"}, {"parallelism": "ddp", "lora_r": 4}],
    ids=["ddp", "fsdp", "ddp_lora"],
)
def test_resume_after_a_kill_reaches_the_same_weights(tmp_path, tiny_model_dir, mode):
    """DDP resumes from full weights, FSDP from torch.distributed.checkpoint shards, LoRA from
    the adapter: each reaches the uninterrupted run's weights and losses."""
    common = dict(per_device_batch_size=2, epochs=3, learning_rate=5e-3, save_every_steps=2, **mode)
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    ref_cfg, _ = train_job(ref_dir, tiny_model_dir, [1.2, 0.8], per_rank=10, **common)
    assert torchrun(TRAIN, 2, ["--config", str(ref_dir / "train.json")]).returncode == 0

    cut_dir = tmp_path / "cut"
    cut_dir.mkdir()
    cut_cfg, _ = train_job(cut_dir, tiny_model_dir, [1.2, 0.8], per_rank=10, **common)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        TRAIN,
        "--config",
        str(cut_dir / "train.json"),
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    ckpts = Path(cut_cfg.output_dir + ".checkpoints")
    deadline = time.time() + 600  # a loaded machine is slow; the kill must follow step 4
    while time.time() < deadline and not (ckpts / "step_0000004" / "training_state.pt").exists():
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    assert (ckpts / "step_0000004" / "training_state.pt").exists(), "step 4 was never saved"
    proc.wait()
    assert not Path(cut_cfg.output_dir).exists(), "the kill must land before the end"
    tracked = mode == {"parallelism": "ddp"}  # one case pays for MLflow's import and store
    store = local_store(DataLayout.at(tmp_path / "data"))
    tracker = Tracker(store.uri, artifact_location=store.artifact_location)
    run_id = tracker.start_run("resumed", tags={}) if tracked else None
    if tracked:
        job = TrainJob.load(cut_dir / "train.json")
        job.model_copy(update={"tracking": tracker.target(run_id)}).dump(cut_dir / "train.json")
    done = torchrun(TRAIN, 2, ["--config", str(cut_dir / "train.json")])
    assert done.returncode == 0, done.stderr[-3000:]
    info = json.loads((Path(cut_cfg.output_dir) / "training_info.json").read_text())
    assert info["resumed_from_step"] >= 4 and info["steps"] == 15
    ref, cut = _weights(Path(ref_cfg.output_dir)), _weights(Path(cut_cfg.output_dir))
    for name in ref:
        torch.testing.assert_close(cut[name], ref[name], rtol=1e-6, atol=1e-7)
    ref_loss = [
        json.loads(x)["loss"]
        for x in Path(ref_cfg.output_dir + ".metrics.jsonl").read_text().splitlines()
    ]
    cut_loss = [
        json.loads(x)["loss"]
        for x in Path(cut_cfg.output_dir + ".metrics.jsonl").read_text().splitlines()
    ]
    np.testing.assert_allclose(cut_loss, ref_loss, rtol=1e-6)
    if run_id is not None:
        # One point per step (rank 0 alone logs), the steps before the kill included.
        from mlflow import MlflowClient

        history = MlflowClient(tracking_uri=store.uri).get_metric_history(run_id, "loss")
        assert sorted((m.step, m.value) for m in history) == [
            (step, pytest.approx(loss, rel=1e-12)) for step, loss in enumerate(cut_loss, 1)
        ]


@pytest.mark.slow
@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_shards_of_unequal_sizes_take_the_same_steps(tmp_path, tiny_model_dir, packing):
    """Token balance gives ranks different sample counts (6 and 3 here): every rank takes the
    same optimizer steps and sees each of its samples once per epoch; the metrics count each
    rank's samples, real and tensor tokens per step."""
    cfg, _ = train_job(
        tmp_path,
        tiny_model_dir,
        [1.0, 1.0],
        per_rank=[6, 3],
        per_device_batch_size=2,
        epochs=2,
        packing=packing,
        max_tokens_per_micro_batch=60,
        max_packed_length=64,
    )
    done = torchrun(TRAIN, 2, ["--config", str(tmp_path / "train.json")])
    assert done.returncode == 0, done.stderr[-3000:]
    lines = Path(cfg.output_dir + ".metrics.jsonl").read_text().splitlines()
    rows = [json.loads(x) for x in lines]
    info = json.loads((Path(cfg.output_dir) / "training_info.json").read_text())
    assert info["steps"] == len(rows) and info["packed"] is packing
    assert [sum(r["samples_per_rank"][k] for r in rows) for k in (0, 1)] == [12, 6]
    for r in rows:
        real, paid = r["real_tokens_per_rank"], r["padded_tokens_per_rank"]
        assert all(0 <= a <= b for a, b in zip(real, paid, strict=True))
        assert r["useful_compute_fraction"] == pytest.approx(sum(real) / (2 * max(paid)))
    assert info["real_tokens"] == sum(sum(r["real_tokens_per_rank"]) for r in rows)
    # Each step logs the rate it trained at: step k uses the schedule's multiplier at k - 1
    # (warmup_ratio x steps rounded down; the first step of a warmup is not at rate 0).
    settings = cfg.settings
    multiplier = lr_lambda(settings.schedule, int(settings.warmup_ratio * len(rows)), len(rows))
    assert [r["lr"] for r in rows] == [
        pytest.approx(settings.learning_rate * multiplier(k), rel=1e-12) for k in range(len(rows))
    ]
    assert rows[0]["lr"] > 0.0 and rows[-1]["lr"] > 0.0
    if packing:  # packed: every step holds samples of both ranks
        assert all(min(r["samples_per_rank"]) >= 1 for r in rows)


def test_schedule_and_plan():
    f = lr_lambda("cosine", warmup_steps=2, total_steps=10)
    assert [round(f(s), 4) for s in (0, 1, 2, 6, 10)] == [0.5, 1.0, 1.0, 0.5, 0.0]
    g = lr_lambda("linear", 0, 4)
    assert [g(s) for s in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    # 10 samples, batch 2 x accumulation 2: ceil(10 / 4) = 3 steps per epoch.
    plan = plan_padded([10], 2, 2, epochs=2, seed=0)[0]
    assert len(plan) == 6 and [s.epoch for s in plan] == [0, 0, 0, 1, 1, 1]
    assert sorted(i for s in plan[:3] for i in s.samples) == list(range(10))
    assert [len(s.micro_batches) for s in plan[:3]] == [2, 2, 1]


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("learning_rate", 0.0, "learning_rate"),
        ("schedule", "step", "schedule"),
        ("per_device_batch_size", 0, "per_device_batch_size"),
        ("manifests", [], "manifests"),
        ("lerning_rate", 1e-4, "lerning_rate"),
    ],
)
def test_config_errors_name_the_option(field, value, match):
    job = {
        "settings": {},
        "model_path": "m",
        "instructions_uri": "u",
        "instructions_version": 0,
        "manifests": ["a"],
        "output_dir": "o",
    }
    if field in job:
        job[field] = value
    else:
        job["settings"][field] = value
    with pytest.raises(ValueError, match=match):
        TrainJob.model_validate(job)
    # And as a rank reads it: from the JSON file the asset wrote.
    with pytest.raises(ValueError, match=match):
        TrainJob.model_validate_json(json.dumps(job))


@pytest.mark.slow
def test_measuring_the_inter_rank_gradient_cosine_does_not_change_training(
    tmp_path, tiny_model_dir
):
    runs = {}
    for every in (1, None):
        folder = tmp_path / f"every_{every}"
        folder.mkdir()
        job, _ = train_job(
            folder,
            tiny_model_dir,
            [1.5, 0.5],
            per_rank=8,
            per_device_batch_size=2,
            gradient_accumulation_steps=2,
            learning_rate=1e-3,
            grad_cosine_every=every,
        )
        done = torchrun(TRAIN, 2, ["--config", str(folder / "train.json")])
        assert done.returncode == 0, done.stderr[-3000:]
        metrics = [
            json.loads(x) for x in Path(job.output_dir + ".metrics.jsonl").read_text().splitlines()
        ]
        runs[every] = (_weights(Path(job.output_dir)), metrics)
    (measured, with_cos), (plain, without) = runs[1], runs[None]
    assert len(with_cos) == 2 and all(-1.0 <= m["grad_cosine"] <= 1.0 for m in with_cos)
    assert not any("grad_cosine" in m for m in without)
    # The manual all-reduce after a measurement equals DDP's own averaging.
    for name in plain:
        torch.testing.assert_close(measured[name], plain[name], rtol=1e-5, atol=1e-6)


# A 1B Llama's shape (18 layers of width 2,048, MLP 5,632, 32 heads, 49,152 words): its
# parameters counted by hand in test_a_model_shape_is_read_from_its_config.
BIG = dict(layers=18, hidden=2048, intermediate=5632, heads=32, vocab=49152)
BIG_P = 912_336_896


def test_a_model_shape_is_read_from_its_config(tmp_path):
    """Parameters counted on the meta device without weights, and the widths the estimate
    uses, from a 1B Llama config."""
    from transformers import LlamaConfig

    from cluster_pipeline.training.memory import ModelShape, parameter_count

    LlamaConfig(
        vocab_size=49152,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=18,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=True,
    ).save_pretrained(tmp_path)
    # 49152 x 2048 embedding + 18 x (attention 2048 x (2048 + 2 x 512 + 2048) + MLP 3 x
    # 2048 x 5632 + 2 norms x 2048) + final norm 2048.
    n = 49152 * 2048 + 18 * (2048 * (2048 + 2 * 512 + 2048) + 3 * 2048 * 5632 + 2 * 2048) + 2048
    assert parameter_count(str(tmp_path)) == n == BIG_P
    assert ModelShape.of(str(tmp_path)) == ModelShape(parameters=n, **BIG)


def test_a_saved_models_shape_is_read_without_transformers(tmp_path):
    """A saved folder's parameters come from its safetensors headers and its widths from
    config.json: the same as the meta-device count, for one file (tied embeddings stored
    once) and for shards, with neither transformers nor torch imported (they cost a fresh
    Dagster step worker about 6 s)."""
    import subprocess
    import sys

    from cluster_pipeline_tests.helpers import build_model

    # The tests' tiny Llama (hidden 32, MLP 64, 2 layers, 4 heads, 2 key-value heads), tied:
    # 400 x 32 embedding (tied: once) + 2 x (attention 32 x (32 + 2 x 16 + 32) + MLP 3 x 32 x
    # 64 + 2 norms x 32) + final norm 32.
    n = 400 * 32 + 2 * (32 * (32 + 2 * 16 + 32) + 3 * 32 * 64 + 2 * 32) + 32
    assert n == 31_392
    one, shards = tmp_path / "one", tmp_path / "shards"
    model = build_model(400, tie_word_embeddings=True)
    model.save_pretrained(one)
    model.save_pretrained(shards, max_shard_size="20KB")
    assert len(list(shards.glob("model-*.safetensors"))) > 1
    probe = (
        "import sys\n"
        "from cluster_pipeline.training.memory import ModelShape\n"
        "for path in sys.argv[1:]:\n"
        "    s = ModelShape.of(path)\n"
        "    print(s.parameters, s.layers, s.hidden, s.intermediate, s.heads, s.vocab)\n"
        "print('torch' in sys.modules, 'transformers' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe, str(one), str(shards)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert out == [f"{n} 2 32 64 4 400", f"{n} 2 32 64 4 400", "False False"]


def test_a_config_without_the_standard_keys_is_read_by_transformers(tmp_path):
    """GPT-2 names its widths n_embd/n_layer/n_head: its shape comes from AutoConfig (which maps
    them) and its parameters from the meta device where no weights are saved."""
    from transformers import GPT2Config

    from cluster_pipeline.training.memory import ModelShape

    GPT2Config(vocab_size=100, n_positions=16, n_embd=8, n_layer=2, n_head=2).save_pretrained(
        tmp_path
    )
    # wte 100 x 8 + wpe 16 x 8 + 2 x (ln 2 x 2 x 8 + c_attn 8 x 24 + 24 + c_proj 8 x 8 + 8 +
    # c_fc 8 x 32 + 32 + c_proj 32 x 8 + 8) + ln_f 2 x 8 (the head tied to wte).
    block = 2 * 2 * 8 + 8 * 24 + 24 + 8 * 8 + 8 + 8 * 32 + 32 + 32 * 8 + 8
    n = 100 * 8 + 16 * 8 + 2 * block + 2 * 8
    assert ModelShape.of(str(tmp_path)) == ModelShape(n, 2, 8, 32, 2, 100)


def test_the_training_estimate_counts_each_part_by_hand():
    """Hand-checked for SmolLM2-135M's shape, packed 1,024-token micro-batches in rows of 512,
    DDP at 2 ranks: 4 bytes x (weights P, gradients P, DDP buckets P, AdamW 2P), and the
    activations 1,024 tokens x 30 layers x (12 x 576 + 4 x 1,536 + 9 heads x 512) + 3 x
    1,024 x 49,152 logits, each 4 bytes; FSDP divides the state by the ranks and has no
    buckets; LoRA trains no parameter; checkpointing keeps the layers' inputs and one layer."""
    from cluster_pipeline.training import memory
    from cluster_pipeline.training.memory import ModelShape, training_estimate

    smol = ModelShape(134_515_008, 30, 576, 1536, 9, 49152)
    p = smol.parameters
    process = memory.PROCESS_BYTES["train"]
    per_layer = 12 * 576 + 4 * 1536 + 9 * 512
    acts = 4 * (1024 * 30 * per_layer + 3 * 1024 * 49152)
    ddp = training_estimate(smol, TrainSettings(), 2)
    assert dict(ddp.parts) == {
        "process": process,
        "weights": 4 * p,
        "gradients": 4 * p,
        "DDP buckets": 4 * p,
        "AdamW moments": 8 * p,
        "activations": acts,
    }
    assert ddp.total == process + 20 * p + acts
    fsdp = training_estimate(smol, TrainSettings(parallelism="fsdp"), 2)
    assert fsdp.total == process + 4 * p // 2 + 4 * p // 2 + 8 * p // 2 + acts
    lora = training_estimate(smol, TrainSettings(lora_r=8), 2)
    assert lora.total == process + 4 * p + acts
    # One rank: no buckets. Padded batches: per_device_batch_size x max_length tokens, rows of
    # max_length.
    padded = TrainSettings(packing=False, per_device_batch_size=2, max_length=128)
    alone = training_estimate(smol, padded, 1)
    assert alone.part("DDP buckets") == 0
    assert alone.part("activations") == 4 * (
        256 * 30 * (12 * 576 + 4 * 1536 + 9 * 128) + 3 * 256 * 49152
    )
    checkpointed = training_estimate(
        smol, padded.model_copy(update={"gradient_checkpointing": True}), 1
    )
    assert checkpointed.part("activations") == 4 * (
        256 * (30 * 576 + 12 * 576 + 4 * 1536 + 9 * 128) + 3 * 256 * 49152
    )


def test_the_inference_estimates_count_one_batch_and_the_weights():
    """The embedding pass: the process, 4 bytes a weight and one batch's transients (8,192
    tokens in rows of 512: 6 x 576 + 3 x 1,536 + 3 x 9 heads x 512 values a token, or 2 x
    1,024 rows of logits, or the checkpoint's copy while loading, whichever is larger: here the
    layer's); evaluation the same, or the generation's cache where that is larger."""
    from cluster_pipeline.evaluation.suites import EvalSettings
    from cluster_pipeline.training import memory
    from cluster_pipeline.training.config import EmbedSettings
    from cluster_pipeline.training.memory import (
        ModelShape,
        embedding_estimate,
        evaluation_estimate,
    )

    smol = ModelShape(134_515_008, 30, 576, 1536, 9, 49152)
    layer, logits = 8192 * (6 * 576 + 3 * 1536 + 3 * 9 * 512), 2 * 1024 * 49152
    assert layer > logits
    batch = 4 * layer
    embed = embedding_estimate(smol, EmbedSettings())
    assert embed.total == memory.PROCESS_BYTES["embed"] + 4 * smol.parameters + batch
    evaluation = evaluation_estimate(smol, EvalSettings())
    assert evaluation.total == memory.PROCESS_BYTES["evaluate"] + 4 * smol.parameters + batch
    # 64 prompts x (2,048 + 2,048) positions: the key-value cache is the larger part.
    wide = EvalSettings(batch_size=64, max_length=2048, max_new_tokens=2048)
    cache = 4 * 64 * 4096 * 30 * 2 * 576
    assert evaluation_estimate(smol, wide).part("transient") == cache > batch
    # Short batches: the checkpoint's copy while the model loads, 4 bytes a parameter, is the
    # largest transient.
    short = EmbedSettings(max_batch_tokens=2048, max_packed_length=256)
    assert embedding_estimate(smol, short).part("transient") == 4 * smol.parameters
    # A pass of 600 tokens fills no 8,192-token batch: one batch of 600 tokens in rows of 512;
    # 300 tokens, one row of 300.
    tiny = ModelShape(44_192, 2, 32, 64, 4, 400)
    layer = 600 * (6 * 32 + 3 * 64 + 3 * 4 * 512)
    assert embedding_estimate(tiny, EmbedSettings(), tokens=600).part("transient") == 4 * layer
    assert evaluation_estimate(tiny, EvalSettings(), tokens=600).part("transient") == 4 * layer
    short_pass = 4 * 300 * (6 * 32 + 3 * 64 + 3 * 4 * 300)
    assert embedding_estimate(tiny, EmbedSettings(), tokens=300).part("transient") == short_pass


def test_the_memory_check_refuses_what_cannot_fit_and_says_what_would():
    from cluster_pipeline.training.memory import (
        GIB,
        ModelShape,
        TrainingMemoryError,
        check_training_memory,
        training_estimate,
    )

    big = ModelShape(parameters=BIG_P, **BIG)
    budget = 14 * GIB  # a 28 GiB machine, 2 ranks
    ddp = TrainSettings(parallelism="ddp")

    def way(cfg: TrainSettings, available: int = budget) -> str:
        need = training_estimate(big, cfg, 2).total
        return f"{need / GIB:.1f} GiB per rank{'' if need <= available else ', not enough alone'}"

    with pytest.raises(TrainingMemoryError) as refused:
        check_training_memory(big, ddp, 2, budget)
    acts = training_estimate(big, ddp, 2).part("activations") / GIB
    need = training_estimate(big, ddp, 2).total / GIB
    assert str(refused.value) == (
        f"training needs about {need:.1f} GiB per rank (912M parameters, parallelism ddp, 2 "
        f"ranks; {acts:.1f} GiB of it activations) but 14.0 GiB is available per rank; use "
        f"parallelism: fsdp ({way(TrainSettings(parallelism='fsdp'))}), or "
        f"lora_r > 0 ({way(TrainSettings(lora_r=8))}), or gradient_checkpointing: "
        f"true ({way(TrainSettings(gradient_checkpointing=True))}), or a smaller "
        "max_tokens_per_micro_batch or max_length (activations grow with both), or a machine "
        "with more memory"
    )
    # 20 bytes a parameter under DDP is 17 GiB before any activation; FSDP's 8 at 2 ranks fit.
    assert need * GIB > 20 * BIG_P > budget
    assert "not enough alone" not in way(TrainSettings(parallelism="fsdp"))
    with pytest.raises(TrainingMemoryError) as refused:
        check_training_memory(big, TrainSettings(parallelism="fsdp", lora_r=8), 2, GIB)
    small = TrainSettings(parallelism="fsdp", lora_r=8, gradient_checkpointing=True)
    assert str(refused.value).endswith(
        f"but 1.0 GiB is available per rank; use gradient_checkpointing: true "
        f"({way(small, GIB)}), or a smaller max_tokens_per_micro_batch or max_length "
        "(activations grow with both), or more ranks (balanced_clusters.num_clusters)"
    )
    assert way(small, GIB).endswith("not enough alone")
    fits = check_training_memory(big, TrainSettings(parallelism="fsdp"), 2, budget)
    assert fits == training_estimate(big, TrainSettings(parallelism="fsdp"), 2)


def test_lora_targets_that_match_no_module_are_refused_before_launch(tiny_model_dir):
    from cluster_pipeline.training.parallel import check_lora_targets

    check_lora_targets(str(tiny_model_dir), TrainSettings(lora_r=4, lora_target_modules=["q_proj"]))
    with pytest.raises(ValueError) as refused:
        check_lora_targets(
            str(tiny_model_dir), TrainSettings(lora_r=4, lora_target_modules=["nope_proj"])
        )
    message = str(refused.value)
    assert message.startswith("lora_target_modules ['nope_proj']: Target modules {'nope_proj'}")
    assert message.endswith(
        "The model's linear modules are down_proj, gate_proj, k_proj, lm_head, o_proj, "
        "q_proj, up_proj, v_proj."
    )


@pytest.mark.parametrize("lora_r", [0, 4])
def test_the_export_of_a_gathered_state_keeps_tied_embeddings(lora_r):
    """A state gathered from FSDP shards holds tied matrices as two tensors; the exported
    model ties them again (one embedding matrix, as the base), merges LoRA, and leaves the
    training model's config alone."""
    import copy

    from cluster_pipeline.training.checkpointing import export_model
    from cluster_pipeline.training.parallel import apply_lora
    from cluster_pipeline_tests.helpers import build_model

    model = build_model(64, tie_word_embeddings=True)
    if lora_r:
        model = apply_lora(model, TrainSettings(lora_r=lora_r))
        for name, p in model.named_parameters():
            if "lora_B" in name:  # B = 0 at init: make the merge change the weights
                torch.nn.init.normal_(p)
    expected: Any = copy.deepcopy(model)
    expected = expected.merge_and_unload() if lora_r else expected
    state = {k: v.clone() for k, v in model.state_dict().items()}  # untied, as gathered
    plain = export_model(model, state)
    assert plain.config.tie_word_embeddings is True
    assert plain.get_output_embeddings().weight is plain.get_input_embeddings().weight
    assert sum(p.numel() for p in plain.parameters()) == sum(
        p.numel() for p in expected.parameters()
    )
    for (name, p), (_, q) in zip(
        plain.named_parameters(), expected.named_parameters(), strict=True
    ):
        torch.testing.assert_close(p, q, msg=name)
    wrapped: Any = model
    base = wrapped.get_base_model() if lora_r else wrapped
    assert base.config.tie_word_embeddings is True


def test_the_step_eta_is_the_mean_step_time_times_the_steps_left():
    assert step_eta(2, 5, 30.0) == ", ETA 75 s"  # 15 s a step, 5 left
    assert step_eta(3, 0, 30.0) == ""  # the last step: nothing left
    assert step_eta(0, 7, 0.0) == ""  # resumed, no step of this process yet


class _Capture:
    """A Reporter of rank 0 that keeps what it is given (the asset's materialization metadata
    and the warnings), where Pipes would carry them to Dagster."""

    def __init__(self):
        self.metadata: dict[str, Any] = {}
        self.warnings: list[str] = []

    def info(self, message: str) -> None:
        pass

    def doing(self, what: str, say: bool = True) -> None:
        pass

    def warning(self, message: str) -> None:
        self.warnings.append(message)

    def materialization(self, metadata: dict) -> None:
        self.metadata = metadata


def test_a_refused_packing_is_a_warning_in_the_assets_metadata(
    tmp_path, tiny_model_dir, monkeypatch
):
    """A model the packing gate refuses trains padded, and the refusal, with its figures, is in
    the materialization metadata the trained_checkpoint asset shows (``warnings``, ``packed:
    false``) and in training_info.json, not only in the log. The gate's verdict is given here
    (its own tests are in cluster_pipeline_tests/data/test_packing.py); the loop is real."""
    from cluster_pipeline.data.packing import PackCheck
    from cluster_pipeline.training import loop
    from cluster_pipeline.training.distributed import DistEnv

    refused = PackCheck(False, 0.134, 0.0253, 0.244, 0.0982, "torch.bfloat16", 0.389)
    monkeypatch.setattr(loop, "pack_check", lambda model, **kw: refused)
    cfg, _ = train_job(tmp_path, tiny_model_dir, [1.0], per_rank=4, packing=True, max_steps=1)
    report = _Capture()
    loop.train(cfg, DistEnv(0, 0, 1), report)  # pyright: ignore[reportArgumentType]
    want = (
        "LlamaForCausalLM attends across packed samples: a sample's logits moved by 0.134 when "
        "the sample before it in the row changed (bound 0.0253 for torch.bfloat16) "
        "(data/packing.pack_check): training with padded batches of per_device_batch_size"
    )
    assert report.metadata["warnings"] == [want] and report.metadata["packed"] is False
    assert want in report.warnings
    assert report.metadata["step_kernels"] == (
        "attention: sdpa, loss: chunked, compiled_layers: 0, optimizer: AdamW (for-each)"
    )
    # Every value is one Dagster Pipes takes as raw metadata (the e2e test sends it through).
    assert all(isinstance(v, str | int | float | bool | list) for v in report.metadata.values())
    info = json.loads((Path(cfg.output_dir) / "training_info.json").read_text())
    assert info["warnings"] == [want] and info["packed"] is False
    assert "mfu" not in info  # a CPU run claims no MFU

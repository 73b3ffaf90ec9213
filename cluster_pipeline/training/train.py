"""Data-parallel fine-tuning, one rank per cluster, re-weighted (DESIGN.md steps 4-5).

Launch lines::

    # one process (world size 1: one shard manifest)
    python -m cluster_pipeline.training.train --config train_config.json
    # K ranks on one machine, rank c trains on shard manifest c (gloo on CPU, nccl on GPUs)
    torchrun --standalone --nproc_per_node=K -m cluster_pipeline.training.train --config train_config.json
    # several machines: same command on each node, with
    torchrun --nnodes=2 --node_rank=R --rdzv_backend=c10d --rdzv_endpoint=HOST:29400 \
        --nproc_per_node=K/2 -m cluster_pipeline.training.train --config train_config.json

Rank c reads ``manifests[c]`` and multiplies its loss by the manifest's weight w_c = n_c K / N.
DDP averages gradients over the K ranks, so each update follows (1/K) sum_c w_c g_c =
sum_c (n_c / N) g_c: the stratified estimate of the full-data gradient. Every rank must take the
same number of optimizer steps (DDP hangs otherwise); that is checked before the first step.

Rank 0 alone logs (through Dagster Pipes when launched by the ``trained_checkpoint`` asset),
writes ``metrics.jsonl`` and saves the checkpoint: ``save_pretrained`` output (safetensors) and
the tokenizer, written to a temporary folder and renamed, plus ``training_info.json`` naming the
manifests' content hashes, the base model and the config.
"""

if __name__ == "__main__":
    # Before torch loads (seconds): a rank must not outlive a launcher killed meanwhile.
    from cluster_pipeline.training.fate import die_with_parent

    die_with_parent()

import argparse
import json
import math
import os
import shutil
import subprocess
import tempfile
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import polars as pl
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from cluster_pipeline.core.modeling import load_model_and_tokenizer
from cluster_pipeline.core.sharding import ShardManifest
from cluster_pipeline.core.tokenization import collate, encode_sample
from cluster_pipeline.training.config import JsonConfig
from cluster_pipeline.training.distributed import (
    all_gather_floats,
    init_distributed,
    reporter,
    shutdown_distributed,
)

SCHEDULES = ("cosine", "linear", "constant")
TRAINING_STATE = "training_state.pt"


@dataclass(frozen=True)
class TrainConfig(JsonConfig):
    """Settings of one fine-tuning run (written as JSON by the asset)."""

    model_path: str
    instructions_uri: str
    instructions_version: int
    manifests: list[str]
    output_dir: str
    max_length: int = 512
    per_device_batch_size: int = 4
    gradient_accumulation_steps: int = 1
    epochs: int = 1
    max_steps: int | None = None
    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    warmup_ratio: float = 0.1
    schedule: str = "cosine"
    max_grad_norm: float = 1.0
    bf16: bool = False
    reweight: bool = True
    seed: int = 0
    save_every_steps: int | None = None
    keep_checkpoints: int = 2
    resume: bool = True
    provenance: dict = field(default_factory=dict)

    def validate(self) -> None:
        """Raises ValueError naming the first bad option."""
        positive = ("max_length", "per_device_batch_size", "gradient_accumulation_steps", "epochs")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"TrainConfig.max_steps must be >= 1 or null, got {self.max_steps}")
        if not self.learning_rate > 0:
            raise ValueError(f"TrainConfig.learning_rate must be > 0, got {self.learning_rate}")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"TrainConfig.warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"TrainConfig.schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.save_every_steps is not None and self.save_every_steps < 1:
            raise ValueError(f"TrainConfig.save_every_steps must be >= 1 or null, got {self.save_every_steps}")
        if self.keep_checkpoints < 1:
            raise ValueError(f"TrainConfig.keep_checkpoints must be >= 1, got {self.keep_checkpoints}")
        if not self.manifests:
            raise ValueError("TrainConfig.manifests is empty: give one shard manifest per rank")



def steps_per_epoch(n_samples: int, batch_size: int, accumulation: int) -> int:
    """Optimizer steps for one pass over ``n_samples``: ceil(n / (batch_size * accumulation))."""
    return math.ceil(n_samples / (batch_size * accumulation))


def lr_lambda(schedule: str, warmup_steps: int, total_steps: int):
    """Multiplier of the peak learning rate at each step: linear warmup, then cosine or linear
    decay to 0 (or constant)."""

    def f(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        if schedule == "linear":
            return max(0.0, 1.0 - progress)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return f


def weighted_loss(model, batch: dict[str, torch.Tensor], weight: float, accumulation: int):
    """Rank loss for one micro-batch: w_c x (mean response-token cross-entropy) / accumulation.

    Returns (scaled loss to backpropagate, unscaled mean token loss, response tokens).
    """
    out = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
        labels=batch["labels"],
        use_cache=False,
    )
    return out.loss * (weight / accumulation), out.loss.detach(), int((batch["labels"] != -100).sum())


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def load_shard_samples(cfg: TrainConfig, manifest: ShardManifest) -> pl.DataFrame:
    """The manifest's samples (system, prompt, response) in manifest order, duplicates kept.

    Raises:
        KeyError: a sample_id of the manifest is missing from the instructions table version.
    """
    table = pl.read_delta(cfg.instructions_uri, version=cfg.instructions_version,
                          columns=["sample_id", "system", "prompt", "response"])
    order = pl.DataFrame({"sample_id": list(manifest.sample_ids)}).with_row_index("position")
    rows = order.join(table, on="sample_id", how="left").sort("position")
    missing = rows.filter(pl.col("prompt").is_null())["sample_id"].to_list()
    if missing:
        raise KeyError(
            f"rank {manifest.rank}: {len(missing)} sample_id(s) of the shard manifest are not in "
            f"{cfg.instructions_uri}@v{cfg.instructions_version}, e.g. {missing[:3]}; "
            "re-materialize shard_manifests from the current raw_instructions."
        )
    return rows


@record
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="TrainConfig JSON file")
    args = parser.parse_args(argv)
    cfg = TrainConfig.load(args.config)
    env = init_distributed()
    # On success, leave the process group cleanly; on an error, exit without tearing it down
    # first, so the peers' errors do not race ahead of this rank's own (see @record).
    with reporter(env) as report:
        train(cfg, env, report)
    shutdown_distributed()


def train(cfg: TrainConfig, env, report) -> None:
    if env.world_size != len(cfg.manifests):
        raise ValueError(
            f"world size {env.world_size} != {len(cfg.manifests)} shard manifests: launch "
            f"torchrun with --nproc_per_node x --nnodes = {len(cfg.manifests)}"
        )
    manifest = ShardManifest.read(Path(cfg.manifests[env.rank]))
    if manifest.rank != env.rank:
        raise ValueError(f"manifest {cfg.manifests[env.rank]} is for rank {manifest.rank}, not {env.rank}")
    weight = manifest.weight if cfg.reweight else 1.0
    per_epoch = steps_per_epoch(manifest.n_samples, cfg.per_device_batch_size,
                                cfg.gradient_accumulation_steps)
    total_steps = per_epoch * cfg.epochs
    if cfg.max_steps is not None:
        total_steps = min(total_steps, cfg.max_steps)
    counts = all_gather_floats([float(manifest.n_samples), float(total_steps)], env)
    if len({c[1] for c in counts}) != 1:
        raise ValueError(
            "ranks would take different numbers of optimizer steps "
            f"(samples, steps per rank: {[(int(a), int(b)) for a, b in counts]}); every shard "
            "manifest must hold the same number of samples"
        )

    torch.manual_seed(cfg.seed + env.rank)
    np.random.seed(cfg.seed + env.rank)
    checkpoints = CheckpointDir(Path(cfg.output_dir + ".checkpoints"))
    manifest_hashes = [ShardManifest.read(Path(p)).sha256 for p in cfg.manifests]
    resume = checkpoints.latest() if cfg.resume else None
    model, tokenizer = load_model_and_tokenizer(
        str(resume) if resume else cfg.model_path, device=str(env.device)
    )
    model.train()
    model.config.use_cache = False
    rows = load_shard_samples(cfg, manifest)
    encoded = [
        encode_sample(tokenizer, s, p, r, cfg.max_length)
        for s, p, r in zip(rows["system"], rows["prompt"], rows["response"])
    ]
    ddp_model = (
        torch.nn.parallel.DistributedDataParallel(model) if dist.is_initialized() else model
    )
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay
    )
    warmup = int(cfg.warmup_ratio * total_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(cfg.schedule, warmup, total_steps)
    )
    step, tokens_seen, elapsed_before, history = 0, 0, 0.0, []
    if resume is not None:
        state = torch.load(resume / TRAINING_STATE, weights_only=False)
        if state["manifest_sha256"] != manifest_hashes:
            raise ValueError(
                f"{resume} was trained on other shard manifests; delete {checkpoints.root} "
                "or set resume: false"
            )
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"][env.rank])
        step, tokens_seen = state["step"], state["tokens"]
        elapsed_before, history = state["elapsed_seconds"], state["history"]
    autocast = torch.autocast(env.device.type, dtype=torch.bfloat16, enabled=cfg.bf16)
    report.info(
        f"training {env.world_size} rank(s) x {manifest.n_samples} samples, {total_steps} steps "
        f"(batch {cfg.per_device_batch_size} x accumulation {cfg.gradient_accumulation_steps}); "
        f"rank weights {[round(w, 4) for w in _gather_weights(weight, env)]}"
        + (f"; resuming from {resume.name}" if resume else "")
    )

    metrics_path = Path(cfg.output_dir + ".metrics.jsonl")
    metrics_file = None
    if env.is_main:
        metrics_file = metrics_path.open("w")
        metrics_file.writelines(json.dumps(r) + "\n" for r in history)
    plan = step_plan(len(encoded), cfg, total_steps)
    start = time.time() - elapsed_before
    while step < total_steps:
        t0 = time.time()
        epoch, group = plan[step]
        losses, tokens = [], 0
        for j, idx in enumerate(group):
            batch = collate([encoded[i] for i in idx], tokenizer.pad_token_id, "right")
            batch = {k: v.to(env.device) for k, v in batch.items()}
            sync = j == len(group) - 1
            ctx = ddp_model.no_sync() if (dist.is_initialized() and not sync) else nullcontext()
            with ctx, autocast:
                loss, raw, n_tok = weighted_loss(ddp_model, batch, weight, len(group))
                loss.backward()
            losses.append(float(raw))
            tokens += n_tok
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        gathered = all_gather_floats([float(np.mean(losses)), float(tokens), time.time() - t0], env)
        tokens_seen += int(sum(g[1] for g in gathered))
        record = {
            "step": step,
            "epoch": epoch,
            "lr": scheduler.get_last_lr()[0],
            "loss_per_rank": [g[0] for g in gathered],
            "loss": float(np.mean([g[0] for g in gathered])),
            "grad_norm": grad_norm,
            "tokens": int(sum(g[1] for g in gathered)),
            "step_seconds": max(g[2] for g in gathered),
            "elapsed_seconds": time.time() - start,
        }
        history.append(record)
        if metrics_file is not None:
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
        report.info(
            f"step {step}/{total_steps} loss {record['loss']:.4f} "
            f"(ranks {[round(x, 4) for x in record['loss_per_rank']]}) "
            f"{record['tokens'] / max(record['step_seconds'], 1e-9):.0f} response tokens/s"
        )
        if cfg.save_every_steps and step % cfg.save_every_steps == 0 and step < total_steps:
            rng = _gather_objects(torch.get_rng_state(), env)
            if env.is_main:
                state = {
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "rng": rng,
                    "step": step,
                    "tokens": tokens_seen,
                    "elapsed_seconds": time.time() - start,
                    "history": history,
                    "manifest_sha256": manifest_hashes,
                }
                path = checkpoints.save(model, tokenizer, step, state, cfg.keep_checkpoints)
                report.info(f"saved {path}")
            if dist.is_initialized():
                dist.barrier()
    train_seconds = time.time() - start
    if metrics_file is not None:
        metrics_file.close()

    if env.is_main:
        info = {
            "base_model": cfg.model_path,
            "manifests": [
                {"rank": r, "path": p, "sha256": h}
                for r, (p, h) in enumerate(zip(cfg.manifests, manifest_hashes))
            ],
            "config": asdict(cfg),
            "git_commit": _git_commit(),
            "world_size": env.world_size,
            "steps": step,
            "resumed_from_step": int(resume.name.split("_")[-1]) if resume else None,
            "train_seconds": train_seconds,
            "tokens": tokens_seen,
            "final_loss": history[-1]["loss"] if history else float("nan"),
        }
        save_checkpoint(model, tokenizer, Path(cfg.output_dir), info)
        report.materialization(
            {
                "checkpoint_path": cfg.output_dir,
                "steps": step,
                "train_seconds": round(train_seconds, 2),
                "tokens_per_second": round(tokens_seen / max(train_seconds, 1e-9), 1),
                "final_loss": info["final_loss"],
                "manifest_sha256": manifest_hashes,
                "metrics_path": str(metrics_path),
            }
        )
    if dist.is_initialized():
        dist.barrier()


def step_plan(n_samples: int, cfg: TrainConfig, total_steps: int) -> list[tuple[int, list[np.ndarray]]]:
    """(epoch, micro-batches of sample positions) for every optimizer step, fixed in advance so
    that a resumed run sees exactly the batches the interrupted one would have. Epoch 0 follows
    the manifest's seeded order; later epochs reshuffle it with seed + epoch."""
    per_epoch = steps_per_epoch(n_samples, cfg.per_device_batch_size, cfg.gradient_accumulation_steps)
    plan = []
    for epoch in range(cfg.epochs):
        order = np.arange(n_samples)
        if epoch:
            order = np.random.default_rng(cfg.seed + epoch).permutation(n_samples)
        micro = [order[i : i + cfg.per_device_batch_size]
                 for i in range(0, n_samples, cfg.per_device_batch_size)]
        acc = cfg.gradient_accumulation_steps
        plan += [(epoch, micro[s * acc : (s + 1) * acc]) for s in range(per_epoch)]
    return plan[:total_steps]


def _gather_objects(obj, env) -> list:
    if env.world_size == 1 or not dist.is_initialized():
        return [obj]
    out = [None] * env.world_size
    dist.all_gather_object(out, obj)
    return out


def _gather_weights(weight: float, env) -> list[float]:
    return [g[0] for g in all_gather_floats([weight], env)]


class CheckpointDir:
    """Intermediate checkpoints ``step_<n>/`` under ``root``: each a save_pretrained folder plus
    ``training_state.pt`` (optimizer, scheduler, step, every rank's RNG state, loss history).
    A folder exists only once complete (see :func:`save_checkpoint`)."""

    def __init__(self, root: Path):
        self.root = root

    def all(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        done = [p for p in self.root.glob("step_*") if (p / TRAINING_STATE).exists()]
        return sorted(done, key=lambda p: int(p.name.split("_")[-1]))

    def latest(self) -> Path | None:
        found = self.all()
        return found[-1] if found else None

    def save(self, model, tokenizer, step: int, state: dict, keep: int) -> Path:
        path = self.root / f"step_{step:07d}"
        save_checkpoint(model, tokenizer, path, {"step": step}, extra={TRAINING_STATE: state})
        for old in self.all()[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        return path


def save_checkpoint(model, tokenizer, out_dir: Path, info: dict, extra: dict | None = None) -> None:
    """``save_pretrained`` (safetensors) + tokenizer + ``training_info.json`` (+ ``extra`` objects
    saved with ``torch.save``) into ``out_dir``, atomically: written to a temporary sibling
    folder, then renamed over ``out_dir``, so a killed save leaves no half checkpoint."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "training_info.json").write_text(json.dumps(info, indent=1, default=str))
        for name, obj in (extra or {}).items():
            torch.save(obj, tmp / name)
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old{os.getpid()}")
            os.replace(out_dir, old)
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


if __name__ == "__main__":
    main()

"""Data-parallel fine-tuning, split as torchtune's recipes are (docs/design.md, steps 4-5):
:func:`setup` (model, data, optimizer, scheduler, resume), :func:`train_step` (one optimizer
step), :func:`save_intermediate` (resumable state) and :func:`finalize` (the checkpoint and its
``training_info.json``), run by :func:`train`. The ``python -m`` entry point is
:mod:`cluster_pipeline.recipes.train`.

Rank c reads ``manifests[c]`` and multiplies its loss by the manifest's weight w_c. DDP averages
gradients over the K ranks, so each update follows (1/K) sum_c w_c g_c, the stratified estimate
of the full-data gradient. Every rank takes the same number of optimizer steps (the step plan,
:mod:`cluster_pipeline.training.plan`). Rank 0 alone logs (through Dagster Pipes when launched
by the ``trained_checkpoint`` asset), writes the per-step metrics and saves.
"""

import json
import math
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import torch
import torch.distributed as dist

from cluster_pipeline.data.attention import use_packed_attention
from cluster_pipeline.data.datasets import TRAINING_COLUMNS, read_instructions
from cluster_pipeline.data.packing import PackCheck, pack_check
from cluster_pipeline.data.tokenization import EncodedSample, encode_rows
from cluster_pipeline.models.loading import (
    empty_model,
    load_model_and_tokenizer,
    load_tokenizer,
    safetensors_files,
)
from cluster_pipeline.selection.sharding import ShardManifest
from cluster_pipeline.storage.disk import naming_full_disk
from cluster_pipeline.tracking.tracker import MetricsSender, Tracker, step_metrics
from cluster_pipeline.training.checkpointing import (
    SHARDED_DIR,
    TRAINING_STATE,
    CheckpointDir,
    adapter_config,
    export_model,
    full_state_dict,
    intermediate_dir,
    killed_seconds,
    load_adapter,
    load_into_shards,
    load_sharded,
    metrics_path,
    read_metrics,
    save_adapter,
    save_checkpoint,
    save_sharded,
)
from cluster_pipeline.training.config import TrainJob, TrainSettings
from cluster_pipeline.training.distributed import (
    DistEnv,
    Reporter,
    all_gather_floats,
    step_eta,
)
from cluster_pipeline.training.gradients import cosine_matrix, count_sketch, mean_offdiagonal
from cluster_pipeline.training.kernels import (
    CausalLMLoss,
    adamw_options,
    apply_liger_kernels,
    compile_layers,
    loss_kernel,
)
from cluster_pipeline.training.memory import (
    MemoryTrace,
    limit_heap_fragmentation,
    peak_memory_bytes,
)
from cluster_pipeline.training.mfu import mfu_record
from cluster_pipeline.training.parallel import apply_lora, gradient_sync, is_fsdp, total_norm, wrap
from cluster_pipeline.training.plan import (
    Step,
    packing_notes,
    plan_packed,
    plan_padded,
    useful_compute_fraction,
)
from cluster_pipeline.training.step import accumulate, clock


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


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def load_shard_samples(job: TrainJob, manifest: ShardManifest) -> pl.DataFrame:
    """The manifest's samples (system, prompt, response, messages) in manifest order,
    duplicates kept.

    Raises:
        KeyError: a sample_id of the manifest is missing from the instructions table version.
    """
    table = read_instructions(
        job.instructions_uri,
        job.instructions_version,
        TRAINING_COLUMNS,
    )
    order = pl.DataFrame({"sample_id": list(manifest.sample_ids)}).with_row_index("position")
    rows = order.join(table, on="sample_id", how="left").sort("position")
    missing = rows.filter(pl.col("prompt").is_null())["sample_id"].to_list()
    if missing:
        raise KeyError(
            f"rank {manifest.rank}: {len(missing)} sample_id(s) of the shard manifest are not in "
            f"{job.instructions_uri}@v{job.instructions_version}, e.g. {missing[:3]}; "
            "re-materialize shard_manifests from the current raw_instructions."
        )
    return rows


@dataclass
class TrainRun:
    """Everything one rank holds during training; ``step``..``history`` change as it goes.
    ``model`` is the causal LM (what is saved), ``parallel_model`` the module each micro-batch
    calls: its :class:`~cluster_pipeline.training.kernels.CausalLMLoss`, inside DDP or sharded
    by FSDP2 when distributed. ``kernels`` names what the step runs on (attention, loss,
    optimizer, compiled layers); ``warnings`` what the run's metadata says went otherwise than
    asked (a model the packing gate refused, Liger-Kernel's kernels not applied)."""

    job: TrainJob
    env: DistEnv
    model: torch.nn.Module
    parallel_model: torch.nn.Module
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    encoded: list[EncodedSample]
    weight: float
    plan: list[Step]
    packed: bool
    plan_notes: list[str]
    manifest_hashes: list[str]
    resumed_from: Path | None
    memory: MemoryTrace
    kernels: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    step: int = 0
    tokens_seen: int = 0
    start: float = 0.0
    history: list[dict[str, Any]] = field(default_factory=list)
    # Seconds interrupted runs spent on steps this one trains again (in ``start`` already).
    killed_seconds: float = 0.0

    @property
    def total_steps(self) -> int:
        """Optimizer steps of the whole run."""
        return len(self.plan)

    @property
    def settings(self) -> TrainSettings:
        """The run's training settings."""
        return self.job.settings


def plan_steps(
    encoded: list[EncodedSample], cfg: TrainSettings, packed: bool, env: DistEnv
) -> tuple[list[Step], list[str]]:
    """This rank's step plan (training/plan.py), computed from every rank's sample lengths
    (gathered: a collective) so that every rank plans the same steps and micro-batch counts,
    and the packed plan's notes for the log (:func:`~cluster_pipeline.training.plan.
    packing_notes`; none for a padded plan).

    Raises:
        ValueError: the ranks' plans differ in length (a bug: they are computed alike).
    """
    lengths = _gather_objects([len(e) for e in encoded], env)
    notes: list[str] = []
    if packed:
        notes = packing_notes(lengths, cfg.max_tokens_per_micro_batch, cfg.max_packed_length)
        plans = plan_packed(
            lengths,
            cfg.max_tokens_per_micro_batch,
            cfg.max_packed_length,
            cfg.gradient_accumulation_steps,
            cfg.epochs,
            cfg.seed,
            cfg.max_steps,
        )
    else:
        plans = plan_padded(
            [len(x) for x in lengths],
            cfg.per_device_batch_size,
            cfg.gradient_accumulation_steps,
            cfg.epochs,
            cfg.seed,
            cfg.max_steps,
        )
    if len({len(p) for p in plans}) != 1:
        raise ValueError(f"the ranks' plans differ in length: {[len(p) for p in plans]}")
    return plans[env.rank], notes


def packing_works(
    model, vocab_size: int, cfg: TrainSettings, env: DistEnv
) -> tuple[bool, PackCheck | None]:
    """Whether this run packs: ``packing`` on and the model keeps packed samples apart on every
    rank (:func:`~cluster_pipeline.data.packing.pack_check`; a collective forward under FSDP),
    with this rank's check (None when ``packing`` is off)."""
    if not cfg.packing:
        return False, None
    check = pack_check(model, vocab_size=vocab_size)
    if is_fsdp(model):
        # A forward without backward leaves FSDP2's root parameters unsharded (the root keeps
        # them for the backward that never comes): shard them again before the optimizer
        # takes the parameters, or it would hold the full tensors of embeddings and head.
        for module in model.modules():
            if is_fsdp(module):
                module.reshard()
    return all(bool(g[0]) for g in all_gather_floats([float(check.ok)], env)), check


def step_kernels(
    model, cfg: TrainSettings, device: torch.device
) -> tuple[CausalLMLoss, dict[str, str], list[str]]:
    """The kernels a step runs on, chosen once before wrapping (data/attention.py,
    training/kernels.py): variable-length attention for packed rows where the device has it,
    the loss without whole-vocabulary logits (``fused_loss``; Liger-Kernel's, with its RMSNorm,
    RoPE and SwiGLU, on CUDA where installed), compiled decoder layers (``compile``).

    Returns:
        (the module each micro-batch calls, {"attention", "loss", "compiled_layers"} names for
        the log and ``training_info.json``, warnings for the run's metadata).
    """
    warnings: list[str] = []
    kernels = {"attention": use_packed_attention(model, device.type)}
    loss = loss_kernel(device.type, cfg.fused_loss)
    if loss == "liger":
        why = apply_liger_kernels(model)
        if why is not None:
            warnings.append(why)
    loss_module = CausalLMLoss(model, loss)
    kernels["loss"] = loss_module.kernel
    if cfg.fused_loss and loss_module.kernel == "logits":
        warnings.append(
            f"fused_loss is on but {type(model).__name__}'s head is not a plain linear map "
            "(training/kernels.fusable): the loss runs on the model's logits"
        )
    kernels["compiled_layers"] = str(compile_layers(model) if cfg.compile else 0)
    return loss_module, kernels, warnings


def setup(job: TrainJob, env: DistEnv) -> TrainRun:
    """Read this rank's manifest and samples, check the step counts, build model, DDP wrapper,
    optimizer and scheduler, and restore the latest intermediate checkpoint if resuming.

    Raises:
        ValueError: world size != number of manifests, a manifest for another rank, unequal
            step counts, or a resume checkpoint trained on other manifests.
    """
    cfg = job.settings
    if cfg.parallelism == "fsdp":
        # FSDP is chosen to fit memory: a fixed mmap threshold keeps freed step buffers from
        # staying resident (peak 3.2 -> 2.0 GiB per rank at 135M) but made CPU steps about 40 %
        # slower (2.3 -> 3.3 s per step, benchmarks/RESULTS.md), so DDP keeps glibc's default.
        limit_heap_fragmentation()
    memory = MemoryTrace()
    memory.mark("start")
    if env.world_size != len(job.manifests):
        raise ValueError(
            f"world size {env.world_size} != {len(job.manifests)} shard manifests: launch "
            f"torchrun with --nproc_per_node x --nnodes = {len(job.manifests)}"
        )
    manifest = ShardManifest.read(Path(job.manifests[env.rank]))
    if manifest.rank != env.rank:
        raise ValueError(
            f"manifest {job.manifests[env.rank]} is for rank {manifest.rank}, not {env.rank}"
        )
    torch.manual_seed(cfg.seed + env.rank)
    np.random.seed(cfg.seed + env.rank)
    checkpoints = CheckpointDir(intermediate_dir(job.output_dir))
    manifest_hashes = [ShardManifest.read(Path(p)).sha256 for p in job.manifests]
    resume = checkpoints.latest() if cfg.resume else None
    # DDP resumes from the full weights saved with the state; FSDP from its sharded files and
    # LoRA from the adapter, both over the base model.
    full_resume = resume is not None and cfg.parallelism == "ddp" and not cfg.lora_r
    # FSDP2 without adapters builds the model empty, shards it, then reads each rank's rows
    # (load_into_shards): no rank holds the full weights. LoRA and DDP load them whole.
    files = safetensors_files(job.model_path) if cfg.parallelism == "fsdp" else None
    shard_load = files is not None and not cfg.lora_r and dist.is_initialized()
    if shard_load:
        model, tokenizer = empty_model(job.model_path), load_tokenizer(job.model_path)
    else:
        model, tokenizer = load_model_and_tokenizer(
            str(resume) if full_resume else job.model_path, device=str(env.device)
        )
    memory.mark("model built" if shard_load else "model loaded")
    model.train()
    # No ``model.config.use_cache = False`` here: every training forward passes
    # use_cache=False itself (training/step.py), and the config is saved with the checkpoint,
    # whose generate() would otherwise recompute the whole sequence at every new token.
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.lora_r:
        model = apply_lora(model, cfg)
        torch.manual_seed(cfg.seed + env.rank)
        if resume is not None and cfg.parallelism == "ddp":
            load_adapter(model, resume)
    rows = load_shard_samples(job, manifest)
    encoded = encode_rows(tokenizer, rows, cfg)
    loss_module, kernels, warnings = step_kernels(model, cfg, env.device)
    parallel_model = wrap(loss_module, cfg, env.device)
    memory.mark("wrapped")
    if shard_load and files is not None:
        load_into_shards(model, files, env.device)
        memory.mark("shards loaded")
    packed, check = packing_works(parallel_model, len(tokenizer), cfg, env)
    if check is not None and not packed:
        warnings.append(
            (
                check.reason(type(model).__name__)
                if not check.ok
                else "another rank's model failed the packing gate"
            )
            + " (data/packing.pack_check): training with padded batches of "
            "per_device_batch_size"
        )
    plan, plan_notes = plan_steps(encoded, cfg, packed, env)
    steps = len(plan)
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=cfg.learning_rate,
        weight_decay=cfg.weight_decay,
        **adamw_options(env.device),
    )
    kernels["optimizer"] = "AdamW (fused)" if adamw_options(env.device) else "AdamW (for-each)"
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(cfg.schedule, int(cfg.warmup_ratio * steps), steps)
    )
    run = TrainRun(
        job=job,
        env=env,
        model=model,
        parallel_model=parallel_model,
        tokenizer=tokenizer,
        optimizer=optimizer,
        scheduler=scheduler,
        encoded=encoded,
        weight=manifest.weight if cfg.reweight else 1.0,
        plan=plan,
        packed=packed,
        plan_notes=plan_notes,
        manifest_hashes=manifest_hashes,
        resumed_from=resume,
        memory=memory,
        kernels=kernels,
        warnings=warnings,
    )
    elapsed_before = 0.0
    if resume is not None:
        state = torch.load(resume / TRAINING_STATE, weights_only=False)
        if state["manifest_sha256"] != manifest_hashes:
            raise ValueError(
                f"{resume} was trained on other shard manifests; set resume: false to train "
                f"from the start, or move {checkpoints.root} aside to keep it"
            )
        if is_fsdp(parallel_model):
            load_sharded(parallel_model, optimizer, resume / SHARDED_DIR)
        else:
            optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"][env.rank])
        run.step, run.tokens_seen = state["step"], state["tokens"]
        elapsed_before, run.history = state["elapsed_seconds"], state["history"]
        # What the killed run trained past its checkpoint counts too (its metrics file, before
        # this run rewrites it): train_seconds is what training cost, interruptions included.
        run.killed_seconds = killed_seconds(
            read_metrics(job.output_dir), run.step, float(elapsed_before)
        )
        elapsed_before += run.killed_seconds
    run.start = time.time() - elapsed_before
    memory.mark("set up")
    return run


def measure_grad_cosine(run: TrainRun) -> tuple[float, float]:
    """Mean inter-rank cosine of the ranks' local gradients, then the DDP average.

    Called after a step's backward passes ran without DDP synchronisation, so ``.grad`` holds
    this rank's local (weighted) gradient: each rank projects it with the same CountSketch
    (:mod:`cluster_pipeline.training.gradients`), the sketches are gathered, and the gradients are
    then averaged over ranks exactly as DDP would have (sum, divided by the world size).
    Collective: every rank must call it. Returns (mean cosine, seconds spent)."""
    t0 = time.time()
    params = [p for p in run.model.parameters() if p.grad is not None]
    sketch = count_sketch(
        (p.grad for p in params if p.grad is not None),
        run.settings.grad_sketch_dim,
        seed=run.settings.seed,
    )
    sketches = torch.tensor(_gather_objects(sketch.tolist(), run.env), dtype=torch.float64)
    works = [dist.all_reduce(p.grad, async_op=True) for p in params if p.grad is not None]
    for work in works:
        if work is not None:
            work.wait()
    for p in params:
        if p.grad is not None:
            p.grad.div_(run.env.world_size)
    return mean_offdiagonal(cosine_matrix(sketches)), time.time() - t0


def train_step(run: TrainRun) -> dict[str, Any]:
    """One optimizer step over this step's micro-batches (:func:`~cluster_pipeline.training.
    step.accumulate`: gradients synchronised on the last one only; on a gradient-cosine step,
    by :func:`measure_grad_cosine` after all of them); returns its metrics record, gathered
    over ranks."""
    env, cfg = run.env, run.settings
    t0 = clock(env.device)
    step = run.plan[run.step]
    ddp = run.parallel_model
    is_ddp = isinstance(ddp, torch.nn.parallel.DistributedDataParallel)
    every = cfg.grad_cosine_every
    measure = is_ddp and every is not None and (run.step + 1) % every == 0
    done = accumulate(
        ddp,
        step,
        run.encoded,
        int(run.tokenizer.pad_token_id),
        run.packed,
        run.weight,
        env.device,
        lambda last: gradient_sync(ddp, enabled=last and not measure),
        bf16=cfg.bf16,
    )
    loss_sum, tokens, real, padded, wait = (
        done.loss_sum,
        done.targets,
        done.real_tokens,
        done.padded_tokens,
        done.wait_seconds,
    )
    cosine = measure_grad_cosine(run) if measure else None
    grad_norm = total_norm(
        torch.nn.utils.clip_grad_norm_(
            [p for p in run.model.parameters() if p.requires_grad], cfg.max_grad_norm
        )
    )
    # The rate this optimizer step uses (the scheduler's next value applies to the next step).
    lr = float(run.optimizer.param_groups[0]["lr"])
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.step += 1
    if run.step == 1:  # the optimizer's state exists from its first step on
        run.memory.mark("step 1")
    seconds = clock(env.device) - t0
    gathered = all_gather_floats(
        [
            loss_sum / max(tokens, 1),
            float(tokens),
            seconds,
            float(real),
            float(padded),
            wait,
            float(len(step.samples)),
        ],
        env,
    )
    run.tokens_seen += int(sum(g[1] for g in gathered))
    entry = {
        "step": run.step,
        "epoch": step.epoch,
        "lr": lr,
        "loss_per_rank": [g[0] for g in gathered],
        "loss": float(np.mean([g[0] for g in gathered])),
        "grad_norm": grad_norm,
        "tokens": int(sum(g[1] for g in gathered)),
        "step_seconds": max(g[2] for g in gathered),
        "elapsed_seconds": time.time() - run.start,
        "samples_per_rank": [int(g[6]) for g in gathered],
        "real_tokens_per_rank": [int(g[3]) for g in gathered],
        "padded_tokens_per_rank": [int(g[4]) for g in gathered],
        "compute_seconds_per_rank": [round(g[2] - g[5], 4) for g in gathered],
        "wait_seconds_per_rank": [round(g[5], 4) for g in gathered],
        "useful_compute_fraction": useful_compute_fraction(
            [g[3] for g in gathered], [g[4] for g in gathered]
        ),
    }
    if cosine is not None:
        entry["grad_cosine"], entry["grad_cosine_seconds"] = cosine
    run.history.append(entry)
    return entry


def save_intermediate(run: TrainRun, report: Reporter) -> None:
    """A resumable checkpoint (weights, optimizer, scheduler, every rank's RNG, history) under
    ``<output_dir>.checkpoints/step_<n>/``; collective: every rank must call it."""
    rng = _gather_objects(torch.get_rng_state(), run.env)
    checkpoints = CheckpointDir(intermediate_dir(run.job.output_dir))
    sharded = is_fsdp(run.parallel_model)
    if sharded:  # every rank writes its shard of the model and optimizer state
        save_sharded(
            run.parallel_model, run.optimizer, checkpoints.step_dir(run.step) / SHARDED_DIR
        )
    if run.env.is_main:
        state = {
            **({} if sharded else {"optimizer": run.optimizer.state_dict()}),
            "scheduler": run.scheduler.state_dict(),
            "rng": rng,
            "step": run.step,
            "tokens": run.tokens_seen,
            "elapsed_seconds": time.time() - run.start,
            "history": run.history,
            "manifest_sha256": run.manifest_hashes,
        }
        path = checkpoints.save(
            None if sharded else run.model,
            run.tokenizer,
            run.step,
            state,
            run.settings.keep_checkpoints,
        )
        report.info(f"saved {path}")
    if dist.is_initialized():
        dist.barrier()


def finalize(run: TrainRun, train_seconds: float, report: Reporter) -> None:
    """Rank 0 saves the checkpoint with its ``training_info.json`` and reports it to Dagster;
    every rank then waits for it."""
    job = run.job
    report.doing(f"saving the checkpoint to {job.output_dir}", say=False)
    plain = not is_fsdp(run.parallel_model) and not run.settings.lora_r
    # Sharded or adapter-wrapped models are gathered (collective) into a plain model to save.
    run.memory.mark("trained")
    if not plain:  # AdamW's moments are done with: free them before gathering the weights
        run.optimizer.state.clear()
    state = None if plain else gathered_state(run)
    run.memory.mark("gathered for export")
    memory = _gather_objects(run.memory.marks, run.env)
    # Peak resident and CUDA memory of each rank so far (bytes).
    peaks = all_gather_floats([float(b) for b in peak_memory_bytes()], run.env)
    peak_rss, peak_cuda = [int(g[0]) for g in peaks], [int(g[1]) for g in peaks]
    # The loss multipliers the ranks applied (w_c, or 1 with reweight: false), in rank order.
    rank_weights = _gather_weights(run.weight, run.env)
    if run.env.is_main:
        info = {
            "base_model": job.model_path,
            "rank_weights": rank_weights,
            "manifests": [
                {"rank": r, "path": p, "sha256": h}
                for r, (p, h) in enumerate(zip(job.manifests, run.manifest_hashes, strict=True))
            ],
            "config": job.model_dump(mode="json"),
            "git_commit": _git_commit(),
            "world_size": run.env.world_size,
            "steps": run.step,
            "resumed_from_step": (
                int(run.resumed_from.name.split("_")[-1]) if run.resumed_from else None
            ),
            "train_seconds": train_seconds,
            "killed_seconds": round(run.killed_seconds, 3),
            "tokens": run.tokens_seen,
            "final_loss": run.history[-1]["loss"] if run.history else float("nan"),
            "packed": run.packed,
            "kernels": run.kernels,
            "warnings": run.warnings,
            **compute_summary(run.history),
            "peak_rss_bytes_per_rank": peak_rss,
            "peak_cuda_bytes_per_rank": peak_cuda,
            "memory_per_rank": memory,
        }
        if run.env.device.type == "cuda":
            info["mfu"] = run_mfu(run, info.get("real_tokens", 0))
        if state is None:
            save_checkpoint(run.model, run.tokenizer, Path(job.output_dir), info)
        else:
            info["adapter"] = adapter_config(run.model)
            save_checkpoint(
                export_model(run.model, state),
                run.tokenizer,
                Path(job.output_dir),
                info,
                also=lambda folder: save_adapter(run.model, state, folder),
            )
        report.materialization(
            {
                "checkpoint_path": job.output_dir,
                "steps": run.step,
                "train_seconds": round(train_seconds, 2),
                "tokens_per_second": round(run.tokens_seen / max(train_seconds, 1e-9), 1),
                "final_loss": info["final_loss"],
                "peak_rss_mib_per_rank": [round(b / 2**20, 1) for b in peak_rss],
                "manifest_sha256": run.manifest_hashes,
                "metrics_path": str(metrics_path(job.output_dir)),
                "packed": run.packed,
                # Pipes takes raw values (no nested dicts): one line of what the step ran on.
                "step_kernels": ", ".join(f"{k}: {v}" for k, v in run.kernels.items()),
                # What went otherwise than the settings asked (the packing gate's refusal,
                # with its figures): shown on the asset, not only in the run's log.
                **({"warnings": run.warnings} if run.warnings else {}),
                **(
                    {"mfu": info["mfu"]["value"]}
                    if info.get("mfu", {}).get("value") is not None
                    else {}
                ),
            }
        )
    if dist.is_initialized():
        dist.barrier()


def train(job: TrainJob, env: DistEnv, report: Reporter) -> None:
    """The whole run on this rank: setup, the optimizer steps (metrics to
    ``<output_dir>.metrics.jsonl`` and, on rank 0, to the job's MLflow run; intermediate saves
    every ``save_every_steps``), finalize."""
    # Rank 0 alone talks to MLflow, into the run the asset opened, from a thread of its own
    # (started before the model loads: importing MLflow takes seconds).
    sender = None
    if env.is_main and job.tracking is not None:
        tracker = Tracker.for_target(job.tracking)
        sender = MetricsSender(tracker, job.tracking.run_id, report.warning)
    report.doing("loading the model and this rank's shard", say=False)
    run = setup(job, env)
    cfg = run.settings
    # Two lines, each short enough to read whole in the run's log (issue 44).
    report.info(
        f"training {env.world_size} rank(s), samples per rank "
        f"{[int(g[0]) for g in all_gather_floats([float(len(run.encoded))], env)]}, "
        f"{run.total_steps} step{'' if run.total_steps == 1 else 's'}; rank weights "
        f"{[round(w, 4) for w in _gather_weights(run.weight, env)]}"
        + (f"; resuming from {run.resumed_from.name}" if run.resumed_from else "")
    )
    report.info(
        f"packed: micro-batches of up to {cfg.max_tokens_per_micro_batch} tokens in rows of "
        f"up to {min(cfg.max_packed_length, cfg.max_tokens_per_micro_batch)}, "
        f"{max((len(s.micro_batches) for s in run.plan), default=0)} at most a step (steps "
        f"sized for {cfg.gradient_accumulation_steps})"
        if run.packed
        else f"padded: batch {cfg.per_device_batch_size} x accumulation "
        f"{cfg.gradient_accumulation_steps}"
    )
    if env.is_main:
        for note in run.plan_notes:
            report.warning(note)
    report.info(f"step kernels: {run.kernels}")
    for warning in run.warnings:
        report.warning(warning)
    metrics_file = None
    if env.is_main:
        metrics_file = metrics_path(job.output_dir).open("w")
        metrics_file.writelines(json.dumps(r) + "\n" for r in run.history)
    if sender is not None:
        for entry in run.history:  # resumed: the steps before the resume, into this run too
            sender.log(step_metrics(entry), entry["step"])
    # The ETA counts the steps of this process only (a resumed run's earlier steps took their
    # time elsewhere).
    loop_start, first_step = time.monotonic(), run.step
    try:
        while run.step < run.total_steps:
            report.doing(f"training step {run.step + 1}/{run.total_steps}", say=False)
            entry = train_step(run)
            if metrics_file is not None:
                path = metrics_path(job.output_dir)
                with naming_full_disk(path.parent, None, f"append step {run.step} to {path}"):
                    metrics_file.write(json.dumps(entry) + "\n")
                    metrics_file.flush()
            if sender is not None:
                sender.log(step_metrics(entry), run.step)
            report.info(
                f"step {run.step}/{run.total_steps} loss {entry['loss']:.4f} "
                f"(ranks {[round(x, 4) for x in entry['loss_per_rank']]}) "
                f"{entry['tokens'] / max(entry['step_seconds'], 1e-9):.0f} response tokens/s, "
                f"useful compute {entry['useful_compute_fraction']:.3f}"
                + step_eta(
                    run.step - first_step, run.total_steps - run.step, time.monotonic() - loop_start
                )
                + (
                    f"; inter-rank gradient cosine {entry['grad_cosine']:.4f} (measured in "
                    f"{entry['grad_cosine_seconds']:.2f} s)"
                    if "grad_cosine" in entry
                    else ""
                )
            )
            every = cfg.save_every_steps
            last = run.step == run.total_steps
            if every and run.step % every == 0 and (not last or cfg.save_final_state):
                save_intermediate(run, report)
    finally:
        if metrics_file is not None:
            metrics_file.close()
        train_seconds = time.time() - run.start
        # Also when a step failed: the steps before it are in the run.
        if sender is not None and not sender.close():
            report.info("not every step's metrics reached MLflow (see the warning above)")
    finalize(run, train_seconds, report)


def gathered_state(run: TrainRun) -> dict[str, Any]:
    """The model's whole state on CPU, keyed as ``run.model``'s own state dict (collective under
    FSDP2). Under FSDP2 the root is the loss module around the model (training/kernels.py), so
    the state is gathered through it and its ``model.`` prefix taken off."""
    if not is_fsdp(run.parallel_model):
        return full_state_dict(run.model)
    state = full_state_dict(run.parallel_model)
    return {k.removeprefix("model."): v for k, v in state.items()}


def run_mfu(run: TrainRun, real_tokens: int) -> dict[str, Any]:
    """The run's model FLOPs utilisation record (training/mfu.py): parameters of the model,
    real tokens over every rank, the steps' seconds (the slowest rank's, summed), the device's
    name and peak."""
    parameters = sum(p.numel() for p in run.model.parameters())
    seconds = sum(h["step_seconds"] for h in run.history)
    return mfu_record(
        parameters,
        real_tokens,
        seconds,
        torch.cuda.get_device_name(run.env.device),
        run.env.world_size,
        lora=bool(run.settings.lora_r),
    )


def _gather_objects(obj, env: DistEnv) -> list:
    if env.world_size == 1 or not dist.is_initialized():
        return [obj]
    out = [None] * env.world_size
    dist.all_gather_object(out, obj)
    return out


def compute_summary(history: list[dict[str, Any]]) -> dict[str, Any]:
    """Where a run's compute went, from its per-step records: real and padded tokens and the
    seconds each rank computed and waited, summed over steps, and the run's useful-compute
    fraction Σ_steps Σ_r real / Σ_steps (world size x max_r padded) (training/plan.py)."""
    rows = [h for h in history if "real_tokens_per_rank" in h]
    if not rows:
        return {}
    world = len(rows[0]["real_tokens_per_rank"])
    real = sum(sum(h["real_tokens_per_rank"]) for h in rows)
    paid = sum(world * max(h["padded_tokens_per_rank"]) for h in rows)
    return {
        "useful_compute_fraction": round(real / paid, 4) if paid else 0.0,
        "real_tokens": int(real),
        "padded_tokens": int(sum(sum(h["padded_tokens_per_rank"]) for h in rows)),
        "compute_seconds_per_rank": [
            round(sum(h["compute_seconds_per_rank"][r] for h in rows), 2) for r in range(world)
        ],
        "wait_seconds_per_rank": [
            round(sum(h["wait_seconds_per_rank"][r] for h in rows), 2) for r in range(world)
        ],
    }


def _gather_weights(weight: float, env: DistEnv) -> list[float]:
    return [g[0] for g in all_gather_floats([weight], env)]

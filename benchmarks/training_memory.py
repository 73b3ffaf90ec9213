"""Peak memory per rank, DDP against FSDP2, and a model that DDP cannot hold on this machine.

    python benchmarks/training_memory.py [--steps 3] [--max-length 128] [--skip-1b]

1. SmolLM2-135M-Instruct (the built-in model), 2 ranks under torchrun on the CPU, the same
   --steps optimizer steps on the same 2 x 8 python_stdlib samples with parallelism ddp, then
   fsdp: each rank's peak resident memory (``ru_maxrss``, recorded in ``training_info.json``)
   and the ratio FSDP / DDP (target <= 0.65). Beside each: the pre-launch estimate
   (``training_estimate``, part by part) and every rank's RSS and peak RSS at
   the points the training loop marks (model loaded, wrapped, shards loaded, step 1, trained,
   gathered for export).
2. A randomly initialised Llama of about 0.9B parameters (SmolLM2's tokenizer, 18 layers of width
   2,048): the pre-launch estimate refuses DDP on this machine (16 bytes per parameter per rank
   plus activations), then FSDP2 at 2 ranks trains --steps steps; its peak memory per rank and
   seconds per step are printed. No CPU offload is used.

Takes about 5 minutes on an idle 2-core, 24 GiB machine (1 for part 1); part 2 needs about
20 GiB free.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from arguments import positive_int

from cluster_pipeline.launch.torchrun import RECIPES, torchrun_command

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30


def train(work: Path, name: str, model_path: str, table, manifests, settings) -> dict:
    """Run one torchrun training job at 2 ranks; returns training_info.json plus wall seconds."""
    from cluster_pipeline.training.config import TrainJob

    out = work / f"ckpt_{name}"
    TrainJob(
        settings=settings,
        model_path=model_path,
        instructions_uri=table.uri,
        instructions_version=table.version,
        manifests=manifests,
        output_dir=str(out),
    ).dump(work / f"{name}.json")
    command = torchrun_command(RECIPES["train"], 2, ["--config", str(work / f"{name}.json")])
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        # Both ranks write to stderr: the first failure may lie far above the end.
        log = work / f"{name}.stderr"
        log.write_text(done.stderr)
        sys.exit(f"{name} failed (all of stderr: {log}):\n{done.stderr[-3000:]}")
    info = json.loads((out / "training_info.json").read_text())
    info["wall_seconds"] = time.perf_counter() - start
    return info


def print_breakdown(info: dict) -> None:
    """Each rank's resident memory (VmRSS) and its high-water mark (VmHWM) at the points of the
    run that the training loop marks (``memory_per_rank`` in training_info.json), in GiB."""
    ranks = info.get("memory_per_rank") or []
    if not ranks:
        return
    for r, marks in enumerate(ranks):
        cells = ", ".join(
            f"{m['label']} {m['rss_mib'] / 1024:.2f} (peak {m['peak_rss_mib'] / 1024:.2f})"
            for m in marks
        )
        print(f"        rank {r} RSS GiB: {cells}")


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--steps", type=positive_int, default=3)
    p.add_argument("--max-length", type=positive_int, default=128)
    p.add_argument("--skip-1b", action="store_true", help="only the SmolLM2-135M comparison")
    p.add_argument(
        "--keep", action="store_true", help="keep the work folder (checkpoints: 5 GB with the 1B)"
    )
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="training_memory_"))
    compare(args, work)
    # A failed run exits above and keeps the folder, with the ranks' stderr in it.
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


def compare(args: argparse.Namespace, work: Path) -> None:

    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from cluster_pipeline.data.datasets import build_instruction_table
    from cluster_pipeline.data.stdlib_dataset import iter_stdlib_samples
    from cluster_pipeline.models.loading import BUILTIN_MODEL, resolve_model
    from cluster_pipeline.selection.sharding import ShardManifest
    from cluster_pipeline.storage.tables import write_table
    from cluster_pipeline.training.config import Parallelism, TrainSettings
    from cluster_pipeline.training.memory import (
        ModelShape,
        TrainingMemoryError,
        available_bytes_per_rank,
        check_training_memory,
        parameter_count,
        training_estimate,
    )

    smol = resolve_model(BUILTIN_MODEL, ROOT / "data" / "models")
    frame, _ = build_instruction_table(iter_stdlib_samples(), 0.0, None, 16, seed=0)
    table = write_table(frame, work / "raw")
    ids = frame["sample_id"].to_list()
    manifests = [
        str(
            ShardManifest("bench", r, 2, "full", 1.0, 0, tuple(ids[r * 8 : (r + 1) * 8])).write(
                work
            )
        )
        for r in range(2)
    ]

    def settings(parallelism: Parallelism) -> TrainSettings:
        return TrainSettings(
            max_length=args.max_length,
            per_device_batch_size=2,
            gradient_accumulation_steps=1,
            max_steps=args.steps,
            learning_rate=1e-5,
            parallelism=parallelism,
            grad_cosine_every=None,
        )

    print(
        f"SmolLM2-135M-Instruct ({parameter_count(smol) / 1e6:.0f}M parameters), 2 ranks, "
        f"{args.steps} steps, batch 2 x {args.max_length} tokens per rank"
    )
    peaks = {}
    modes: tuple[Parallelism, ...] = ("ddp", "fsdp")
    smol_shape = ModelShape.of(smol)
    for mode in modes:
        need = training_estimate(smol_shape, settings(mode), 2)
        info = train(work, f"smol_{mode}", smol, table, manifests, settings(mode))
        peaks[mode] = info["peak_rss_bytes_per_rank"]
        print(
            f"  {mode:>4}: peak RSS per rank {[round(b / GIB, 2) for b in peaks[mode]]} GiB, "
            f"training loop {info['train_seconds']:.1f} s, wall {info['wall_seconds']:.1f} s; "
            f"pre-launch estimate {need.text()}; measured / estimated "
            f"{max(peaks[mode]) / need.total:.2f}"
        )
        print_breakdown(info)
    ratio = max(peaks["fsdp"]) / max(peaks["ddp"])
    print(f"  FSDP / DDP peak RSS per rank: {ratio:.3f} (target <= 0.65)")
    if args.skip_1b:
        return

    big = work / "llama_0.9b"
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=18,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    t0 = time.perf_counter()
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(big)
    AutoTokenizer.from_pretrained(smol).save_pretrained(big)
    n = parameter_count(str(big))
    available = available_bytes_per_rank(2)
    print(
        f"\nrandom Llama, {n / 1e6:.0f}M parameters (written in {time.perf_counter() - t0:.0f} s),"
        f" 2 ranks; {available / GIB:.1f} GiB available per rank now"
    )
    big_shape = ModelShape.of(str(big))
    try:
        check_training_memory(big_shape, settings("ddp"), 2, available)
        print("  ddp: the estimate fits this machine: not refused")
    except TrainingMemoryError as e:
        print(f"  ddp: refused before launch: {e}")
    need = check_training_memory(big_shape, settings("fsdp"), 2, available)
    info = train(work, "big_fsdp", str(big), table, manifests, settings("fsdp"))
    print(
        f"  fsdp: estimate {need.text()}; "
        f"peak RSS per rank "
        f"{[round(b / GIB, 2) for b in info['peak_rss_bytes_per_rank']]} GiB; {info['steps']} "
        f"steps in {info['train_seconds']:.0f} s ({info['train_seconds'] / info['steps']:.0f} s "
        f"per step), final loss {info['final_loss']:.3f}, wall {info['wall_seconds']:.0f} s"
    )
    print_breakdown(info)


if __name__ == "__main__":
    main()

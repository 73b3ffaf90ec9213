"""The pre-launch memory estimates against the measured peaks, per rank, for the three stages that
load a model: the embedding pass, training and evaluation.

    python benchmarks/memory_estimate.py [--shapes default,short,fsdp_long] [--json out.json]
        [--model DIR] [--eval-dir DIR]

For each shape, SmolLM2-135M-Instruct (the built-in model) on python_stdlib samples, the stages'
own entry points under torchrun, as the assets launch them: the embedding pass on 1 rank (64
samples), training on 2 ranks (2 optimizer steps, 48 samples per rank), evaluation on 1 rank
(the base model and the checkpoint just trained, 24 held-out samples, 4 HumanEval and 4 MBPP
problems). Each rank's peak resident memory (VmHWM) as the stage records it (``pass_stats.json``,
``training_info.json``, the evaluation's outcome files) against
:func:`~cluster_pipeline.training.memory.embedding_estimate`, ``training_estimate`` and
``evaluation_estimate`` for the same settings: the ratio measured / estimated (target: within
20 %).

Shapes (the stages' settings; every other knob at the main job's default, ``cpu_quick``):

- ``default``: the main job's (max_length 256; embedding batches of 8,192 tokens in rows of
  512; training micro-batches of 1,024 tokens in rows of 512, DDP; evaluation batches of 8,
  200 new tokens);
- ``short``: max_length 128 everywhere, embedding batches of 4,096 tokens in rows of 256,
  training micro-batches of 512 tokens in rows of 256, evaluation batches of 4, 100 new
  tokens;
- ``fsdp_long``: max_length 512 everywhere, rows of 512, training under FSDP2 with micro-batches
  of 1,536 tokens, evaluation batches of 8.

Memory does not depend on the machine's load; seconds do. About 5 minutes per shape on an idle
2-core machine; the training of ``default`` needs about 12 GB free (two ranks of about 6 GB).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from cluster_pipeline.launch.torchrun import RECIPES, torchrun_command

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30

SHAPES: dict[str, dict[str, dict]] = {
    "default": {
        "embed": {"max_length": 256, "max_packed_length": 512},
        "train": {"max_length": 256, "max_tokens_per_micro_batch": 1024, "max_packed_length": 512},
        "eval": {"max_length": 256, "batch_size": 8, "max_new_tokens": 200},
    },
    "short": {
        "embed": {"max_length": 128, "max_packed_length": 256, "max_batch_tokens": 4096},
        "train": {"max_length": 128, "max_tokens_per_micro_batch": 512, "max_packed_length": 256},
        "eval": {"max_length": 128, "batch_size": 4, "max_new_tokens": 100},
    },
    "fsdp_long": {
        "embed": {"max_length": 512, "max_packed_length": 512},
        "train": {
            "max_length": 512,
            "max_tokens_per_micro_batch": 1536,
            "max_packed_length": 512,
            "parallelism": "fsdp",
        },
        "eval": {"max_length": 512, "batch_size": 8, "max_new_tokens": 200},
    },
}


def _launch(work: Path, name: str, recipe: str, nproc: int, job) -> None:
    """Run one stage's entry point under torchrun with ``job`` (a job file); exits with the
    ranks' stderr if it fails."""
    path = job.dump(work / f"{name}.json")
    done = subprocess.run(
        torchrun_command(RECIPES[recipe], nproc, ["--config", str(path)]),
        capture_output=True,
        text=True,
    )
    if done.returncode:
        log = work / f"{name}.stderr"
        log.write_text(done.stderr)
        sys.exit(f"{name} failed (all of stderr: {log}):\n{done.stderr[-3000:]}")


def measure(shape: str, work: Path, model: str, eval_dirs: list[Path], problems: int = 4) -> dict:
    """The three stages at ``shape``: each one's estimate and measured peak per rank (bytes)."""
    from cluster_pipeline.data.datasets import build_instruction_table
    from cluster_pipeline.data.stdlib_dataset import iter_stdlib_samples
    from cluster_pipeline.evaluation.suites import EvalJob, EvalModel, EvalSettings
    from cluster_pipeline.selection.sharding import ShardManifest
    from cluster_pipeline.storage.tables import write_table
    from cluster_pipeline.training.config import EmbedJob, EmbedSettings, TrainJob, TrainSettings
    from cluster_pipeline.training.memory import (
        embedding_estimate,
        evaluation_estimate,
        training_estimate,
    )

    knobs = SHAPES[shape]
    work.mkdir(parents=True)
    frame, _ = build_instruction_table(iter_stdlib_samples(), 0.2, 24, 96, seed=0)
    table = write_table(frame, work / "raw")
    train_ids = frame.filter(frame["split"] == "train")["sample_id"].to_list()
    out: dict = {"shape": shape}

    embed = EmbedSettings(**knobs["embed"])
    _launch(
        work,
        "embed",
        "embed",
        1,
        EmbedJob(
            settings=embed,
            model_path=model,
            instructions_uri=table.uri,
            instructions_version=table.version,
            chunk_dir=str(work / "chunks"),
        ),
    )
    stats = json.loads((work / "chunks" / "pass_stats.json").read_text())
    out["embed"] = {
        "estimate": embedding_estimate(model, embed).total,
        "measured": [int(stats["peak_rss_bytes"])],
        "parts": embedding_estimate(model, embed).text(),
    }

    train = TrainSettings(
        **knobs["train"], gradient_accumulation_steps=2, max_steps=2, grad_cosine_every=None
    )
    manifests = [
        str(ShardManifest("bench", r, 2, "full", 1.0, 0, tuple(train_ids[r::2])).write(work))
        for r in range(2)
    ]
    checkpoint = work / "checkpoint"
    _launch(
        work,
        "train",
        "train",
        2,
        TrainJob(
            settings=train,
            model_path=model,
            instructions_uri=table.uri,
            instructions_version=table.version,
            manifests=manifests,
            output_dir=str(checkpoint),
        ),
    )
    info = json.loads((checkpoint / "training_info.json").read_text())
    out["train"] = {
        "estimate": training_estimate(model, train, 2).total,
        "measured": [int(b) for b in info["peak_rss_bytes_per_rank"]],
        "parts": training_estimate(model, train, 2).text(),
        "marks": info.get("memory_per_rank"),
    }

    evaluation = EvalSettings(**knobs["eval"], humaneval_problems=problems, mbpp_problems=problems)
    models = [
        EvalModel(model_path=p, output=str(work / f"outcome_{i}.json"))
        for i, p in enumerate([model, str(checkpoint)])
    ]
    benchmarks = ["humaneval", *(["mbpp"] if eval_dirs else [])]
    _launch(
        work,
        "evaluate",
        "evaluate",
        1,
        EvalJob(
            settings=evaluation,
            models=models,
            instructions_uri=table.uri,
            instructions_version=table.version,
            benchmarks=benchmarks,
            eval_folders=[str(d) for d in eval_dirs],
        ),
    )
    peaks = [json.loads(Path(m.output).read_text())["peak_rss_bytes"] for m in models]
    out["evaluate"] = {
        "estimate": evaluation_estimate(model, evaluation).total,
        "measured": [max(peaks)],
        "after_each_model": peaks,
        "parts": evaluation_estimate(model, evaluation).text(),
    }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--model", help="the converted built-in model (default: data/models/...)")
    p.add_argument(
        "--eval-dir",
        type=Path,
        default=next(
            (
                d
                for d in (ROOT / "data" / "eval", ROOT.parent / "shared" / "datasets" / "eval")
                if (d / "mbpp_reworded.json").is_file()
            ),
            None,
        ),
        help="a folder with mbpp_reworded.json (MBPP is left out without one)",
    )
    p.add_argument("--json", type=Path, help="write the figures here")
    p.add_argument(
        "--problems",
        type=int,
        default=4,
        help="HumanEval and MBPP problems each (fewer: a shorter run; the likelihood passes' "
        "batch, not the generation's, sets evaluation's peak at these shapes)",
    )
    p.add_argument("--keep", action="store_true", help="keep the work folder")
    args = p.parse_args()
    from cluster_pipeline.models.loading import BUILTIN_MODEL, resolve_model

    model = args.model or resolve_model(BUILTIN_MODEL, ROOT / "data" / "models")
    work = Path(tempfile.mkdtemp(prefix="memory_estimate_"))
    results = []
    for shape in args.shapes.split(","):
        eval_dirs = [args.eval_dir] if args.eval_dir else []
        result = measure(shape, work / shape, model, eval_dirs, args.problems)
        results.append(result)
        for stage in ("embed", "train", "evaluate"):
            r = result[stage]
            ratio = max(r["measured"]) / r["estimate"]
            print(
                f"{shape:>9} {stage:>8}: measured peak per rank "
                f"{[round(b / GIB, 2) for b in r['measured']]} GiB, estimated "
                f"{r['estimate'] / GIB:.2f} GiB: measured / estimated {ratio:.2f} "
                f"({r['parts']})",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

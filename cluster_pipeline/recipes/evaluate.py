"""Evaluate a report's models (held-out loss, benchmarks) in one process under torchrun.

    torchrun --standalone --nproc_per_node=1 -m cluster_pipeline.recipes.evaluate --config job.json

``eval_report`` runs one such process for all the models it has no cached outcome of (the
held-out split and the benchmarks are read once, each model loaded in turn), so a process that
dies (the kernel's out-of-memory killer, a crash in native code) is named with its signal and
likely cause exactly like an embedding or training rank, and the step process survives to say
so. Each model's outcome of :func:`~cluster_pipeline.evaluation.suites.evaluate_model` is
written as JSON to its ``output`` as soon as that model is done (atomically: a killed process
leaves no partial file, and the models evaluated before it stay usable).
"""

if __name__ == "__main__":
    # Before torch loads (seconds): the process must not outlive a launcher killed meanwhile.
    from cluster_pipeline.launch.fate import die_with_parent

    die_with_parent()

import json
from pathlib import Path

import polars as pl
from torch.distributed.elastic.multiprocessing.errors import record

from cluster_pipeline.evaluation.suites import EvalJob, evaluate_model, load_suites
from cluster_pipeline.launch.fate import check_alive
from cluster_pipeline.storage.atomic import atomic_file
from cluster_pipeline.training.distributed import DistEnv, Reporter, run_entry_point
from cluster_pipeline.training.memory import peak_memory_bytes


@record
def main(argv: list[str] | None = None) -> None:
    """A report's evaluations, from ``--config <EvalJob JSON>``."""
    run_entry_point(EvalJob, evaluate, argv, __doc__ or "")


def evaluate(job: EvalJob, env: DistEnv, report: Reporter) -> None:
    """Evaluate each of ``job.models`` in turn on the held-out split of the pinned table and the
    job's benchmarks; rank 0 writes each model's outcome to its ``output`` once it is done."""
    heldout = pl.read_delta(job.instructions_uri, version=job.instructions_version).filter(
        pl.col("split") == "heldout"
    )
    suites, _ = load_suites(job.benchmarks, job.settings, [Path(f) for f in job.eval_folders])
    for i, model in enumerate(job.models, 1):
        report.info(f"model {i}/{len(job.models)}: {model.model_path}")
        outcome = evaluate_model(model.model_path, heldout, suites, job.settings, report.info)
        # This process's peak so far (every model before this one included): what the report's
        # memory estimate is checked against.
        outcome["peak_rss_bytes"] = peak_memory_bytes()[0]
        if env.is_main:
            out = Path(model.output)
            with atomic_file(out) as tmp:
                tmp.write_text(json.dumps(outcome, default=str))
                check_alive(f"write the evaluation outcome {out}")


if __name__ == "__main__":
    main()

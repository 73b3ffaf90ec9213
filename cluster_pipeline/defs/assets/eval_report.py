"""Stage 6: was the subset worth it? Base model, the CluSTER checkpoint and every other
checkpoint of the dataset, side by side."""

import hashlib
import json
import time
from pathlib import Path

import dagster as dg
import polars as pl
import torch
from pydantic import Field

from cluster_pipeline.core import plots
from cluster_pipeline.core.evaluation import (
    MMLU_MEDICAL_TOPICS,
    code_pass_at_1,
    heldout_loss,
    load_humaneval,
    load_mbpp,
    load_mmlu,
    mmlu_accuracy,
)
from cluster_pipeline.core.modeling import load_model_and_tokenizer
from cluster_pipeline.core.report import (
    BENCHMARKS,
    ModelResult,
    aggregate,
    dataset_benchmarks,
    markdown_table,
    report_plots,
)
from cluster_pipeline.core.tables import TableRef
from cluster_pipeline.defs.metadata import latest_metadata
from cluster_pipeline.defs.partitions import dataset_partitions
from cluster_pipeline.defs.resources import PROJECT_ROOT, BaseModelResource, StorageResource

SHARED_EVAL_DIR = PROJECT_ROOT.parent / "shared" / "datasets" / "eval"


class EvalReportConfig(dg.Config):
    max_length: int = Field(default=512, ge=2, description="Max tokens per held-out sample.")
    batch_size: int = Field(default=8, ge=1, description="Samples per forward/generate batch.")
    benchmarks: list[str] | None = Field(
        default=None, description=f"Benchmarks beside held-out loss, from {list(BENCHMARKS)}. "
        "None = the dataset's own: data/raw/<dataset>/eval.json {\"benchmarks\": [...]}, or "
        "humaneval + mbpp for python_stdlib.")
    humaneval_problems: int = Field(default=164, ge=0, le=164, description="First N HumanEval "
                                    "problems (0 = none).")
    mbpp_problems: int = Field(default=397, ge=0, description="First N MBPP-style problems.")
    mmlu_questions: int = Field(default=200, ge=0, description="MMLU questions (a seeded sample "
                                "over the chosen topics).")
    max_new_tokens: int = Field(default=384, ge=1, description="Generation budget per problem.")
    timeout_s: float = Field(default=5.0, gt=0, description="Seconds per generated program.")
    eval_data_dir: str | None = Field(
        default=None, description="Folder with mbpp_reworded.json and mmlu.jsonl. None = "
        "data/eval/, else ../shared/datasets/eval/ beside the project.")
    compare_checkpoints: bool = Field(default=True, description="Also evaluate every other "
                                      "checkpoint of this dataset (other selectors, seeds).")


def _eval_file(config: EvalReportConfig, storage: StorageResource, name: str) -> Path | None:
    folders = ([Path(config.eval_data_dir)] if config.eval_data_dir
               else [storage.root / "eval", SHARED_EVAL_DIR])
    return next((f / name for f in folders if (f / name).exists()), None)


def _suites(config: EvalReportConfig, storage: StorageResource, names, log) -> tuple[dict, dict]:
    """(benchmark -> problems/questions, benchmark -> reason it was skipped)."""
    suites, skipped = {}, {}
    for name in names:
        if name == "humaneval" and config.humaneval_problems:
            suites[name] = load_humaneval(config.humaneval_problems)
        elif name == "mbpp" and config.mbpp_problems:
            path = _eval_file(config, storage, "mbpp_reworded.json")
            if path is None:
                skipped[name] = "mbpp_reworded.json not found in data/eval/ or eval_data_dir"
            else:
                suites[name] = load_mbpp(path, config.mbpp_problems)
        elif name in ("mmlu", "mmlu_medical") and config.mmlu_questions:
            path = _eval_file(config, storage, "mmlu.jsonl")
            if path is None:
                skipped[name] = "mmlu.jsonl not found in data/eval/ or eval_data_dir"
            else:
                topics = MMLU_MEDICAL_TOPICS if name == "mmlu_medical" else None
                suites[name] = load_mmlu(path, topics, config.mmlu_questions)
        else:
            skipped[name] = "size set to 0"
    for name, reason in skipped.items():
        log(f"benchmark {name} skipped: {reason}")
    return suites, skipped


def _evaluate(path: str, heldout: pl.DataFrame, suites: dict, cfg: EvalReportConfig, log) -> dict:
    start = time.perf_counter()
    torch.manual_seed(0)
    model, tokenizer = load_model_and_tokenizer(path)
    loss = heldout_loss(model, tokenizer, heldout, cfg.max_length, cfg.batch_size)
    metrics = {"heldout_loss": loss["loss"], "heldout_perplexity": loss["perplexity"]}
    details = {}
    for name, suite in suites.items():
        if name in ("humaneval", "mbpp"):
            done = [0]

            def progress(n: int, name=name, total=len(suite)) -> None:
                done[0] += n
                log(f"{name}: generated {done[0]}/{total}")

            score, records = code_pass_at_1(model, tokenizer, suite, cfg.max_new_tokens,
                                            cfg.batch_size, cfg.timeout_s, progress)
            metrics[f"{name}_pass@1"] = score
        else:
            score, records = mmlu_accuracy(model, tokenizer, suite, cfg.max_length, cfg.batch_size)
            metrics[f"{name}_accuracy"] = score
        details[name] = records
        log(f"{name}: {score:.4f}")
    return {"metrics": metrics, "details": details, "heldout_tokens": loss["tokens"],
            "eval_seconds": time.perf_counter() - start}


def _checkpoints(root: Path) -> list[tuple[Path, dict]]:
    """Every complete checkpoint folder of a dataset with its training_info.json, oldest first."""
    found = []
    for info_path in root.glob("*/training_info.json"):
        try:
            found.append((info_path.parent, json.loads(info_path.read_text())))
        except ValueError:
            continue
    return sorted(found, key=lambda x: x[0].stat().st_mtime)


def _loss_curve(ckpt: Path) -> list[tuple[int, float]]:
    metrics = Path(f"{ckpt}.metrics.jsonl")
    if not metrics.exists():
        return []
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [(r["step"], r["loss"]) for r in rows]


@dg.asset(
    partitions_def=dataset_partitions,
    deps=["trained_checkpoint", "raw_instructions"],
    group_name="training",
    kinds={"pytorch", "markdown"},
    code_version="2",
)
def eval_report(
    context: dg.AssetExecutionContext,
    config: EvalReportConfig,
    storage: StorageResource,
    base_model: BaseModelResource,
) -> dg.MaterializeResult:
    """Base model vs the CluSTER checkpoint (and, side by side, every other checkpoint of this
    dataset: other selectors, budgets, seeds; mean ± std over seeds): held-out loss and
    perplexity on the held-out split set aside before selection, the dataset's benchmarks
    (HumanEval / MBPP pass@1, MMLU accuracy), training seconds and data fraction. Written as
    standalone Markdown with PNG plots to ``data/reports/<dataset>/``.
    """
    dataset = context.partition_key
    instructions = latest_metadata(context, "raw_instructions")
    checkpoint = latest_metadata(context, "trained_checkpoint")
    embeddings = latest_metadata(context, "proxy_embeddings")
    heldout_ref = TableRef(str(instructions["table_uri"]), int(instructions["table_version"]))
    heldout = heldout_ref.read().filter(pl.col("split") == "heldout")
    if heldout.height == 0:
        raise dg.Failure(f"{dataset}: the held-out split is empty; materialize raw_instructions "
                         "with heldout_fraction > 0")
    try:
        names = config.benchmarks if config.benchmarks is not None else \
            dataset_benchmarks(dataset, storage.raw_dir)
        unknown = set(names) - set(BENCHMARKS)
        if unknown:
            raise ValueError(f"unknown benchmarks {sorted(unknown)}; choose from {list(BENCHMARKS)}")
    except ValueError as e:
        raise dg.Failure(f"{dataset}: {e}") from e
    suites, skipped = _suites(config, storage, names, context.log.info)

    current = Path(str(checkpoint["checkpoint_path"]))
    models = [("base", "base", base_model.local_path(storage), None)]
    others = _checkpoints(current.parent) if config.compare_checkpoints else []
    if current not in [p for p, _ in others]:
        others.append((current, json.loads((current / "training_info.json").read_text())))
    for path, info in others:
        prov = info.get("config", {}).get("provenance", {})
        # Checkpoints written before provenance was recorded keep their folder name.
        group = (f"{prov['selector']} r={prov.get('ratio')}" if "selector" in prov
                 else f"checkpoint {path.name}")
        seeds = f"seed {info.get('config', {}).get('seed', 0)}/{prov.get('selection_seed', 0)}"
        models.append((f"{group} {seeds}", group, str(path), info))

    settings = hashlib.sha256(json.dumps(
        [config.model_dump(), heldout_ref.version, sorted(suites)], sort_keys=True,
        default=str).encode()).hexdigest()[:12]
    cache_dir = storage.work_dir("reports", dataset, "evals")
    results: list[ModelResult] = []
    heldout_tokens = 0
    for name, group, path, info in models:
        # A checkpoint folder rewritten in place (resumed, retrained) gets a new key.
        stamp = (Path(path) / "training_info.json").stat().st_mtime_ns if info else ""
        key = hashlib.sha256(f"{path}|{stamp}".encode()).hexdigest()[:12]
        cached = cache_dir / f"{key}-{settings}.json"
        if cached.exists():
            outcome = json.loads(cached.read_text())
            context.log.info(f"{name}: cached evaluation {cached.name}")
        else:
            context.log.info(f"evaluating {name}: {path}")
            outcome = _evaluate(path, heldout, suites, config, context.log.info)
            cached.write_text(json.dumps(outcome, default=str))
        heldout_tokens = outcome["heldout_tokens"]
        prov = (info or {}).get("config", {}).get("provenance", {})
        results.append(ModelResult(
            name=name, group=group, path=path, metrics=outcome["metrics"],
            train_seconds=info.get("train_seconds") if info else None,
            data_fraction=prov.get("data_fraction") if info else None,
            current=Path(path) == current, loss_curve=_loss_curve(Path(path)) if info else [],
        ))

    metric_names = list(results[0].metrics)
    rows = aggregate(results, metric_names)
    current_row = next(r for r in rows if r["current"])
    train_s = float(current_row["train_seconds"])
    fraction = float(current_row["data_fraction"])
    full_estimate = train_s / fraction if fraction > 0 else float("nan")
    selection_s = float(embeddings.get("embedding_seconds", 0.0))
    pngs = report_plots(results, rows, metric_names)
    report_dir = storage.work_dir("reports", dataset)
    for png_name, png in pngs.items():
        (report_dir / png_name).write_bytes(png)
    summary = (
        f"## eval_report: `{dataset}`\n\n"
        f"Held-out split: {heldout.height} samples, {heldout_tokens} response tokens. "
        f"Benchmarks: {', '.join(f'{k} ({len(v)})' for k, v in suites.items()) or 'none'}"
        + (f"; skipped: {'; '.join(f'{k}: {v}' for k, v in skipped.items())}" if skipped else "")
        + ". Greedy decoding; bold = the checkpoint of this run; ± = std over seeds.\n\n"
        + markdown_table(rows, metric_names)
        + "\n\n| cost of the bold run | value |\n|---|---|\n"
        f"| selection: embedding pass (torchrun, model load excluded) | {selection_s:.1f} s |\n"
        f"| training (measured) | {train_s:.1f} s at data fraction {fraction:.3f} |\n"
        f"| full-data training (estimate: measured / fraction) | {full_estimate:.1f} s |\n"
        f"| training time saved | {full_estimate - train_s:.1f} s |\n"
    )
    (report_dir / "eval_report.md").write_text(
        summary + "\n" + "\n".join(f"![{n}]({n})" for n in pngs) + "\n")
    (report_dir / "eval_report.json").write_text(json.dumps(
        {"dataset": dataset, "rows": rows, "models": [r.__dict__ for r in results],
         "skipped": skipped, "selection_seconds": selection_s,
         "full_training_estimate_seconds": full_estimate}, indent=1, default=str))
    context.log.info(summary)
    meta = {
        "report": dg.MetadataValue.md(
            summary + "\n" + "\n".join(plots.markdown_image(p, n) for n, p in pngs.items())),
        "report_path": dg.MetadataValue.path(str(report_dir / "eval_report.md")),
        "checkpoint_path": dg.MetadataValue.path(str(current)),
        "models_compared": len(results),
        "train_seconds": round(train_s, 2),
        "full_training_estimate_seconds": round(full_estimate, 2),
        "data_fraction": fraction,
    }
    base = results[0]
    tuned = next(r for r in results if r.current)
    for label, r in (("base", base), ("tuned", tuned)):
        for m, v in r.metrics.items():
            meta[f"{label}/{m}"] = round(float(v), 5)
    return dg.MaterializeResult(metadata=meta)

"""Stage 6: base model vs fine-tuned checkpoint on the held-out split and HumanEval."""


import json
import time

import dagster as dg
import polars as pl
import torch
from pydantic import Field

from cluster_pipeline.core import plots
from cluster_pipeline.core.evaluation import heldout_loss, humaneval_pass_at_1, load_humaneval
from cluster_pipeline.core.modeling import load_model_and_tokenizer
from cluster_pipeline.core.tables import TableRef
from cluster_pipeline.defs.metadata import latest_metadata
from cluster_pipeline.defs.partitions import dataset_partitions
from cluster_pipeline.defs.resources import BaseModelResource, StorageResource


class EvalReportConfig(dg.Config):
    max_length: int = Field(default=512, ge=2, description="Max tokens per held-out sample.")
    batch_size: int = Field(default=8, ge=1, description="Samples per forward/generate batch.")
    humaneval_problems: int = Field(default=164, ge=0, le=164, description="First N HumanEval "
                                    "problems to run (0 = skip HumanEval).")
    max_new_tokens: int = Field(default=384, ge=1, description="Generation budget per problem.")
    timeout_s: float = Field(default=5.0, gt=0, description="Seconds per HumanEval program.")


def _evaluate(model_path: str, heldout: pl.DataFrame, problems: list[dict],
              cfg: EvalReportConfig, log) -> dict:
    start = time.perf_counter()
    model, tokenizer = load_model_and_tokenizer(model_path)
    loss = heldout_loss(model, tokenizer, heldout, cfg.max_length, cfg.batch_size)
    out = {"heldout_loss": loss["loss"], "heldout_perplexity": loss["perplexity"],
           "heldout_tokens": loss["tokens"]}
    if problems:
        done = [0]

        def progress(n: int) -> None:
            done[0] += n
            log(f"HumanEval: generated {done[0]}/{len(problems)}")

        pass1, records = humaneval_pass_at_1(model, tokenizer, problems, cfg.max_new_tokens,
                                             cfg.batch_size, cfg.timeout_s, progress)
        out["humaneval_pass@1"] = pass1
        out["humaneval_records"] = records
    out["eval_seconds"] = time.perf_counter() - start
    del model
    return out


@dg.asset(
    partitions_def=dataset_partitions,
    deps=["trained_checkpoint", "raw_instructions"],
    group_name="training",
    kinds={"pytorch", "markdown"},
    code_version="1",
)
def eval_report(
    context: dg.AssetExecutionContext,
    config: EvalReportConfig,
    storage: StorageResource,
    base_model: BaseModelResource,
) -> dg.MaterializeResult:
    """Base model vs fine-tuned checkpoint: held-out loss and perplexity on the held-out split
    (set aside before selection), HumanEval pass@1 (greedy), training and selection seconds, and
    the estimated time saved against full-data training. Written as Markdown with plots to
    ``data/reports/<dataset>/`` and shown here.
    """
    dataset = context.partition_key
    torch.manual_seed(0)
    instructions = latest_metadata(context, "raw_instructions")
    checkpoint = latest_metadata(context, "trained_checkpoint")
    embeddings = latest_metadata(context, "proxy_embeddings")
    subsets = latest_metadata(context, "peripheral_subsets")
    heldout = TableRef(str(instructions["table_uri"]), int(instructions["table_version"])).read()
    heldout = heldout.filter(pl.col("split") == "heldout")
    problems = load_humaneval(config.humaneval_problems) if config.humaneval_problems else []
    models = {"base": base_model.local_path(storage), "tuned": str(checkpoint["checkpoint_path"])}
    results = {}
    for name, path in models.items():
        context.log.info(f"evaluating {name}: {path}")
        results[name] = _evaluate(path, heldout, problems, config, context.log.info)

    train_s = float(checkpoint["train_seconds"])
    fraction = float(subsets["data_fraction"])
    full_estimate = train_s / fraction if fraction > 0 else float("nan")
    selection_s = float(embeddings.get("embedding_seconds", 0.0))
    metrics = ["heldout_loss", "heldout_perplexity"] + (["humaneval_pass@1"] if problems else [])
    rows = ["| model | " + " | ".join(metrics) + " |", "|---|" + "---|" * len(metrics)]
    for name in models:
        rows.append(f"| {name} | " + " | ".join(f"{results[name][m]:.4f}" for m in metrics) + " |")
    summary = (
        f"## eval_report: `{dataset}`\n\n"
        f"Held-out split: {heldout.height} samples, {results['base']['heldout_tokens']} response "
        f"tokens. HumanEval: first {len(problems)} problems, greedy, pass@1.\n\n"
        + "\n".join(rows)
        + "\n\n"
        f"| cost | value |\n|---|---|\n"
        f"| selector | {subsets['selector']} (r = {subsets['ratio']}) |\n"
        f"| data fraction trained on | {fraction:.3f} ({subsets['selected_samples']} samples) |\n"
        f"| selection (embedding pass) | {selection_s:.1f} s |\n"
        f"| training (measured) | {train_s:.1f} s |\n"
        f"| full-data training (estimate: measured / fraction) | {full_estimate:.1f} s |\n"
        f"| training time saved | {full_estimate - train_s:.1f} s |\n"
    )
    bars = plots.metric_bars({n: {m: results[n][m] for m in metrics} for n in models},
                             f"{dataset}: base vs tuned")
    report_dir = storage.work_dir("reports", dataset)
    (report_dir / "metrics.png").write_bytes(bars)
    (report_dir / "eval_report.md").write_text(summary + "\n![metrics](metrics.png)\n")
    (report_dir / "eval_report.json").write_text(json.dumps(
        {"dataset": dataset, "models": models, "results": results, "train_seconds": train_s,
         "data_fraction": fraction, "selection_seconds": selection_s,
         "full_training_estimate_seconds": full_estimate}, indent=1, default=str))
    context.log.info(summary)
    meta = {
        "report": dg.MetadataValue.md(summary + "\n" + plots.markdown_image(bars, "metrics")),
        "report_path": dg.MetadataValue.path(str(report_dir / "eval_report.md")),
        "checkpoint_path": dg.MetadataValue.path(models["tuned"]),
        "train_seconds": round(train_s, 2),
        "full_training_estimate_seconds": round(full_estimate, 2),
        "data_fraction": fraction,
    }
    for name in models:
        for m in metrics:
            meta[f"{name}/{m}"] = round(float(results[name][m]), 5)
    return dg.MaterializeResult(metadata=meta)

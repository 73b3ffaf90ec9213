"""Test helpers, imported by the test modules and by conftest.py's fixtures: a tiny tokenizer
and causal LM built offline, tiny datasets, and the asset-level plumbing (resources, run
config, reading back what a stage recorded)."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import dagster as dg
import polars as pl
import torch

from cluster_pipeline.evaluation.sandbox import sandbox_problem
from cluster_pipeline.storage.layout import DataLayout

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# ChatML that writes the function schemas first, as tool-calling templates (Qwen2.5, Llama 3.1)
# do: a system block listing `tools` as JSON.
CHATML_TOOLS = (
    "{% if tools %}{{ '<|im_start|>system\nTools: ' + (tools | tojson) + '<|im_end|>\n' }}"
    "{% endif %}" + CHATML
)
# Renders earlier assistant turns as a placeholder (as templates that strip reasoning do), so an
# earlier turn is not where the generation prompt says it starts.
FORGETFUL = (
    "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
    "{{ '<|im_start|>assistant\n…<|im_end|>\n' }}{% else %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
SHARED_DATASETS = Path(__file__).resolve().parents[1].parent / "shared" / "datasets"

_WORDS = (
    "add subtract multiply reverse sort list string number python function return value "
    "sum product word letters apple banana cherry dog cat bird tree river mountain code data "
    "write explain describe translate compute the a of and to in is for with"
).split()


def _corpus() -> list[str]:
    rng = random.Random(0)
    lines = [" ".join(rng.choice(_WORDS) for _ in range(12)) for _ in range(300)]
    lines += ["0123456789 +-*/=()[]{}:;,.!?'\"\n def return if else for while"] * 5
    return lines


def build_tokenizer(chat_template: str | None = CHATML, pad: str | None = "<pad>") -> Any:
    """A byte-level BPE tokenizer (vocab ~400) trained on a fixed corpus; no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>" if chat_template else "<|endoftext|>",
        bos_token="<|endoftext|>" if not chat_template else None,
        pad_token=pad,
    )
    if chat_template:
        fast.chat_template = chat_template
    return fast


def build_model(
    vocab_size: int, seed: int = 0, pad_token_id: int | None = None, tie_word_embeddings=False
):
    """A 2-layer Llama with hidden size 32, random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=pad_token_id,
    )
    model = LlamaForCausalLM(config)
    model.eval()
    return model


def tiny_records(n: int = 60) -> list[dict]:
    """n Alpaca-form records on two topics (arithmetic, word reversal), all distinct."""
    rng = random.Random(1)
    out = []
    for i in range(n):
        if i % 2 == 0:
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            out.append(
                {"instruction": f"Add {a} and {b}.", "input": "", "output": f"The sum is {a + b}."}
            )
        else:
            word = rng.choice(_WORDS) + rng.choice(_WORDS)
            out.append(
                {
                    "instruction": "Reverse the letters of the word.",
                    "input": f"{word} {i}",
                    "output": f"{word[::-1]} {i}",
                }
            )
    return out


def seed_embeddings(cache: Path, data_dir: Path) -> None:
    """Copy the embedding cache of partition ``tiny`` (conftest's ``tiny_embedding_cache``)
    into the data folder ``data_dir``.

    For tests whose point lies downstream of the embedding pass: the product's per-sample
    cache (keyed by model content and embedding settings, not by paths or world size) then
    serves every sample of the 60-sample ``tiny`` dataset, and ``proxy_embeddings`` reads it
    instead of launching torchrun (10-15 s of CPU per launch). The pass itself is tested
    without it (test_proxy_embeddings_asset.py, the seven-asset run of test_pipeline_e2e.py,
    recipes/test_embed.py, the run, queue and kill tests)."""
    shutil.copytree(cache, DataLayout.at(data_dir).embeddings_dir("tiny"))


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def instructions_table(path: Path, records: list[dict], heldout_fraction: float = 0.0):
    """A raw_instructions Delta table at ``path`` built from Alpaca records."""
    from cluster_pipeline.data.datasets import build_instruction_table
    from cluster_pipeline.data.formats import normalise_record
    from cluster_pipeline.storage.tables import write_table

    samples = [normalise_record(r, "mem.jsonl", i + 1) for i, r in enumerate(records)]
    frame, _ = build_instruction_table(samples, heldout_fraction, None, None, seed=0)
    return write_table(frame, path)


def torchrun(module: str, nproc: int, args: list[str], **kwargs):
    """Launch ``module`` under torchrun --standalone and wait; returns CompletedProcess."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        module,
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kwargs)


# --- Assets -----------------------------------------------------------------------------------


def pipeline_assets() -> list[dg.AssetsDefinition]:
    """The seven stage assets, in pipeline order."""
    from cluster_pipeline.defs.assets.balanced_clusters import balanced_clusters
    from cluster_pipeline.defs.assets.eval_report import eval_report
    from cluster_pipeline.defs.assets.peripheral_subsets import peripheral_subsets
    from cluster_pipeline.defs.assets.proxy_embeddings import proxy_embeddings
    from cluster_pipeline.defs.assets.raw_instructions import raw_instructions
    from cluster_pipeline.defs.assets.shard_manifests import shard_manifests
    from cluster_pipeline.defs.assets.trained_checkpoint import trained_checkpoint

    return [
        raw_instructions,
        proxy_embeddings,
        balanced_clusters,
        peripheral_subsets,
        shard_manifests,
        trained_checkpoint,
        eval_report,
    ]


# Small sizes for the tiny model and the 60-sample dataset.
RUN_CONFIG = {
    "ops": {
        "raw_instructions": {"config": {"heldout_fraction": 0.1}},
        "proxy_embeddings": {"config": {"max_length": 64, "chunk_size": 16}},
        "balanced_clusters": {"config": {"num_clusters": 2, "alpha": 1.3}},
        "peripheral_subsets": {"config": {"ratio": 0.5}},
        "trained_checkpoint": {
            "config": {
                "max_length": 64,
                "per_device_batch_size": 2,
                "max_tokens_per_micro_batch": 96,
                "max_packed_length": 64,
                "gradient_accumulation_steps": 1,
                "learning_rate": 1e-3,
            }
        },
        "eval_report": {
            "config": {
                # Where namespaces are refused (some containers) the e2e tests still generate;
                # the sandbox's own tests cover isolation and skip there, saying why.
                "unsafe_sandbox": sandbox_problem() is not None,
                "max_length": 64,
                "benchmarks": ["humaneval"],
                "humaneval_problems": 2,
                "max_new_tokens": 8,
            }
        },
    }
}


def run_config_for(assets: list[dg.AssetsDefinition], **overrides: dict) -> dict:
    """:data:`RUN_CONFIG` restricted to ``assets`` (Dagster refuses config for assets not in
    the run), with per-asset config ``overrides`` merged in."""
    names = {a.key.to_user_string() for a in assets}
    ops = {
        k: {"config": {**v["config"], **overrides.get(k, {})}}
        for k, v in RUN_CONFIG["ops"].items()
        if k in names
    }
    return {"ops": ops}


def resources(data_dir: Path, model_dir: Path, tracking_uri: str | None = None) -> dict:
    """The project's resources over a test data folder and model; MLflow tracking off unless
    ``tracking_uri`` is given (a store of the test's own; "" = the data folder's own store)."""
    from cluster_pipeline.defs.resources import (
        BaseModelResource,
        StorageResource,
        TorchrunResource,
        TrackingResource,
    )

    return {
        "storage": StorageResource(data_dir=str(data_dir)),
        "base_model": BaseModelResource(model=str(model_dir)),
        "torchrun": TorchrunResource(),
        "pipes_subprocess_client": dg.PipesSubprocessClient(),
        "tracking": TrackingResource(
            enabled=tracking_uri is not None, tracking_uri=tracking_uri or ""
        ),
    }


def materialize_partition(
    assets: list[dg.AssetsDefinition],
    instance: dg.DagsterInstance,
    resources: dict,
    *,
    run_config: dict | None = None,
    partition: str = "tiny",
    raise_on_error: bool = True,
) -> dg.ExecuteInProcessResult:
    """``dg.materialize`` of ``assets`` for one dataset partition, in process, with the tests'
    run config (:func:`run_config_for` ``assets`` unless ``run_config`` is given).

    Dagster loads the definitions with the state storage of the instance last entered in this
    context (a ContextVar that ``DagsterInstance.__enter__`` sets); an instance entered earlier
    in the worker and garbage-collected without its ``__exit__`` leaves a storage whose
    instance is gone, and ``materialize`` then fails with "Attempted to resolve undefined
    DagsterInstance weakref" (test_operations.py, twice in full suites, never alone). The
    storage of ``instance`` is set for the call."""
    from dagster._core.storage.defs_state.base import set_defs_state_storage

    with set_defs_state_storage(instance.defs_state_storage):
        return dg.materialize(
            assets,
            partition_key=partition,
            instance=instance,
            resources=resources,
            run_config=run_config if run_config is not None else run_config_for(assets),
            raise_on_error=raise_on_error,
        )


def meta(instance, asset: str, partition: str = "tiny") -> dict:
    """Metadata values of the latest materialization of ``asset``."""
    rec = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey(asset), asset_partitions=[partition]), limit=1
    ).records[0]
    return {k: v.value for k, v in rec.asset_materialization.metadata.items()}


def step_failure(result: dg.ExecuteInProcessResult) -> tuple[str, dict]:
    """(description, metadata values) of the first step failure of a failed run."""
    event = next(e for e in result.all_events if e.is_step_failure)
    data = event.step_failure_data.user_failure_data
    assert data is not None and data.description is not None, "a dagster.Failure was raised"
    return data.description, {k: v.value for k, v in data.metadata.items()}


def read(instance, asset: str, partition: str = "tiny") -> pl.DataFrame:
    """The table version the latest materialization of ``asset`` recorded."""
    m = meta(instance, asset, partition)
    return pl.read_delta(str(m["table_uri"]), version=int(m["table_version"]))


# --- Training entry point ---------------------------------------------------------------------


def train_job(
    tmp_path: Path, model_dir: Path, weights: list[float], per_rank: int | list[int], **settings
):
    """A 40-sample instructions table, one shard manifest per weight (``per_rank`` samples
    each, or ``per_rank[r]`` for rank r; disjoint), and a TrainJob written to
    ``tmp_path/train.json``.

    Returns (job, the instructions TableRef).
    """
    from cluster_pipeline.selection.sharding import ShardManifest
    from cluster_pipeline.training.config import TrainJob, TrainSettings

    table = instructions_table(tmp_path / "raw", tiny_records(40))
    ids = pl.read_delta(table.uri)["sample_id"].to_list()
    counts = per_rank if isinstance(per_rank, list) else [per_rank] * len(weights)
    starts = [sum(counts[:r]) for r in range(len(weights))]
    manifests = []
    for r, w in enumerate(weights):
        shard = tuple(ids[starts[r] : starts[r] + counts[r]])
        m = ShardManifest("t", r, len(weights), "peripheral", w, 0, shard)
        manifests.append(str(m.write(tmp_path / "shards")))
    job = TrainJob(
        # One padded micro-batch per step unless a test says otherwise (the tests count steps
        # in per_device_batch_size samples).
        settings=TrainSettings(
            max_length=64,
            **{
                "gradient_accumulation_steps": 1,
                "learning_rate": 5e-5,
                "packing": False,
                **settings,
            },
        ),
        model_path=str(model_dir),
        instructions_uri=table.uri,
        instructions_version=table.version,
        manifests=manifests,
        output_dir=str(tmp_path / "ckpt"),
    )
    job.dump(tmp_path / "train.json")
    return job, table


# --- Evaluation results made by hand -----------------------------------------------------------


def evaluation_result(name, group, selector, ratio, losses, train, selection, current=False):
    """A :class:`~cluster_pipeline.evaluation.report.ModelResult` of per-sample held-out
    losses ``losses`` (nats/token, 10 response tokens each), without a model."""
    import numpy as np

    from cluster_pipeline.evaluation.report import ModelResult
    from cluster_pipeline.evaluation.suites import ItemScores

    ids = [f"s{i}" for i in range(len(losses))]
    return ModelResult(
        name,
        group,
        "p",
        {"heldout_loss": float(np.mean(losses))},
        {"heldout_loss": ItemScores(ids, [10.0] * len(ids), list(losses))},
        selector,
        ratio,
        train,
        selection,
        1.0 if selector == "full" else ratio,
        current=current,
    )


def evaluation_results() -> list:
    """Hand-made results of a comparison: the base model, peripheral r=0.5 (two runs, the
    first current; 10 + 40 and 12 + 44 selection + training seconds), random_global r=0.5
    (1 + 42 s) and full data (100 s), on 60 held-out samples."""
    import numpy as np

    rng = np.random.default_rng(3)
    base = 1.5 + rng.normal(0, 0.2, 60)
    return [
        evaluation_result("base", "base", None, None, base, None, None),
        evaluation_result(
            "p0", "peripheral r=0.5", "peripheral", 0.5, base - 0.3, 40.0, 10.0, current=True
        ),
        evaluation_result("p1", "peripheral r=0.5", "peripheral", 0.5, base - 0.31, 44.0, 12.0),
        evaluation_result("g0", "random_global r=0.5", "random_global", 0.5, base - 0.3, 42.0, 1.0),
        evaluation_result("f0", "full r=1.0", "full", 1.0, base - 0.35, 100.0, 0.0),
    ]

"""All seven assets materialized in-process on a tiny random model and a 60-sample dataset,
with torchrun at 2 processes for training. Asserts on the tables the stages wrote, and on the
MLflow runs they tracked."""

import json
import logging
import math
import re
import socket
from collections import Counter
from pathlib import Path

import dagster as dg
import numpy as np
import polars as pl
import pytest

from cluster_pipeline.data.formats import normalise_record
from cluster_pipeline.data.tokenization import SequenceSettings, encode_rows
from cluster_pipeline.defs.partitions import DATASETS
from cluster_pipeline.selection.sharding import ShardManifest
from cluster_pipeline.storage.layout import DataLayout
from cluster_pipeline.tracking.tracker import local_store
from cluster_pipeline.training.checkpointing import read_metrics
from cluster_pipeline_tests.helpers import (
    CHATML_TOOLS,
    FORGETFUL,
    RUN_CONFIG,
    build_model,
    build_tokenizer,
    materialize_partition,
    meta,
    pipeline_assets,
    read,
    resources,
    run_config_for,
    seed_embeddings,
    step_failure,
    tiny_records,
    write_jsonl,
)

ASSETS = pipeline_assets()


@pytest.mark.slow
def test_all_seven_assets_on_a_tiny_model(tiny_data_dir, tiny_model_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    # Tracked in the data folder's own MLflow store, the default without $MLFLOW_TRACKING_URI
    # (tracking_uri "": on, no URI of its own), in a data folder where it does not exist yet.
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    store = local_store(DataLayout.at(tiny_data_dir))
    assert not Path(store.uri.removeprefix("sqlite:///")).parent.exists()
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(DATASETS, ["tiny"])
        result = materialize_partition(
            ASSETS,
            instance,
            resources(tiny_data_dir, tiny_model_dir, tracking_uri=""),
            run_config=RUN_CONFIG,
        )
        assert result.success

        raw = read(instance, "raw_instructions")
        assert raw.height == 60 and (raw["split"] == "heldout").sum() == 6
        train_ids = set(raw.filter(pl.col("split") == "train")["sample_id"])

        emb = read(instance, "proxy_embeddings")
        assert set(emb["sample_id"]) == train_ids
        norms = np.linalg.norm(np.stack(emb["embedding_normalised"].to_list()), axis=1)
        np.testing.assert_allclose(norms, 1.0, rtol=1e-5)

        clusters = read(instance, "balanced_clusters")
        sizes = np.bincount(clusters["cluster"].to_numpy(), minlength=2)
        assert sizes.sum() == 54 and sizes.max() <= 36  # cap = ceil(1.3 * 54 / 2)

        subsets = read(instance, "peripheral_subsets")
        selected = subsets.filter(pl.col("selected"))
        # Token balance: each cluster keeps its farthest samples up to floor(0.5 x the smallest
        # cluster's tokens), less than one sample short of it.
        joined = subsets.join(emb.select("sample_id", "n_tokens", "n_response_tokens"), "sample_id")
        totals = joined.group_by("cluster").agg(pl.col("n_tokens_right").sum()).sort("cluster")
        budget = int(0.5 * int(totals["n_tokens_right"].to_numpy().min()))
        kept = (
            joined.filter(pl.col("selected"))
            .group_by("cluster")
            .agg(pl.col("n_tokens_right").sum(), pl.col("n_tokens_right").max().alias("longest"))
        )
        for tokens, longest in kept.select("n_tokens_right", "longest").iter_rows():
            assert budget - 64 < tokens <= budget and longest <= 64
        # Peripheral: every kept sample is at least as far as every dropped one in its cluster.
        for c in range(2):
            cl = subsets.filter(pl.col("cluster") == c)
            kept = cl.filter(pl.col("selected"))["sq_distance"]
            dropped = cl.filter(~pl.col("selected"))["sq_distance"]
            assert dropped.len() == 0 or kept.to_numpy().min() >= dropped.to_numpy().max()

        shards = read(instance, "shard_manifests")
        # Every selected sample appears in exactly one shard.
        assert Counter(shards["sample_id"]) == Counter(selected["sample_id"])
        # Shard tokens differ by less than the longest sample.
        per_rank = shards.join(emb.select("sample_id", "n_tokens"), "sample_id").group_by("rank")
        rank_tokens = per_rank.agg(pl.col("n_tokens").sum())["n_tokens"].to_list()
        assert max(rank_tokens) - min(rank_tokens) < 64
        # Weights are K R_c / R, R_c the response tokens of cluster c (token balance).
        r_c = (
            joined.group_by("cluster").agg(pl.col("n_response_tokens_right").sum()).sort("cluster")
        )["n_response_tokens_right"].to_numpy()
        weights = r_c * 2 / r_c.sum()
        for rank, weight in shards.group_by("rank").agg(pl.col("weight").first()).iter_rows():
            assert weight == pytest.approx(weights[rank])
        shard_meta = meta(instance, "shard_manifests")
        manifests = [ShardManifest.read(Path(p)) for p in shard_meta["manifest_paths"]]
        assert [m.sha256 for m in manifests] == list(shard_meta["manifest_sha256"])

        ckpt = Path(str(meta(instance, "trained_checkpoint")["checkpoint_path"]))
        model = AutoModelForCausalLM.from_pretrained(ckpt)
        assert model.config.hidden_size == 32
        info = json.loads((ckpt / "training_info.json").read_text())
        assert [m["sha256"] for m in info["manifests"]] == [m.sha256 for m in manifests]
        assert info["world_size"] == 2
        # The weights the ranks applied are the clusters' w_c, recorded at every stage: the
        # clustering's w_c = n_c K / N, the token-balanced subset's K R_c / R.
        assert meta(instance, "balanced_clusters")["cluster_weights"] == pytest.approx(
            [sizes[r] * 2 / 54 for r in range(2)]
        )
        assert info["rank_weights"] == pytest.approx(weights, rel=1e-6)
        assert list(meta(instance, "trained_checkpoint")["rank_weights"]) == pytest.approx(weights)
        # Packed batches, and where the compute went.
        assert info["packed"] is True and 0.5 < info["useful_compute_fraction"] <= 1.0
        # Shown rounded: 4 digits for fractions and losses, 2 for seconds.
        shown = meta(instance, "trained_checkpoint")
        assert shown["useful_compute_fraction"] == round(info["useful_compute_fraction"], 4)
        assert shown["final_loss"] == round(info["final_loss"], 4)

        report = meta(instance, "eval_report")
        assert report["base/heldout_loss"] > 0 and report["tuned/heldout_loss"] > 0
        assert 0.0 <= report["tuned/humaneval_pass@1"] <= 1.0
        assert Path(str(report["report_path"])).read_text().startswith("## eval_report")
        # Memory (issue 44): each stage that loads a model records its pre-launch estimate and
        # the peak its ranks measured (VmHWM of each torchrun rank, of the evaluating process);
        # the estimate lands within 20 % of the largest, the bound it is calibrated to
        # (SmolLM2's figures, benchmarks/memory_estimate.py), or within 0.25 GiB: on this tiny
        # model ~90 % of a rank's peak is the interpreter, torch and transformers, whose size
        # is the machine's (0.50 GiB on the development machine, 0.62 on CI's, 2026-12-05).
        peaks = {
            "trained_checkpoint": [b / 2**30 for b in info["peak_rss_bytes_per_rank"]],
        }
        for stage in ("proxy_embeddings", "trained_checkpoint", "eval_report"):
            shown = meta(instance, stage)
            measured = list(shown["measured_memory_per_rank_gib"])
            assert len(measured) == (2 if stage == "trained_checkpoint" else 1)
            if stage in peaks:  # the metadata gives what the ranks wrote, rounded
                assert measured == pytest.approx(peaks[stage], abs=0.005)
            estimate = shown["estimated_memory_per_rank_gib"]
            slack = max(0.2 * estimate, 0.25)
            assert abs(max(measured) - estimate) <= slack, (stage, shown["memory_per_rank"])
        checks = result.get_asset_check_evaluations()
        assert {c.check_name for c in checks} == {"capacity", "equal_shards", "coverage", "weights"}
        assert all(c.passed for c in checks)
        # Quiet logs: no rank prints transformers' weight-loading bars, torchrun's
        # OMP_NUM_THREADS banner or a library warning, and the report reaches the run's log as
        # one line.
        rank_logs = [p for p in tiny_data_dir.rglob("*.log") if ".logs" in str(p)]
        assert len(rank_logs) >= 6  # stdout and stderr of the embedding pass's and training's ranks
        noisy = [
            p
            for p in rank_logs
            if re.search("Loading weights|OMP_NUM_THREADS|Warning", p.read_text())
        ]
        assert noisy == []
        messages = [
            e.user_message for e in instance.all_logs(result.run_id) if e.step_key == "eval_report"
        ]
        # The headline as plain text (no Markdown in a log, issue 44), the path on its own line.
        headline = [m for m in messages if m.startswith("Net time saved")]
        assert len(headline) == 1 and "\n" not in headline[0] and "**" not in headline[0]
        reported = [m for m in messages if m.startswith("report: ")]
        assert reported == [f"report: {tiny_data_dir / 'reports' / 'tiny' / 'eval_report.md'}"]
        assert not [m for m in messages if "### Comparisons" in m]
        _assert_tracked(store.uri, result.run_id, instance, ckpt, weights)


def _assert_tracked(uri: str, dagster_run: str, instance, ckpt: Path, weights) -> None:
    """The Dagster run is one MLflow pipeline run of the data folder's store, the selection,
    the checkpoint and the evaluation its children: tags, params, every step's metrics as rank
    0 logged them (one point per step: no other rank logs), dataset inputs, the evaluation, the
    artifacts and the whole run's config."""
    import yaml
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("cluster_pipeline")
    assert experiment is not None
    every = client.search_runs([experiment.experiment_id])
    [parent] = [r for r in every if r.data.tags.get("cluster_pipeline.run") == "pipeline"]
    runs = {r.data.tags["dagster_asset"]: r for r in every if r is not parent}
    assert set(runs) == {"peripheral_subsets", "trained_checkpoint", "eval_report"}
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["dagster_run_id"] == dagster_run
    for run in runs.values():
        assert run.info.status == "FINISHED"
        assert run.data.tags["dagster_run_id"] == dagster_run
        assert run.data.tags["dagster_partition"] == "tiny"
        assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert (
            run.data.tags["mlflow.source.git.commit"]
            == parent.data.tags["mlflow.source.git.commit"]
        )
    for asset in ("peripheral_subsets", "trained_checkpoint"):
        assert runs[asset].data.tags["selector"] == "peripheral"
    # The whole run's config, every stage's, on the pipeline run.
    saved = client.download_artifacts(parent.info.run_id, "run_config.yaml", str(ckpt.parent))
    logged = yaml.safe_load(Path(saved).read_text())
    assert list(logged["ops"]) == [a.key.to_user_string() for a in ASSETS]
    for asset in ("raw_instructions", "proxy_embeddings", "balanced_clusters", "shard_manifests"):
        assert logged["ops"][asset]["config"] == meta(instance, asset)["config"], asset
    assert logged["ops"]["eval_report"]["config"] == meta(instance, "eval_report")["config"]

    train = runs["trained_checkpoint"]
    assert train.data.tags["checkpoint_folder"] == str(ckpt)
    assert meta(instance, "trained_checkpoint")["mlflow_run_id"] == train.info.run_id
    params = train.data.params
    assert {k: params[k] for k in ("selector", "ratio", "K", "alpha", "balance")} == {
        "selector": "peripheral",
        "ratio": "0.5",
        "K": "2",
        "alpha": "1.3",
        "balance": "tokens",
    }
    assert json.loads(params["rank_weights"]) == pytest.approx(weights, rel=1e-5)
    # Every earlier stage's config as params, and the training's dataset inputs: the pool and
    # the selection, named by the manifest set's hash.
    assert params["proxy_embeddings.max_length"] == "64"
    assert params["balanced_clusters.alpha"] == "1.3"
    assert train.inputs is not None
    inputs = {
        {t.key: t.value for t in d.tags}["mlflow.data.context"]: d.dataset
        for d in train.inputs.dataset_inputs
    }
    shards = meta(instance, "shard_manifests")
    assert inputs["training"].digest == shards["manifest_set_sha256"][:32]
    assert inputs["pool"].name == "tiny pool"
    assert (params["learning_rate"], params["max_length"], params["packing"]) == (
        "0.001",
        "64",
        "True",
    )
    # Per step, exactly what the loop wrote to its metrics file.
    steps = read_metrics(ckpt)
    n = len(steps)
    assert n >= 2

    def history(key: str) -> list[tuple[int, float]]:
        return [(m.step, m.value) for m in client.get_metric_history(train.info.run_id, key)]

    for rank in range(2):
        assert history(f"loss/rank_{rank}") == [
            (h["step"], pytest.approx(h["loss_per_rank"][rank], rel=1e-12)) for h in steps
        ]
    assert history("useful_compute_fraction") == [
        (h["step"], pytest.approx(h["useful_compute_fraction"], rel=1e-12)) for h in steps
    ]
    assert [v for _, v in history("useful_compute_fraction")] == pytest.approx(
        [sum(h["real_tokens_per_rank"]) / (2 * max(h["padded_tokens_per_rank"])) for h in steps]
    )
    assert history("real_tokens_per_second") == [
        (h["step"], pytest.approx(sum(h["real_tokens_per_rank"]) / h["step_seconds"]))
        for h in steps
    ]
    # The learning rate by hand: 1e-3 peak, linear warm-up over int(0.1 n) steps, then cosine;
    # step k (1-based) trains at the schedule's value for index k - 1 (the first step at the
    # peak when there is no warm-up, the last one above 0).
    warmup = int(0.1 * n)

    def lr(k: int) -> float:
        if k < warmup:
            return 1e-3 * (k + 1) / warmup
        return 1e-3 * 0.5 * (1 + math.cos(math.pi * min(1.0, (k - warmup) / max(1, n - warmup))))

    assert history("learning_rate") == [
        (k, pytest.approx(lr(k - 1), abs=1e-12)) for k in range(1, n + 1)
    ]
    assert len(history("grad_norm")) == n and all(v > 0 for _, v in history("grad_norm"))
    # eval_report added the evaluation and the report to the checkpoint's run.
    report = meta(instance, "eval_report")
    metrics = client.get_run(train.info.run_id).data.metrics
    assert metrics["eval/tuned/heldout_loss"] == report["tuned/heldout_loss"]
    assert metrics["eval/base/heldout_loss"] == report["base/heldout_loss"]
    assert metrics["summary/steps"] == n
    files = {
        a.path
        for folder in ("plots", "eval_report")
        for a in client.list_artifacts(train.info.run_id, folder)
    }
    assert {"plots/loss_per_rank.png", "plots/useful_compute.png"} <= files
    assert {"eval_report/eval_report.md", "eval_report/eval_report.json"} <= files
    assert any(f.startswith("eval_report/") and f.endswith(".png") for f in files)
    assert "training_info.json" in {a.path for a in client.list_artifacts(train.info.run_id)}

    evaluation = runs["eval_report"]
    assert evaluation.data.metrics["eval/tuned/heldout_loss"] == report["tuned/heldout_loss"]
    assert evaluation.data.tags["checkpoint_run_id"] == train.info.run_id
    assert evaluation.inputs is not None
    [heldout] = evaluation.inputs.dataset_inputs
    held_out = meta(instance, "raw_instructions")["heldout_samples"]
    assert json.loads(heldout.dataset.profile or "{}")["num_rows"] == held_out > 0

    selection = runs["peripheral_subsets"]
    subsets = meta(instance, "peripheral_subsets")
    assert selection.data.params["selector"] == "peripheral"
    assert selection.data.params["K"] == "2"
    for key in ("data_fraction", "gradient_diversity", "forward_passes", "selection_seconds"):
        assert selection.data.metrics[key] == pytest.approx(subsets[key]), key
    assert [a.path for a in client.list_artifacts(selection.info.run_id, "plots")] == [
        "plots/pca_map_selected.png"
    ]


@pytest.mark.slow
def test_a_broken_manifest_fails_the_asset_before_torchrun(
    tiny_data_dir, tiny_model_dir, tiny_embedding_cache
):
    """A manifest that is no longer a manifest is refused by the pre-flight check, naming the
    file and the next step, before any rank starts. (A rank that fails inside torchrun fails
    the asset with its error: test_killed_processes kills rank 1 of a real training.)"""
    seed_embeddings(tiny_embedding_cache, tiny_data_dir)
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(DATASETS, ["tiny"])
        ok = materialize_partition(ASSETS[:5], instance, resources(tiny_data_dir, tiny_model_dir))
        assert ok.success
        before = read(instance, "shard_manifests")
        path = Path(meta(instance, "shard_manifests")["manifest_paths"][1])
        path.write_text(path.read_text().replace('"weight"', '"weight_typo"', 1))
        failed = materialize_partition(
            [ASSETS[5]], instance, resources(tiny_data_dir, tiny_model_dir), raise_on_error=False
        )
        assert not failed.success
        description, metadata = step_failure(failed)
        assert description == (
            f"dataset 'tiny': {path}: not a shard manifest (TypeError(\"ShardManifest.__init__() "
            "got an unexpected keyword argument 'weight_typo'\")); materialize shard_manifests "
            "again"
        )
        assert "rank_1" not in metadata  # no rank ran
        # Earlier tables are intact and readable.
        assert read(instance, "shard_manifests").equals(before)


@pytest.mark.slow
def test_downstream_stages_read_the_versions_their_inputs_were_built_from(
    tiny_data_dir, tiny_model_dir, tiny_embedding_cache
):
    """Re-running raw_instructions (another split: other training samples) and
    proxy_embeddings after the chain was built must not leak into later stages run alone:
    the PCA map reads the embeddings that were clustered, and training reads the
    raw_instructions version the manifests were selected from (the newest one lacks some of
    their samples, so reading it would fail). The MLflow server these runs track to is down:
    each tracked step warns once, naming it, and goes on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{s.getsockname()[1]}"
    seed_embeddings(tiny_embedding_cache, tiny_data_dir)
    res = resources(tiny_data_dir, tiny_model_dir, tracking_uri=down)
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(DATASETS, ["tiny"])
        assert materialize_partition(ASSETS[:5], instance, res).success
        built_from = meta(instance, "shard_manifests")
        first_raw = read(instance, "raw_instructions")
        assert materialize_partition(
            ASSETS[:2],
            instance,
            res,
            run_config=run_config_for(ASSETS[:2], raw_instructions={"seed": 1}),
        ).success
        newest_raw = read(instance, "raw_instructions")
        assert set(first_raw.filter(pl.col("split") == "train")["sample_id"]) != set(
            newest_raw.filter(pl.col("split") == "train")["sample_id"]
        )
        assert meta(instance, "proxy_embeddings")["table_version"] == 1

        rerun = materialize_partition(ASSETS[3:6], instance, res)
        assert rerun.success
        warnings = [
            (e.step_key, e.user_message)
            for e in instance.all_logs(rerun.run_id)
            if e.level == logging.WARNING and "MLflow" in e.user_message
        ]
        assert [step for step, _ in warnings] == ["peripheral_subsets", "trained_checkpoint"]
        assert all(down in message for _, message in warnings)
        assert "mlflow_run_id" not in meta(instance, "trained_checkpoint")
        inputs = meta(instance, "peripheral_subsets")["inputs"]
        assert inputs["proxy_embeddings"]["version"] == 0
        assert inputs["raw_instructions"]["version"] == 0
        assert meta(instance, "shard_manifests")["inputs"] == {
            **built_from["inputs"],
            "peripheral_subsets": {
                "uri": built_from["inputs"]["peripheral_subsets"]["uri"],
                "version": 1,
            },
        }
        ckpt = Path(str(meta(instance, "trained_checkpoint")["checkpoint_path"]))
        info = json.loads((ckpt / "training_info.json").read_text())
        assert info["config"]["instructions_version"] == 0
        assert info["config"]["provenance"]["proxy_embeddings_version"] == 0


def _forms_dataset(folder: Path) -> None:
    """Twelve samples in each of five forms, spread over JSONL, JSON, Parquet shards and a
    `datasets.save_to_disk` folder, with a fields.json mapping for the user's own fields."""
    datasets = pytest.importorskip("datasets", reason="the test extra installs `datasets`")
    folder.mkdir(parents=True)
    (folder / "fields.json").write_text('{"question": "instruction", "answer": "output"}')
    write_jsonl(
        folder / "own_fields.jsonl",
        [{"question": f"Add {i} and {i}.", "answer": f"{2 * i}."} for i in range(12)],
    )
    write_jsonl(
        folder / "trl.jsonl",
        [
            {"prompt": f"Reverse {w}{i}.", "completion": f"{w[::-1]}{i}"}
            for i, w in enumerate(["abc", "dog", "cat", "sun"] * 3)
        ]
        + [
            {
                "prompt": [{"role": "user", "content": f"Double {i}."}],
                "completion": [{"role": "assistant", "content": f"{2 * i}"}],
            }
            for i in range(12)
        ],
    )
    (folder / "chats.json").write_text(
        json.dumps(
            [
                {
                    "conversations": [
                        {"from": "human", "value": f"Hi {i}"},
                        {"from": "gpt", "value": "Hello."},
                        {"from": "human", "value": f"What is {i} plus 1?"},
                        {"from": "gpt", "value": f"{i + 1}."},
                    ]
                }
                for i in range(12)
            ]
        )
    )
    (folder / "lm").mkdir()
    for k in range(2):
        pl.DataFrame(
            {"text": [f"def f{k}{i}():\n    return {i}\n" for i in range(6)]}
        ).write_parquet(folder / "lm" / f"train-{k:05d}-of-00002.parquet")
    datasets.Dataset.from_list(
        [{"instruction": f"Say {w}.", "output": w} for w in [f"w{i}" for i in range(12)]]
    ).save_to_disk(str(folder / "hf"))


@pytest.mark.slow
def test_every_form_trains_end_to_end(tmp_path, tiny_model_dir, tiny_tokenizer):
    data = tmp_path / "data"
    _forms_dataset(data / "raw" / "forms")
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(DATASETS, ["forms"])
        result = materialize_partition(
            ASSETS,
            instance,
            resources(data, tiny_model_dir),
            run_config=RUN_CONFIG,
            partition="forms",
        )
        assert result.success
        raw = read(instance, "raw_instructions", "forms")
        assert Counter(raw["form"]) == {
            "alpaca": 24,
            "prompt_completion": 12,
            "prompt_completion_chat": 12,
            "sharegpt": 12,
            "text": 12,
        }
        records = meta(instance, "raw_instructions", "forms")["records_per_file"]
        assert records["own_fields.jsonl"] == 12 and records["lm/train-00001-of-00002.parquet"] == 6
        emb = read(instance, "proxy_embeddings", "forms")
        assert emb["skip_reason"].null_count() == emb.height  # every sample embedded
        # A two-answer dialogue is embedded over both answers: its response-token count is the
        # labels of the conversation encoded directly.
        train = raw.filter(pl.col("split") == "train")
        chats = train.filter(pl.col("form") == "sharegpt")
        expected = encode_rows(tiny_tokenizer, chats, SequenceSettings(max_length=64))
        got = chats.join(emb, on="sample_id", how="left")["n_response_tokens"].to_list()
        assert got == [e.n_response_tokens for e in expected]
        two_answers = [
            [t for t, lab in zip(e.input_ids, e.labels, strict=True) if lab != -100]
            for e in expected
        ]
        assert all(tiny_tokenizer.decode(ids).startswith("Hello.<|im_end|>") for ids in two_answers)
        assert Path(str(meta(instance, "trained_checkpoint", "forms")["checkpoint_path"])).is_dir()
        report = Path(str(meta(instance, "eval_report", "forms")["report_path"])).read_text()
        assert "Held-out split: 8 samples" in report  # ceil(0.1 * 72)


@pytest.mark.slow
def test_a_template_that_cannot_split_turns_fails_naming_dataset_and_sample(tmp_path):
    tok = build_tokenizer(chat_template=FORGETFUL)
    model_dir = tmp_path / "model"
    build_model(len(tok), pad_token_id=tok.pad_token_id).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    data = tmp_path / "data"
    dialogue = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Bye."},
    ]
    write_jsonl(data / "raw" / "chats" / "c.jsonl", [{"messages": dialogue}] + tiny_records(20))
    assets = ASSETS[:2]
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(DATASETS, ["chats"])
        failed = materialize_partition(
            assets, instance, resources(data, model_dir), partition="chats", raise_on_error=False
        )
        assert not failed.success
        description, _ = step_failure(failed)
        sid = normalise_record({"messages": dialogue}, "c.jsonl", 1).sample_id
        assert description.startswith("dataset 'chats', cluster_pipeline.recipes.embed: ")
        source = data / "raw" / "chats" / "c.jsonl"
        assert (
            f"sample {sid} ({source}:1): the chat template does not render assistant turn 1"
            in description
        )
        assert "response_turns='last'" in description


def _tool_records(n: int) -> list[dict]:
    """Glaive / LLaMA-Factory tool-calling records: a call, its result, the answer."""
    tools = json.dumps([{"name": "square", "parameters": {"type": "object"}}])
    return [
        {
            "conversations": [
                {"from": "human", "value": f"Square {i}?"},
                {"from": "function_call", "value": f'{{"name": "square", "arguments": {i}}}'},
                {"from": "observation", "value": str(i * i)},
                {"from": "gpt", "value": f"{i * i}."},
            ],
            "tools": tools,
        }
        for i in range(n)
    ]


@pytest.mark.slow
def test_tools_reach_the_template_or_fail_naming_the_sample(tmp_path, tiny_model_dir):
    tok = build_tokenizer(chat_template=CHATML_TOOLS)
    model_dir = tmp_path / "model"
    build_model(len(tok), pad_token_id=tok.pad_token_id).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    data = tmp_path / "data"
    source = data / "raw" / "tools" / "glaive.jsonl"
    write_jsonl(source, _tool_records(6) + tiny_records(14))
    assets = ASSETS[:2]
    config = run_config_for(assets, proxy_embeddings={"max_length": 512})
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(DATASETS, ["tools"])
        ok = materialize_partition(
            assets, instance, resources(data, model_dir), run_config=config, partition="tools"
        )
        assert ok.success
        train = read(instance, "raw_instructions", "tools").filter(pl.col("split") == "train")
        with_tools = train.filter(pl.col("tools").is_not_null())
        assert with_tools.height > 0
        emb = read(instance, "proxy_embeddings", "tools")
        expected = encode_rows(tok, with_tools, SequenceSettings(max_length=512))
        got = with_tools.join(emb, on="sample_id", how="left")["n_response_tokens"].to_list()
        assert got == [e.n_response_tokens for e in expected]
        assert all(e.skip_reason is None for e in expected)
        # The tiny model's plain ChatML template has no place for tools: the embedding step
        # fails naming the first such sample of the training split and its source line.
        failed = materialize_partition(
            assets,
            instance,
            resources(data, tiny_model_dir),
            run_config=config,
            partition="tools",
            raise_on_error=False,
        )
        assert not failed.success
        description, _ = step_failure(failed)
        first = with_tools.row(0, named=True)
        assert description.startswith("dataset 'tools', cluster_pipeline.recipes.embed: ")
        assert (
            f"sample {first['sample_id']} ({source}:{first['source_line']}): the chat template "
            "does not render tools" in description
        )

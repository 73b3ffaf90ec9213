"""MLflow as its users look at a pipeline run: one parent run per Dagster run with the stages'
runs as children, the source (git commit) and every stage's config as params, the pool and
the selection as dataset inputs with content digests, and the whole run's config as
``run_config.yaml``, which ``cluster-pipeline rerun`` runs again to the same selection.

The slow test materializes the selection chain (raw_instructions -> shard_manifests) on the tiny
dataset and model with tracking into the data folder's own store, then reruns the logged config
through the command line (``dagster job execute`` of ``selection_job`` in a subprocess)."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from pathlib import Path

import dagster as dg
import pytest
import yaml

from cluster_pipeline.cli import UserError
from cluster_pipeline.cli.rerun import dagster_command, read_run_config
from cluster_pipeline.defs.configs import repeatable_config
from cluster_pipeline.storage.layout import PROJECT_ROOT
from cluster_pipeline_tests.helpers import (
    materialize_partition,
    meta,
    pipeline_assets,
    resources,
    run_config_for,
    seed_embeddings,
    tiny_records,
    write_jsonl,
)

SELECTION = ["raw_instructions", "proxy_embeddings", "balanced_clusters"]
SELECTION += ["peripheral_subsets", "shard_manifests"]


def _write(tmp_path: Path, config: object) -> Path:
    path = tmp_path / "run_config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_rerun_runs_the_job_whose_stages_the_config_names(tmp_path):
    every = ["raw_instructions", *SELECTION[1:], "trained_checkpoint", "eval_report"]
    for stages, job in ((every, "main_job"), (SELECTION, "selection_job")):
        path = _write(tmp_path, {"ops": {s: {"config": {}} for s in stages}})
        command = dagster_command(read_run_config(path), path, "tiny")
        assert command[1:] == [
            *["job", "execute", "-m", "cluster_pipeline.definitions", "-j", job],
            *["-c", str(path), "--tags", '{"dagster/partition": "tiny"}'],
        ]
    path = _write(tmp_path, {"ops": {"peripheral_subsets": {}, "shard_manifests": {}}})
    assert dagster_command(read_run_config(path), path, "my set")[1:] == [
        *["asset", "materialize", "-m", "cluster_pipeline.definitions"],
        *["--partition", "my set", "--select", "peripheral_subsets,shard_manifests"],
        *["-c", str(path)],
    ]


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("ops: [", "is not valid YAML"),
        ("- 1\n", "is not a run config (a YAML mapping with `ops:`)"),
        ("ops: {}\n", "names no stage under `ops:`"),
        ("ops: {trained: {}}\n", "'trained' under `ops:` is not a stage of the pipeline"),
        ("opps: {}\n", "'opps' is not a run config key"),
        # A stage's knobs, checked before Dagster starts (issue 44's trial: a misspelled knob
        # got a 60-line traceback and `rerun --dry-run` accepted it).
        (
            "ops: {peripheral_subsets: {config: {selecter: ifd, ratio: 0.5}}}\n",
            "ops.peripheral_subsets.selecter (did you mean 'selector'?): not a knob of the "
            "pipeline; correct the name",
        ),
        (
            "ops: {peripheral_subsets: {config: {ratio: 2.0}}}\n",
            "peripheral_subsets.ratio = 2.0: Input should be less than or equal to 1",
        ),
        (
            "ops: {peripheral_subsets: {config: {selector: peripherl}}}\n",
            "peripheral_subsets.selector = 'peripherl': Input should be 'peripheral', ",
        ),
        ("ops: {proxy_embeddings: {confg: {}}}\n", "ops.proxy_embeddings must be `config:`"),
    ],
)
def test_rerun_refuses_what_is_not_a_run_config_of_the_pipeline(tmp_path, text, why):
    path = tmp_path / "run_config.yaml"
    path.write_text(text)
    with pytest.raises(UserError, match=re.escape(why)):
        read_run_config(path)
    with pytest.raises(UserError, match="is not a file"):
        read_run_config(tmp_path / "nowhere.yaml")


def _ids_sha256(ids: list[str]) -> str:
    """The pool's content digest, by hand: the column name, then one JSON line per sorted
    sample id (storage/provenance.py rows_sha256's canonical form)."""
    h = hashlib.sha256(json.dumps(["sample_id"]).encode())
    for sid in sorted(ids):
        h.update(f'{{"sample_id":"{sid}"}}\n'.encode())
    return h.hexdigest()


@pytest.mark.slow
def test_a_pipeline_run_is_a_parent_run_whose_logged_config_runs_again(
    tmp_path, tiny_model_dir, tiny_embedding_cache, monkeypatch
):
    from mlflow import MlflowClient

    from cluster_pipeline.defs.partitions import DATASETS
    from cluster_pipeline.storage.layout import DataLayout
    from cluster_pipeline.tracking.tracker import local_store

    data, home = tmp_path / "data", tmp_path / "home"
    write_jsonl(data / "raw" / "tiny" / "samples.jsonl", tiny_records(60))
    seed_embeddings(tiny_embedding_cache, data)
    home.mkdir()
    chain = pipeline_assets()[:5]
    config = run_config_for(chain, peripheral_subsets={"ratio": 0.4})
    with dg.DagsterInstance.from_config(str(home)) as instance:
        instance.add_dynamic_partitions(DATASETS, ["tiny"])
        res = resources(data, tiny_model_dir, tracking_uri="")  # the data folder's own store
        result = materialize_partition(chain, instance, res, run_config=config)
        assert result.success
        records = {s: meta(instance, s) for s in SELECTION}

    client = MlflowClient(tracking_uri=local_store(DataLayout.at(data)).uri)
    experiment = client.get_experiment_by_name("cluster_pipeline")
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id])
    [parent] = [r for r in runs if r.data.tags.get("cluster_pipeline.run") == "pipeline"]
    [selection] = [r for r in runs if r.data.tags.get("dagster_asset") == "peripheral_subsets"]
    assert len(runs) == 2
    # One parent per Dagster run, the stage's run its child; both ended.
    assert parent.data.tags["dagster_run_id"] == result.run_id
    assert selection.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert parent.info.status == selection.info.status == "FINISHED"
    # The source: the git commit of this work tree.
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=PROJECT_ROOT
    ).stdout.strip()
    for run in (parent, selection):
        assert run.data.tags["mlflow.source.git.commit"] == commit
    assert selection.data.tags["mlflow.source.name"] == "cluster_pipeline peripheral_subsets"
    # Every earlier stage's config and the base model as params.
    params = selection.data.params
    assert params["raw_instructions.heldout_fraction"] == "0.1"
    assert params["proxy_embeddings.max_length"] == "64"
    assert params["balanced_clusters.alpha"] == "1.3"
    assert params["ratio"] == "0.4"
    assert params["base_model"] == str(tiny_model_dir)
    # ... and its identity that travels: the folder's name and its weights' hash, no path.
    weights = hashlib.sha256((tiny_model_dir / "model.safetensors").read_bytes()).hexdigest()
    assert params["base_model_id"] == (
        f"`{tiny_model_dir.name}` (a local folder): `model.safetensors` sha256 `{weights}`"
    )
    # The pool as the selection's dataset input, its digest the content hash of its ids.
    assert selection.inputs is not None
    [given] = selection.inputs.dataset_inputs
    subsets = records["peripheral_subsets"]
    import polars as pl

    pool = pl.read_delta(str(subsets["table_uri"]), version=int(subsets["table_version"]))
    assert given.dataset.digest == _ids_sha256(pool["sample_id"].to_list())[:32]
    assert given.dataset.name == "tiny pool"
    assert (
        json.loads(given.dataset.profile or "{}")["num_rows"] == pool.height == subsets["pool_size"]
    )
    assert {t.key: t.value for t in given.tags}["mlflow.data.context"] == "pool"

    # The whole run's config: every stage as its record says it ran, and the base model.
    saved = client.download_artifacts(parent.info.run_id, "run_config.yaml", str(tmp_path))
    text = Path(saved).read_text()
    assert "# Run it again: cluster-pipeline rerun run_config.yaml --dataset tiny\n" in text
    logged = yaml.safe_load(text)
    assert list(logged["ops"]) == SELECTION
    for stage in SELECTION[:-1]:  # (the selector's own knobs: the run checks refuse others)
        recorded = repeatable_config(stage, records[stage]["config"])
        assert logged["ops"][stage]["config"] == recorded, stage
    assert "s2l_steps" not in logged["ops"]["peripheral_subsets"]["config"]
    # shard_manifests ran after the selection's run: its config as launched, defaults filled.
    assert logged["ops"]["shard_manifests"]["config"] == {"seed": 0}
    assert records["shard_manifests"]["config"] == {"seed": 0}
    assert logged["resources"] == {"base_model": {"config": {"model": str(tiny_model_dir)}}}

    # Run it again from the command line: the same selection, to the manifest set hash.
    from cluster_pipeline.cli.main import main

    monkeypatch.setenv("DAGSTER_HOME", str(home))
    monkeypatch.setenv("CLUSTER_PIPELINE_DATA_DIR", str(data))
    main(["rerun", saved, "--dataset", "tiny"])
    with dg.DagsterInstance.from_config(str(home)) as instance:
        again = {s: meta(instance, s) for s in SELECTION}
    assert (
        again["shard_manifests"]["table_version"] == records["shard_manifests"]["table_version"] + 1
    )  # materialized again, not reused
    assert (
        again["shard_manifests"]["manifest_set_sha256"]
        == records["shard_manifests"]["manifest_set_sha256"]
    )
    for stage in SELECTION:
        assert again[stage]["config"] == records[stage]["config"], stage

"""The MLflow tracker against a real SQLite store in tmp_path (read back through MlflowClient),
and against a server that is down: one warning, no exception, every later call a no-op."""

import logging
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from cluster_pipeline.storage.layout import DataLayout
from cluster_pipeline.tracking.tracker import (
    TAG_CHECKPOINT,
    TAG_DAGSTER_RUN,
    TAG_PARTITION,
    MetricsSender,
    Store,
    Tracker,
    TrackingTarget,
    local_store,
    metric_key,
    param_value,
    resolve_store,
)

# One xdist worker runs this module: its module-scoped fixture starts once.
pytestmark = pytest.mark.xdist_group("tracker")


def _client(uri: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Store:
    """One SQLite store for the module (creating its tables takes seconds); each test writes
    its own experiment."""
    return local_store(DataLayout.at(tmp_path_factory.mktemp("data")))


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_local_store_lies_under_the_data_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    layout = DataLayout.at(tmp_path / "data")
    store = resolve_store("", layout)
    db = (tmp_path / "data" / "mlflow" / "mlflow.db").resolve()
    assert store == local_store(layout)
    assert store.uri == f"sqlite:///{db}"
    assert store.artifact_location == (db.parent / "artifacts").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking.example:5000")
    assert resolve_store("", layout).uri == "http://tracking.example:5000"
    assert resolve_store("", layout).artifact_location is None  # the server decides
    other = tmp_path / "elsewhere" / "runs.db"
    assert (
        resolve_store(f"sqlite:///{other}", layout).artifact_location
        == (other.parent / "artifacts").as_uri()
    )


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("loss", "loss"),
        ("loss/rank_1", "loss/rank_1"),
        ("humaneval_pass@1", "humaneval_pass_at_1"),
        ("tuned/heldout loss (nats)", "tuned/heldout loss _nats_"),
    ],
)
def test_metric_keys_are_what_mlflow_accepts(name, key):
    assert metric_key(name) == key


def test_param_values():
    assert param_value("peripheral") == "peripheral"
    assert param_value(0.5) == "0.5"
    assert param_value(None) == "None"
    assert param_value([1.0107, 0.9893]) == "[1.0107, 0.9893]"
    assert param_value({"a": 1}) == '{"a": 1}'
    assert len(param_value("x" * 7000)) == 6000


def test_a_run_logged_then_read_back(store, tmp_path):
    tracker = Tracker(store.uri, experiment="unit", artifact_location=store.artifact_location)
    run_id = tracker.start_run(
        "tiny peripheral",
        tags={TAG_DAGSTER_RUN: "abc-123", TAG_PARTITION: "tiny", TAG_CHECKPOINT: "/ckpt/x"},
        params={"learning_rate": 1e-3, "rank_weights": [1.25, 0.75], "lora_target_modules": None},
    )
    assert run_id is not None
    losses = [2.5, 2.0, 1.75]
    for step, loss in enumerate(losses, start=1):
        tracker.log_metrics(run_id, {"loss": loss, "loss/rank_0": loss + 0.5, "skip": None}, step)
    tracker.log_bytes(run_id, b"\x89PNG fake", "loss.png", "plots")
    report = tmp_path / "report.md"
    report.write_text("## eval_report\n")
    tracker.log_artifact(run_id, report)
    tracker.set_tags(run_id, {"late": 7})
    tracker.end_run(run_id)
    assert tracker.enabled

    client = _client(store.uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "tiny peripheral"
    assert run.data.params == {
        "learning_rate": "0.001",
        "rank_weights": "[1.25, 0.75]",
        "lora_target_modules": "None",
    }
    tags = run.data.tags
    assert (tags[TAG_DAGSTER_RUN], tags[TAG_PARTITION], tags[TAG_CHECKPOINT], tags["late"]) == (
        "abc-123",
        "tiny",
        "/ckpt/x",
        "7",
    )
    history = client.get_metric_history(run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(1, 2.5), (2, 2.0), (3, 1.75)]
    assert [m.value for m in client.get_metric_history(run_id, "loss/rank_0")] == [3.0, 2.5, 2.25]
    assert "skip" not in run.data.metrics
    # Artifacts land in the data folder's artifact folder, not ./mlruns of the working folder.
    assert str(run.info.artifact_uri).startswith(str(store.artifact_location))
    assert {a.path for a in client.list_artifacts(run_id)} == {"plots", "report.md"}
    local = Path(client.download_artifacts(run_id, "plots/loss.png", str(tmp_path)))
    assert local.read_bytes() == b"\x89PNG fake"
    # Another tracker (another process, in the pipeline) finds the run by its tags.
    again = Tracker(store.uri, experiment="unit")
    assert again.find_run({TAG_CHECKPOINT: "/ckpt/x"}) == run_id
    assert again.find_run({TAG_CHECKPOINT: "/ckpt/y"}) is None
    assert again.find_run({TAG_CHECKPOINT: "/ckpt/x", TAG_PARTITION: "other"}) is None
    assert Tracker(store.uri, experiment="never created").find_run({TAG_PARTITION: "tiny"}) is None


def test_rank_zero_logs_into_the_run_through_its_target(store):
    opener = Tracker(store.uri, experiment="rank0", artifact_location=store.artifact_location)
    run_id = opener.start_run("r", tags={})
    target = opener.target(run_id)
    assert run_id is not None and target is not None and target.run_id == run_id
    # Through JSON, as the job file carries it.
    rank0 = Tracker.for_target(TrackingTarget.model_validate_json(target.model_dump_json()))
    rank0.log_metrics(target.run_id, {"learning_rate": 1e-4}, step=3)
    (metric,) = _client(store.uri).get_metric_history(run_id, "learning_rate")
    assert (metric.step, metric.value) == (3, 1e-4)


def test_failed_runs_and_runs_of_two_trackers_in_one_process(store):
    a, b = Tracker(store.uri, experiment="two"), Tracker(store.uri, experiment="two")
    first, second = a.start_run("a", tags={}), b.start_run("b", tags={})
    assert first is not None and second is not None
    a.log_metrics(first, {"x": 1.0})
    b.log_metrics(second, {"x": 2.0})
    a.end_run(first, "FAILED")
    client = _client(store.uri)
    assert client.get_run(first).info.status == "FAILED"
    assert client.get_run(second).info.status == "RUNNING"
    assert client.get_run(first).data.metrics == {"x": 1.0}
    assert client.get_run(second).data.metrics == {"x": 2.0}


def test_a_server_that_is_down_warns_once_and_fails_nothing(tmp_path):
    warnings: list[str] = []
    uri = f"http://127.0.0.1:{_closed_port()}"
    tracker = Tracker(uri, warn=warnings.append)
    start = time.perf_counter()
    run_id = tracker.start_run("r", tags={TAG_PARTITION: "tiny"}, params={"a": 1})
    first_call = time.perf_counter() - start
    assert run_id is None and not tracker.enabled
    assert len(warnings) == 1
    assert uri in warnings[0] and "opening run 'r'" in warnings[0]
    assert "tracking_uri" in warnings[0] and "enabled: false" in warnings[0]
    # Every later call is a no-op, with a run id or without.
    tracker.log_metrics("some-run", {"loss": 1.0}, step=1)
    tracker.log_params("some-run", {"a": 1})
    tracker.set_tags("some-run", {"a": 1})
    tracker.log_bytes("some-run", b"x", "x.bin")
    tracker.end_run("some-run", "FAILED")
    assert tracker.find_run({TAG_PARTITION: "tiny"}) is None
    assert tracker.target("some-run") is None
    assert len(warnings) == 1
    # Printed so the report can quote it; MLflow's defaults (7 retries) take minutes here.
    print(f"first call to a closed port: {first_call:.3f} s")


def test_the_warning_goes_to_the_log_by_default_and_the_limits_are_set(caplog, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "7")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "120")
    tracker = Tracker(f"http://127.0.0.1:{_closed_port()}", request_timeout_s=3)
    with caplog.at_level(logging.WARNING, logger="cluster_pipeline.tracking.tracker"):
        tracker.log_metrics("r", {"loss": 1.0})
        tracker.log_metrics("r", {"loss": 2.0})
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    # MLflow reads them from the environment at each request.
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "0"
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "3"


def test_a_store_that_cannot_be_written_warns_once(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    warnings: list[str] = []
    tracker = Tracker(f"sqlite:///{blocker}/mlflow/mlflow.db", warn=warnings.append)
    assert tracker.start_run("r", tags={}) is None
    assert tracker.start_run("r", tags={}) is None
    assert len(warnings) == 1 and str(blocker) in warnings[0]


def test_a_disabled_tracker_does_nothing_and_says_nothing():
    warnings: list[str] = []
    tracker = Tracker.disabled()
    tracker._warn = warnings.append
    assert tracker.start_run("r", tags={}) is None
    tracker.log_metrics("r", {"loss": 1.0})
    assert warnings == [] and not tracker.enabled


def test_the_sender_logs_every_step_from_its_thread(store):
    tracker = Tracker(store.uri, experiment="sender")
    run_id = tracker.start_run("r", tags={})
    assert run_id is not None
    rank0 = Tracker.for_target(TrackingTarget(uri=store.uri, run_id=run_id))
    warnings: list[str] = []
    sender = MetricsSender(rank0, run_id, warnings.append)
    for step in range(1, 6):
        sender.log({"loss": 1.0 / step, "grad_cosine": None}, step)
    assert sender.close()
    history = _client(store.uri).get_metric_history(run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == [(k, 1.0 / k) for k in range(1, 6)]
    assert warnings == []


def test_the_sender_hands_its_one_warning_to_the_callers_thread():
    warnings: list[tuple[str, str]] = []
    uri = f"http://127.0.0.1:{_closed_port()}"
    sender = MetricsSender(
        Tracker(uri), "run", lambda m: warnings.append((threading.current_thread().name, m))
    )
    for step in range(1, 4):
        sender.log({"loss": 1.0}, step)
    assert not sender.close()
    assert len(warnings) == 1
    thread, message = warnings[0]
    assert thread == threading.current_thread().name and uri in message

"""The MLflow UI in a real browser: `cluster-pipeline mlflow` (what `make mlflow` runs) over a
data folder whose store holds a tiny run logged by the tracker; the run is found with its
params, tags and metrics. Screenshots go to ``test_artifacts/ui/``."""

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from cluster_pipeline.storage.layout import DataLayout
from cluster_pipeline.tracking.tracker import (
    TAG_CHECKPOINT,
    TAG_DAGSTER_RUN,
    TAG_PARTITION,
    Tracker,
    local_store,
)
from cluster_pipeline_tests.ui.test_webui import ARTIFACTS, CHROMIUM, ROOT, _free_port, browser_page

pytestmark = pytest.mark.slow

RUN_NAME = "tiny peripheral r=0.5 seed=0"
# Per step: (loss of rank 0, loss of rank 1); their mean is the logged loss, 0.5 at the end.
LOSSES = [(2.25, 1.75), (1.25, 0.75), (0.625, 0.375)]


def _tiny_run(data: Path) -> tuple[str, str]:
    """A run as trained_checkpoint and rank 0 log one, three steps; (experiment id, run id)."""
    store = local_store(DataLayout.at(data))
    tracker = Tracker(store.uri, artifact_location=store.artifact_location)
    run_id = tracker.start_run(
        RUN_NAME,
        tags={TAG_DAGSTER_RUN: "0f1e2d3c", TAG_PARTITION: "tiny", TAG_CHECKPOINT: "/ckpt/tiny"},
        params={"learning_rate": 1e-3, "selector": "peripheral", "K": 2},
    )
    for step, (a, b) in enumerate(LOSSES, start=1):
        metrics = {"loss": (a + b) / 2, "loss/rank_0": a, "loss/rank_1": b}
        tracker.log_metrics(run_id, {**metrics, "learning_rate": 1e-3 / step}, step)
    tracker.end_run(run_id)
    assert run_id is not None and tracker._experiment_id is not None and tracker.enabled
    return tracker._experiment_id, run_id


@pytest.fixture
def mlflow_ui(tmp_path):
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} absent: install Debian's chromium package (.ci/run does)")
    pytest.importorskip("playwright.sync_api", reason="pip install playwright (test extra)")
    data = tmp_path / "data"
    experiment, run_id = _tiny_run(data)
    port = _free_port()
    log = (tmp_path / "mlflow_ui.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "cluster_pipeline.cli", "mlflow", "--port", str(port)],
        cwd=ROOT,
        env={**os.environ, "CLUSTER_PIPELINE_DATA_DIR": str(data)},
        start_new_session=True,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 240
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2)
                break
            except OSError:
                if time.time() > deadline or proc.poll() is not None:
                    raise AssertionError(
                        f"mlflow ui did not start:\n{(tmp_path / 'mlflow_ui.log').read_text()}"
                    ) from None
                time.sleep(1)
        yield url, experiment, run_id
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def test_make_mlflow_serves_the_data_folders_store_on_loopback():
    dry_run = subprocess.run(
        ["make", "-n", "mlflow"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert "exec .venv/bin/cluster-pipeline mlflow --host 127.0.0.1 --port 5000" in dry_run
    other = subprocess.run(
        ["make", "-n", "mlflow", "PORT=5001"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert "--port 5001" in other


def test_the_mlflow_ui_shows_a_tiny_run_with_its_metrics(mlflow_ui):
    url, experiment, run_id = mlflow_ui
    with browser_page() as page:
        page.goto(f"{url}/#/experiments/{experiment}/runs", wait_until="domcontentloaded")
        link = page.get_by_text(RUN_NAME).first
        link.wait_for(timeout=120000)
        page.wait_for_timeout(1500)
        page.screenshot(path=ARTIFACTS / "mlflow_01_runs.png")

        link.click()
        page.wait_for_url(f"**/runs/{run_id}**", timeout=60000)
        # The overview lists the run's last metric values, params and tags.
        rows = page.get_by_role("row")
        rank_1 = rows.filter(has=page.get_by_text("loss/rank_1", exact=True)).first
        rank_1.wait_for(timeout=60000)
        assert rank_1.inner_text().split() == ["loss/rank_1", "0.375"]
        loss = rows.filter(has=page.get_by_text("loss", exact=True)).first
        assert loss.inner_text().split() == ["loss", "0.5"]
        body = page.inner_text("body")
        assert "Finished" in body and run_id in body
        assert "learning_rate" in body and "peripheral" in body
        assert "dagster_partition" in body and "/ckpt/tiny" in body
        page.screenshot(path=ARTIFACTS / "mlflow_02_run.png", full_page=True)

        # Model metrics: a chart per metric, over the steps.
        page.get_by_role("tab", name="Model metrics").first.click()
        chart = page.get_by_text(f"{RUN_NAME} (loss/rank_0)").first
        chart.wait_for(timeout=60000)
        page.wait_for_timeout(1500)
        page.screenshot(path=ARTIFACTS / "mlflow_03_metrics.png")

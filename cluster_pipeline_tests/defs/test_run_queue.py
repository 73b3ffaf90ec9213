"""Two runs of one dataset partition, launched together against the project's instance settings
and a real Dagster daemon: the second waits in the queue until the first has finished, both
succeed, and the embedding pass is computed once. Runs the automation sensor starts for the
partition queue behind them as well."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import pytest
import yaml

from cluster_pipeline.defs.stages import SELECTION_STAGES
from cluster_pipeline_tests.helpers import RUN_CONFIG, tiny_records, write_jsonl

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def test_a_second_run_of_a_partition_queues_and_reuses_the_embeddings(tmp_path, tiny_model_dir):
    data, home = tmp_path / "data", tmp_path / "home"
    write_jsonl(data / "raw" / "tiny" / "samples.jsonl", tiny_records(60))
    env = {
        **os.environ,
        "DAGSTER_HOME": str(home),
        "CLUSTER_PIPELINE_DATA_DIR": str(data),
        "CLUSTER_PIPELINE_BASE_MODEL": str(tiny_model_dir),
    }
    # Registers the partitions and installs the project's dagster.yaml into DAGSTER_HOME.
    subprocess.run(
        [BIN / "cluster-pipeline", "datasets", "sync"], env=env, check=True, capture_output=True
    )
    config = tmp_path / "run.yaml"
    ops = {k: v for k, v in RUN_CONFIG["ops"].items() if k in SELECTION_STAGES}
    config.write_text(yaml.safe_dump({"ops": ops}))
    daemon = subprocess.Popen(
        [BIN / "dagster-daemon", "run", "-w", "workspace.yaml"],
        cwd=ROOT,
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        launch = [BIN / "dagster", "job", "launch", "-w", "workspace.yaml", "-j", "selection_job"]
        launch += ["-c", str(config), "--tags", '{"dagster/partition": "tiny"}']
        for _ in range(2):
            subprocess.run(launch, cwd=ROOT, env=env, check=True, capture_output=True)
        with dg.DagsterInstance.from_config(str(home)) as instance:
            deadline = time.monotonic() + 900
            while time.monotonic() < deadline:
                records = instance.get_run_records(
                    dg.RunsFilter(tags={"dagster/partition": "tiny"})
                )
                statuses = [r.dagster_run.status for r in records]
                if len(records) >= 2 and all(s.name in ("SUCCESS", "FAILURE") for s in statuses):
                    break
                assert daemon.poll() is None, "dagster-daemon exited"
                time.sleep(2)
            assert statuses and all(s == dg.DagsterRunStatus.SUCCESS for s in statuses), statuses
            # No two runs of the partition overlapped: each started after the previous ended.
            spans = sorted((r.start_time or 0.0, r.end_time or float("inf")) for r in records)
            assert all(nxt[0] >= prev[1] for prev, nxt in zip(spans, spans[1:], strict=False))
            # One embedding pass: only the first materialization embedded samples.
            materializations = instance.fetch_materializations(
                dg.AssetRecordsFilter(
                    asset_key=dg.AssetKey("proxy_embeddings"), asset_partitions=["tiny"]
                ),
                limit=10,
            ).records
            embedded = sorted(
                (
                    int(str(m.asset_materialization.metadata["samples_embedded_now"].value))
                    for m in materializations
                    if m.asset_materialization is not None
                ),
                reverse=True,
            )
            # The automation sensor adds no run of its own: the job runs materialized every
            # stage (defs/stages.py, parents_updated; it once started a third run here,
            # re-embedding at the default sizes).
            assert [r.dagster_run.job_name for r in records] == ["selection_job"] * 2
            # 60 records less ceil(0.1 x 60) = 6 held out: 54 embedded once, then reused.
            assert embedded == [54, 0], embedded
    finally:
        os.killpg(daemon.pid, signal.SIGTERM)
        daemon.wait(timeout=60)

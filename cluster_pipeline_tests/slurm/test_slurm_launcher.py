"""torchrun under Slurm (launcher: slurm) on a real one-node cluster with two torchrun agents:
the embedding pass equals the standalone one, a failed rank is named with the job's state, and
terminating the Dagster run cancels the job and leaves no process."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import numpy as np
import psutil
import pytest
import yaml

from cluster_pipeline.defs.assets.proxy_embeddings import proxy_embeddings
from cluster_pipeline.defs.assets.raw_instructions import raw_instructions
from cluster_pipeline.defs.partitions import DATASETS
from cluster_pipeline_tests.helpers import (
    materialize_partition,
    meta,
    read,
    resources,
    step_failure,
)
from cluster_pipeline_tests.slurm.cluster import LocalSlurm
from cluster_pipeline_tests.slurm.defs import ENTRY, slurm_entry, slurm_torchrun
from cluster_pipeline_tests.slurm.entry import FAILURE

# One xdist worker runs this module: its module-scoped fixture starts once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("slurm")]
ROOT = Path(__file__).resolve().parents[2]


def _processes_mentioning(text: str) -> list[str]:
    """Command lines of running processes that mention ``text`` (this test's folder)."""
    found = []
    for proc in psutil.process_iter():
        try:
            cmdline = " ".join(proc.cmdline())
            if text in cmdline and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(cmdline)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return []


def _sleeping_run(tmp_path: Path, cluster: LocalSlurm) -> subprocess.Popen:
    """``dagster asset materialize`` of the sleeping entry point (multiprocess executor, own
    DAGSTER_HOME), returned once both ranks sleep under their agents: the job is under way."""
    home = tmp_path / "dagster_home"
    home.mkdir()
    config = tmp_path / "run.yaml"
    config.write_text(
        yaml.safe_dump(
            {"ops": {"slurm_entry": {"config": {"behaviour": "sleep", "job_dir": str(tmp_path)}}}}
        )
    )
    dagster = str(Path(sys.executable).parent / "dagster")
    command = [dagster, "asset", "materialize", "-m", "cluster_pipeline_tests.slurm.defs"]
    run = subprocess.Popen(
        [*command, "--select", "slurm_entry", "-c", str(config)],
        cwd=ROOT,
        env={**os.environ, "DAGSTER_HOME": str(home)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 120
    while len([c for c in _processes_mentioning(str(tmp_path)) if ENTRY in c]) < 4:
        if run.poll() is not None or time.monotonic() > deadline:
            run.kill()
            raise AssertionError(
                f"the Slurm job's ranks did not start:\n{run.communicate()[0][-3000:]}\n"
                f"{cluster.log_tail()}"
            )
        time.sleep(0.5)
    return run


def test_failed_rank_is_named_with_job_state_and_node(local_slurm, tmp_path):
    result = dg.materialize(
        [slurm_entry],
        resources={
            "torchrun": slurm_torchrun(),
            "pipes_subprocess_client": dg.PipesSubprocessClient(),
        },
        run_config={
            "ops": {"slurm_entry": {"config": {"behaviour": "fail", "job_dir": str(tmp_path)}}}
        },
        raise_on_error=False,
    )
    assert not result.success
    description, metadata = step_failure(result)
    job_id = metadata["slurm_job_id"]
    assert (
        f"{ENTRY}: Slurm job {job_id} FAILED on localhost: rank_1 on localhost failed first: "
        in description
    )
    assert FAILURE in description
    assert metadata["slurm_state"] == "FAILED"
    assert FAILURE in metadata["rank_1 on localhost"]
    assert "Per-rank logs: " in description and str(tmp_path) in description
    assert local_slurm.jobs() == []


def _embed(instance, res, **config):
    result = materialize_partition(
        [raw_instructions, proxy_embeddings],
        instance,
        res,
        run_config={
            "ops": {
                "proxy_embeddings": {
                    "config": {"max_length": 64, "chunk_size": 16, "world_size": 2, **config}
                }
            }
        },
    )
    assert result.success
    return result


def test_embedding_pass_over_two_slurm_agents_equals_standalone(
    local_slurm, tiny_data_dir, tiny_model_dir
):
    res = resources(tiny_data_dir, tiny_model_dir)
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(DATASETS, ["tiny"])
        _embed(instance, res)  # torchrun --standalone --nproc_per_node=2
        standalone = read(instance, "proxy_embeddings")
        # 2 torchrun agents (nnodes=2) x 1 rank under Slurm, recomputed (the cache is shared).
        try:
            result = _embed(instance, {**res, "torchrun": slurm_torchrun()}, recompute=True)
        except dg.Failure as e:
            raise AssertionError(f"{e.description}\n{local_slurm.log_tail()}") from e
        slurm = read(instance, "proxy_embeddings")
        assert meta(instance, "proxy_embeddings")["samples_reused"] == 0
        logs = [e.user_message for e in instance.all_logs(result.run_id)]
    assert any("2 torchrun agents on 1 node(s) x 1 ranks" in m for m in logs)
    # Rank 0's progress came back through Pipes' files while the job ran.
    assert any("embedded" in m and "tokens/s" in m for m in logs)
    assert slurm["sample_id"].to_list() == standalone["sample_id"].to_list()
    for column in ("embedding", "hidden_mean"):
        np.testing.assert_allclose(
            np.stack(slurm[column].drop_nulls().to_list()),
            np.stack(standalone[column].drop_nulls().to_list()),
            atol=1e-5,
        )
    assert local_slurm.jobs() == []


def test_terminating_the_run_cancels_the_job_and_leaves_no_process(local_slurm, tmp_path):
    """SIGTERM to ``dagster asset materialize`` (as a terminal's kill or a run launcher's
    termination does): the multiprocess executor interrupts the step, which scancels its job."""
    run = _sleeping_run(tmp_path, local_slurm)
    try:
        assert len(local_slurm.jobs()) == 2  # one running job: id and state
        run.send_signal(signal.SIGTERM)
        out = run.communicate(timeout=120)[0]
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode != 0
    assert "cancelling Slurm job" in out
    assert local_slurm.jobs() == []
    deadline = time.monotonic() + 30
    while _processes_mentioning(str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _processes_mentioning(str(tmp_path)) == []


def test_a_step_process_killed_outright_still_cancels_its_job(local_slurm, tmp_path):
    """SIGKILL to the step process (no ``finally`` runs): its guard process scancels the job."""
    run = _sleeping_run(tmp_path, local_slurm)
    try:
        guard = next(
            p
            for p in psutil.process_iter()
            if any("cluster_pipeline.launch.slurm" in c for c in _cmdline(p))
            and any(str(tmp_path) in c for c in _cmdline(p))
        )
        psutil.Process(guard.ppid()).kill()  # the step process
        run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
    deadline = time.monotonic() + 60
    while (local_slurm.jobs() or _processes_mentioning(str(tmp_path))) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.5)
    assert local_slurm.jobs() == []
    assert _processes_mentioning(str(tmp_path)) == []

"""The Slurm launcher's scripts and failure reading, without a cluster (the cluster tests are in
cluster_pipeline_tests/slurm/)."""

import json
import subprocess
from pathlib import Path

import pytest

from cluster_pipeline.launch import slurm


def test_scripts_start_one_agent_per_task_with_c10d_on_the_first_node(tmp_path):
    job_dir = tmp_path / "job dir"  # a space must survive the quoting
    job_dir.mkdir()
    spec = slurm.SlurmSpec(nodes=2, agents_per_node=2, partition="gpu", time_limit="01:00:00")
    script = slurm.write_scripts(
        spec, job_dir, "m.embed", 8, ["--config", str(job_dir / "j.json")], job_dir / "logs"
    )
    agent = (job_dir / slurm.AGENT_SCRIPT).read_text()
    for word in (
        "--nnodes=4",
        '"--node_rank=$SLURM_PROCID"',
        "--rdzv_backend=c10d",
        '"--rdzv_endpoint=$CLUSTER_PIPELINE_RDZV_ENDPOINT"',
        '"--rdzv_id=$SLURM_JOB_ID"',
        "--nproc_per_node=8",
        f"'{job_dir}/j.json'",
    ):
        assert word in agent
    batch = script.read_text()
    assert "srun --nodes=2 --ntasks-per-node=2 --kill-on-bad-exit=1" in batch
    assert "$((20000 + SLURM_JOB_ID % 20000))" in batch
    for text in (agent, batch):
        subprocess.run(["bash", "-n"], input=text, text=True, check=True)
    command = slurm.sbatch_command(spec, script, job_dir)
    assert {"--nodes=2", "--ntasks-per-node=2", "--partition=gpu", "--time=01:00:00"} <= set(
        command
    )
    with pytest.raises(ValueError, match="nodes and agents_per_node must be >= 1"):
        slurm.write_scripts(slurm.SlurmSpec(nodes=0), job_dir, "m", 1, [], job_dir / "logs")


def _rank_dir(log_dir: Path, agent: str, local_rank: int) -> Path:
    path = log_dir / agent / "1_abc" / "attempt_0" / str(local_rank)
    path.mkdir(parents=True)
    return path


def test_failures_are_named_by_global_rank_and_node_first_failure_first(tmp_path):
    # Agent 1 on n2: its local rank 1 (global rank 3) raised; agent 0 on n1: stopped by SIGTERM.
    error = {"message": {"message": "ValueError: bad shard", "extraInfo": {"py_callstack": ""}}}
    (_rank_dir(tmp_path, "agent1-n2", 1) / "error.json").write_text(json.dumps(error))
    (tmp_path / "agent1-n2" / "rank_exits.json").write_text(
        json.dumps({"1": {"rank": 3, "exitcode": 1, "signal": None, "timestamp": 1}})
    )
    _rank_dir(tmp_path, "agent0-n1", 0)
    (tmp_path / "agent0-n1" / "rank_exits.json").write_text(
        json.dumps({"0": {"rank": 0, "exitcode": -15, "signal": "SIGTERM", "timestamp": 2}})
    )
    failures = slurm.agent_failures(tmp_path)
    assert list(failures) == ["rank_3 on n2", "rank_0 on n1"]
    state = slurm.JobState("FAILED", "n[1-2]")
    assert slurm.failure_summary_or_state(failures, state) == (
        "rank_3 on n2 failed first: ValueError: bad shard (then rank_0 on n1)"
    )
    # No rank left a trace: the state says what happened.
    assert "time limit" in slurm.failure_summary_or_state({}, slurm.JobState("TIMEOUT"))


def test_a_job_whose_ranks_left_no_error_quotes_its_batch_output(tmp_path):
    lines = [f"line {i}" for i in range(25)] + ["srun: error: localhost: task 1: Exited 1"]
    output = "\n".join(lines) + "\n"
    path = tmp_path / "slurm-7.out"
    assert slurm.output_excerpt(output, tmp_path, "7", lines=3) == (
        f"The batch job's output ({path}) ends:\n"
        "line 23\nline 24\nsrun: error: localhost: task 1: Exited 1"
    )
    assert slurm.output_excerpt(output, tmp_path, "7").count("\n") == 20
    assert slurm.output_excerpt("\n", tmp_path, "7") == (f"The batch job wrote no output ({path}).")


def test_state_falls_back_to_the_batch_scripts_exit_status(tmp_path, monkeypatch):
    def forgotten(command, env=None):
        raise slurm.SlurmError(f"{command[0]} failed: Invalid job id specified")

    monkeypatch.setattr(slurm, "_slurm", forgotten)
    assert slurm.job_state("7", tmp_path) is None
    (tmp_path / slurm.BATCH_EXIT).write_text("1\n")
    assert slurm.job_state("7", tmp_path) == slurm.JobState("FAILED", reason="batch exit 1")

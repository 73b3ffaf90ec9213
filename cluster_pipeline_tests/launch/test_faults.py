"""Faults: a failing rank ends the launch, and no rank outlives its launcher."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster_pipeline_tests.helpers import train_job

pytestmark = pytest.mark.slow
LAUNCH = [
    sys.executable,
    "-m",
    "cluster_pipeline.launch.launcher",
    "--standalone",
    "--nproc_per_node=2",
    "-m",
    "cluster_pipeline.recipes.train",
]


def _children(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True).stdout
    tree = [tuple(map(int, line.split())) for line in out.splitlines() if line.strip()]
    found, frontier = set(), {pid}
    while frontier:
        frontier = {c for c, p in tree if p in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def _wait_for_ranks(proc, n=2, timeout=60) -> set[int]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        kids = _children(proc.pid)
        ranks = (
            {
                k
                for k in kids
                if "cluster_pipeline.recipes.train"
                in Path(f"/proc/{k}/cmdline")
                .read_bytes()
                .decode(errors="ignore")
                .replace("\0", " ")
                and k != proc.pid
            }
            if kids
            else set()
        )
        if len(ranks) >= n:
            return ranks
        time.sleep(0.2)
    raise AssertionError("ranks did not start")


def test_an_exception_on_one_rank_ends_the_launch_quickly(tmp_path, tiny_model_dir):
    cfg, _ = train_job(tmp_path, tiny_model_dir, [1.0, 1.0], per_rank=4, per_device_batch_size=1)
    manifest = Path(cfg.manifests[1])
    manifest.write_text(manifest.read_text().replace('"rank": 1', '"rank": 1, "bogus": 0'))
    start = time.time()
    done = subprocess.run(
        [*LAUNCH, "--config", str(tmp_path / "train.json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0 and time.time() - start < 60
    assert "unexpected keyword argument 'bogus'" in done.stderr


@pytest.mark.parametrize("victim", ["launcher", "parent_of_launcher"])
def test_no_rank_survives_a_killed_launcher_or_step(tmp_path, tiny_model_dir, victim):
    cfg, _ = train_job(
        tmp_path, tiny_model_dir, [1.0, 1.0], per_rank=20, per_device_batch_size=1, epochs=50
    )
    cmd = [*LAUNCH, "--config", str(tmp_path / "train.json")]
    if victim == "parent_of_launcher":
        # Stands in for the Dagster step process: it starts the launcher, then is SIGKILLed.
        cmd = [
            sys.executable,
            "-c",
            "import subprocess, sys, time; subprocess.Popen(sys.argv[1:]); time.sleep(600)",
            *cmd,
        ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ranks = _wait_for_ranks(proc)
    everyone = _children(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 30
    while time.time() < deadline and any(_alive(p) for p in everyone):
        time.sleep(0.2)
    survivors = [p for p in everyone if _alive(p)]
    assert ranks and not survivors, f"still running: {survivors}"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_with_c10d_rendezvous_train_one_step(tmp_path, tiny_model_dir):
    from cluster_pipeline.defs.resources import TorchrunResource

    cfg, _ = train_job(
        tmp_path, tiny_model_dir, [1.5, 0.5], per_rank=2, per_device_batch_size=2, max_steps=1
    )
    endpoint = f"127.0.0.1:{_free_port()}"
    procs = []
    for node_rank in (0, 1):
        cmd = TorchrunResource(
            nnodes=2, node_rank=node_rank, rdzv_endpoint=endpoint, rdzv_id="test2nodes"
        ).command("cluster_pipeline.recipes.train", 1, ["--config", str(tmp_path / "train.json")])
        procs.append(
            subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    outs = [p.communicate(timeout=180) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[0][1][-2000:] + outs[1][1][-2000:]
    info = (Path(cfg.output_dir) / "training_info.json").read_text()
    assert '"world_size": 2' in info and '"steps": 1' in info


def test_sigint_to_the_launcher_stops_every_rank(tmp_path, tiny_model_dir):
    """What Dagster's Pipes client sends when a run is terminated."""
    train_job(tmp_path, tiny_model_dir, [1.0, 1.0], per_rank=20, per_device_batch_size=1, epochs=50)
    proc = subprocess.Popen(
        [*LAUNCH, "--config", str(tmp_path / "train.json")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _wait_for_ranks(proc)
    everyone = _children(proc.pid)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) != 0
    deadline = time.time() + 30
    while time.time() < deadline and any(_alive(p) for p in everyone):
        time.sleep(0.2)
    assert not [p for p in everyone if _alive(p)]


def test_a_rank_killed_by_a_signal_is_named_with_the_likely_cause(tmp_path):
    from cluster_pipeline.launch.torchrun import failure_summary, rank_failures, torchrun_command

    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    cmd = torchrun_command("cluster_pipeline_tests.launch.kill_rank", 2, [], log_dir=log_dir)
    start = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).parents[2])
    assert out.returncode != 0 and time.monotonic() - start < 60
    failures = rank_failures(log_dir)
    assert failures["rank_1"] == (
        "killed by signal SIGKILL (exit code -9): likely out of memory (the kernel's OOM killer "
        "sends SIGKILL; see `dmesg`, lower the batch size or max_length)"
    )
    summary = failure_summary(failures) or ""
    assert summary.startswith("rank_1 failed first: killed by signal SIGKILL")

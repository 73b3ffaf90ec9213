"""A process killed by a signal, as the kernel's out-of-memory killer does, is named in the step's
failure with the signal and the likely cause: an embedding or training rank, the evaluation
process, and the Dagster step process itself. Earlier tables stay readable."""

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import dagster as dg
import psutil
import pytest
import yaml

from cluster_pipeline.defs.partitions import DATASETS
from cluster_pipeline_tests.helpers import (
    RUN_CONFIG,
    materialize_partition,
    pipeline_assets,
    read,
    resources,
    run_config_for,
    seed_embeddings,
    step_failure,
)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
ASSETS = pipeline_assets()
OOM = "killed by signal SIGKILL (exit code -9): likely out of memory"


def _worker(proc: psutil.Process, module: str, rank: int, data: Path) -> bool:
    """A torchrun worker process of ``module`` with LOCAL_RANK ``rank`` (not its launcher)
    whose job file lies under ``data`` (this test's, never another job's on the machine)."""
    cmdline = proc.cmdline()
    if module not in cmdline or not any(str(data) in c for c in cmdline):
        return False
    if any("cluster_pipeline.launch.launcher" in c for c in cmdline):
        return False
    return proc.environ().get("LOCAL_RANK") == str(rank)


def _launcher(proc: psutil.Process, module: str, data: Path) -> bool:
    """The torchrun launcher of ``module`` for a job file under ``data``."""
    cmdline = proc.cmdline()
    return (
        module in cmdline
        and any("cluster_pipeline.launch.launcher" in c for c in cmdline)
        and any(str(data) in c for c in cmdline)
    )


def _any(match: Callable[[psutil.Process], bool]) -> bool:
    """Whether a running process is accepted by ``match``."""
    for proc in psutil.process_iter():
        try:
            if match(proc):
                return True
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return False


@contextmanager
def sigkill_when(match: Callable[[psutil.Process], bool], parent: bool = False) -> Iterator[list]:
    """While the block runs, SIGKILL the first process (or, with ``parent``, its parent) that
    ``match`` accepts, 0.2 s after it appears (while it still imports torch: the kill always
    lands before its work is done). Yields the list of pids killed."""
    killed: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        seen: dict[int, float] = {}
        while not stop.is_set() and not killed:
            for proc in psutil.process_iter():
                try:
                    if proc.pid in seen or not match(proc):
                        continue
                    seen[proc.pid] = time.monotonic()
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    continue
            for pid, since in seen.items():
                if time.monotonic() - since > 0.2:
                    try:
                        target = psutil.Process(psutil.Process(pid).ppid() if parent else pid)
                        # A process that already finished (a zombie) would "take" the signal
                        # without dying of it: only a running one counts.
                        if target.status() != psutil.STATUS_ZOMBIE:
                            target.send_signal(signal.SIGKILL)
                            killed.append(target.pid)
                    except psutil.NoSuchProcess:
                        pass
                    break
            time.sleep(0.1)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield killed
    finally:
        stop.set()
        thread.join()


def test_a_rank_or_evaluation_killed_by_a_signal_is_named(
    tiny_data_dir, tiny_model_dir, tiny_embedding_cache
):
    # The killed pass below has chunks of 4 samples, another cache key: it runs in full.
    seed_embeddings(tiny_embedding_cache, tiny_data_dir)
    res = resources(tiny_data_dir, tiny_model_dir)
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(DATASETS, ["tiny"])

        def materialize(assets, **overrides):
            return materialize_partition(
                assets,
                instance,
                res,
                run_config=run_config_for(assets, **overrides),
                raise_on_error=False,
            )

        # Embedding rank 1 of 2.
        embed = "cluster_pipeline.recipes.embed"
        with sigkill_when(lambda p: _worker(p, embed, 1, tiny_data_dir)) as killed:
            result = materialize(ASSETS[:2], proxy_embeddings={"world_size": 2, "chunk_size": 4})
        assert killed and not result.success
        description, metadata = step_failure(result)
        assert f"dataset 'tiny', {embed}: rank_1 failed first: {OOM}" in description
        assert metadata["rank_1"].startswith(f"```\n{OOM}")
        assert read(instance, "raw_instructions").height == 60  # the earlier table is intact

        assert materialize(ASSETS[:6]).success
        # Training rank 1 of 2.
        train = "cluster_pipeline.recipes.train"
        with sigkill_when(lambda p: _worker(p, train, 1, tiny_data_dir)) as killed:
            result = materialize([ASSETS[5]], trained_checkpoint={"retrain": True})
        assert killed and not result.success
        assert f"dataset 'tiny', {train}: rank_1 failed first: {OOM}" in step_failure(result)[0]

        # The evaluation process (one per model).
        evaluate = "cluster_pipeline.recipes.evaluate"
        with sigkill_when(lambda p: _worker(p, evaluate, 0, tiny_data_dir)) as killed:
            result = materialize([ASSETS[6]])
        assert killed and not result.success
        assert f"dataset 'tiny', {evaluate}: rank_0 failed first: {OOM}" in step_failure(result)[0]
        assert not _any(lambda p: _worker(p, evaluate, 0, tiny_data_dir))
        # The torchrun launcher itself (no rank leaves a trace; Pipes gives its exit code).
        with sigkill_when(lambda p: _launcher(p, evaluate, tiny_data_dir)) as killed:
            result = materialize([ASSETS[6]])
        assert killed and not result.success
        assert (
            f"dataset 'tiny', {evaluate}: the torchrun launcher was {OOM}"
            in step_failure(result)[0]
        )


def test_a_step_process_killed_by_a_signal_is_named_and_leaves_no_process(
    tiny_data_dir, tiny_model_dir, tiny_embedding_cache, tmp_path
):
    """The multiprocess executor (the project's executor) names a step process's signal and
    the likely cause; the evaluation it had started dies with it."""
    seed_embeddings(tiny_embedding_cache, tiny_data_dir)
    res = resources(tiny_data_dir, tiny_model_dir)
    home = tmp_path / "dagster_home"
    home.mkdir()
    with dg.instance_for_test(temp_dir=str(home)) as instance:
        instance.add_dynamic_partitions(DATASETS, ["tiny"])
        assert materialize_partition(ASSETS[:6], instance, res).success
        config = tmp_path / "eval.yaml"
        config.write_text(
            yaml.safe_dump({"ops": {"eval_report": RUN_CONFIG["ops"]["eval_report"]}})
        )
        evaluate = "cluster_pipeline.recipes.evaluate"
        env = {
            **os.environ,
            "DAGSTER_HOME": str(home),
            "CLUSTER_PIPELINE_DATA_DIR": str(tiny_data_dir),
            "CLUSTER_PIPELINE_BASE_MODEL": str(tiny_model_dir),
        }
        dagster = str(Path(sys.executable).parent / "dagster")
        with sigkill_when(lambda p: _launcher(p, evaluate, tiny_data_dir), parent=True) as killed:
            out = subprocess.run(
                [dagster, "asset", "materialize", "-m", "cluster_pipeline.definitions"]
                + ["--select", "eval_report", "--partition", "tiny", "-c", str(config)],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
            )
        assert killed and out.returncode != 0
        run = instance.get_runs(limit=1)[0]
        messages = [e.message for e in instance.all_logs(run.run_id) if e.message]
        assert any(
            "child process for step eval_report was terminated by signal 9 (SIGKILL). This "
            "usually indicates that the process was killed by the operating system due to "
            "running out of memory" in m
            for m in messages
        ), messages

        def evaluation_alive(p: psutil.Process) -> bool:
            return _worker(p, evaluate, 0, tiny_data_dir) or _launcher(p, evaluate, tiny_data_dir)

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _any(evaluation_alive):
            time.sleep(0.5)
        assert not _any(evaluation_alive)

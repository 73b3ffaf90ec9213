"""The launcher interface (launch/base.py): the registry the torchrun resource's ``launcher``
knob names, each launcher built from the resource's knobs, and the one way a failed launch of
any launcher becomes a ``dagster.Failure``."""

from pathlib import Path

import dagster as dg
import pytest

from cluster_pipeline.defs.resources import TorchrunResource, launch_failure
from cluster_pipeline.launch.base import LaunchError, LaunchFailure, LaunchSpec, launchers
from cluster_pipeline.launch.local import Rendezvous, Standalone
from cluster_pipeline.launch.slurm import SlurmLauncher


def test_the_registry_lists_every_launcher_in_the_launchpads_order():
    assert launchers() == {
        "standalone": Standalone,
        "rendezvous": Rendezvous,
        "slurm": SlurmLauncher,
    }


def test_each_launcher_takes_its_knobs_from_the_resource():
    resource = TorchrunResource(
        launcher="slurm", nnodes=3, slurm_agents_per_node=2, slurm_sbatch_args=["--gres=gpu:8"]
    )
    launcher = resource.launcher_for()
    assert launcher == SlurmLauncher(
        nnodes=3, slurm_agents_per_node=2, slurm_sbatch_args=["--gres=gpu:8"]
    )
    assert resource.agents == 6 and resource.remote
    # local: this machine alone, whatever the launcher.
    assert resource.launcher_for(local=True) == Standalone()
    here = TorchrunResource(launcher="rendezvous", nnodes=2, rdzv_endpoint="h:1")
    assert here.launcher_for() == Rendezvous(nnodes=2, rdzv_endpoint="h:1")
    assert here.agents == 2 and not here.remote


def test_slurm_jobs_go_to_the_shared_folder_by_run(tmp_path):
    spec = LaunchSpec("m.train", 2, tmp_path / "run.job.json", run_id="0123456789")
    assert SlurmLauncher(slurm_job_dir="/shared").job_dir(spec) == Path("/shared/run.job-01234567")
    assert SlurmLauncher().channel_dir(spec) == Path(f"{tmp_path}/run.job.json.slurm")
    assert Standalone().channel_dir(spec) is None


def test_a_rendezvous_without_its_endpoint_is_refused_before_anything_starts(tmp_path):
    spec = LaunchSpec("m.train", 1, tmp_path / "job.json")
    with pytest.raises(LaunchError, match="rendezvous needs rdzv_endpoint"):
        Rendezvous(nnodes=2).prepare(spec)
    assert not Path(f"{spec.job_file}.logs").exists()
    assert Standalone().prepare(spec) == Path(f"{spec.job_file}.logs")


def test_a_failed_launch_is_one_failure_whatever_the_launcher(tmp_path):
    failure = LaunchFailure(
        cause="Slurm job 12 FAILED on n1: rank_1 failed first: boom (then rank_0)",
        log_dir=tmp_path,
        ranks={"rank_1": "boom\nTraceback", "rank_0": "lost peer"},
        details={"slurm_job_id": "12", "slurm_state": "FAILED"},
        texts={"slurm_output": "srun: error"},
        note="The batch job's output ends:\nsrun: error",
    )
    error = launch_failure("dataset 'tiny', m.train", failure)
    assert isinstance(error, dg.Failure)
    assert error.description == (
        "dataset 'tiny', m.train: Slurm job 12 FAILED on n1: rank_1 failed first: boom (then "
        f"rank_0). Per-rank logs: {tmp_path}\nThe batch job's output ends:\nsrun: error"
    )
    metadata = {k: v.value for k, v in error.metadata.items()}
    assert list(metadata) == [
        "rank_1",
        "rank_0",
        "slurm_job_id",
        "slurm_state",
        "slurm_output",
        "log_dir",
    ]
    assert metadata["rank_1"] == "```\nboom\nTraceback\n```"
    assert metadata["slurm_job_id"] == "12" and metadata["log_dir"] == str(tmp_path)

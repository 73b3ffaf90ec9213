"""A one-node Slurm cluster (munged, slurmctld, slurmd on 127.0.0.1) for the session's Slurm
tests; they are skipped, saying what to install, where Slurm is not installed."""

import os
from collections.abc import Iterator

import pytest

from cluster_pipeline_tests.slurm.cluster import LocalSlurm, missing_packages, start_local_slurm


@pytest.fixture(scope="session")
def local_slurm(tmp_path_factory) -> Iterator[LocalSlurm]:
    """The running cluster; ``SLURM_CONF`` points this process (and the Dagster steps and jobs it
    starts) at it while the session runs. Stopped, with its leftover processes, at the end."""
    if os.geteuid() != 0:
        pytest.skip("the test Slurm cluster runs slurmd as root: run the Slurm tests as root")
    missing = missing_packages()
    if missing:
        pytest.skip(
            f"Slurm is not installed ({', '.join(missing)} missing): "
            "apt-get install slurm-wlm munge (make setup does)"
        )
    cluster = start_local_slurm(tmp_path_factory.mktemp("slurm"), cpus=4)
    before = os.environ.get("SLURM_CONF")
    os.environ.update(cluster.env)
    try:
        yield cluster
    finally:
        cluster.stop()
        if before is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = before

"""The main job, one per size profile, and the selection job.

``main_job`` runs all seven stages for one dataset partition with the default size profile,
``cpu_quick`` (:mod:`cluster_pipeline.defs.profiles`): N = 300 training samples, max length 256
tokens, K = 2, r = 0.5, one epoch, 100 held-out samples and the first 8 HumanEval and 8 MBPP
problems, about 12 minutes on 2 idle CPU cores on ``python_stdlib``. Its launchpad shows that
config; ``make run`` executes the job with it. ``main_job_<profile>`` does the same with another
profile's sizes (``main_job_gpu8``: one node of 8 GPUs).
"""

import dagster as dg

from cluster_pipeline.defs.profiles import (
    DEFAULT_PROFILE,
    PROFILES,
    job_name,
    profile_run_config,
)
from cluster_pipeline.defs.stages import JOB_RUN_TAG, SELECTION_STAGES, STAGES
from cluster_pipeline.storage.names import SAMPLE_LINEAGE


# Every job ends with sample_lineage, so a run leaves the lineage of what it selected and
# trained (it would otherwise wait for the automation sensor). Every job's runs carry
# JOB_RUN_TAG: the eager conditions (defs/stages.py) ignore the parent updates these runs make,
# since the same run materializes the children too.
def main_job_of(profile: str):
    """All seven stages and ``sample_lineage``, with ``profile``'s sizes as the job's
    (launchpad-editable) config."""
    return dg.define_asset_job(
        job_name(profile),
        selection=dg.AssetSelection.assets(*STAGES, SAMPLE_LINEAGE),
        config=profile_run_config(profile),
        tags={"cluster_pipeline/profile": profile, JOB_RUN_TAG: job_name(profile)},
        description=f"raw_instructions -> ... -> eval_report, then sample_lineage, for one "
        f"dataset partition, size profile {profile}.",
    )


main_jobs = [main_job_of(profile) for profile in PROFILES]
main_job = main_jobs[0]

selection_job = dg.define_asset_job(
    "selection_job",
    selection=dg.AssetSelection.assets(*SELECTION_STAGES, SAMPLE_LINEAGE),
    config=profile_run_config(DEFAULT_PROFILE, SELECTION_STAGES),
    tags={"cluster_pipeline/profile": DEFAULT_PROFILE, JOB_RUN_TAG: "selection_job"},
    description="The cheap selection chain, raw_instructions -> shard_manifests, and "
    "sample_lineage.",
)

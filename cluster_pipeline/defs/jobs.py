"""The main job: all seven stages for one dataset partition, sized for a 2-core CPU by default.

Its default run config (shown in the launchpad) keeps a CPU run to about 15 minutes on
``python_stdlib``: N = 600 training samples, max length 256 tokens, K = 2, r = 0.5, one epoch,
64 held-out samples and the first 20 HumanEval problems. Raise them on a GPU machine.
"""

import dagster as dg

from cluster_pipeline.defs.assets.balanced_clusters import BalancedClustersConfig
from cluster_pipeline.defs.assets.eval_report import EvalReportConfig
from cluster_pipeline.defs.assets.peripheral_subsets import PeripheralSubsetsConfig
from cluster_pipeline.defs.assets.proxy_embeddings import ProxyEmbeddingsConfig
from cluster_pipeline.defs.assets.raw_instructions import RawInstructionsConfig
from cluster_pipeline.defs.assets.trained_checkpoint import TrainedCheckpointConfig
from cluster_pipeline.defs.partitions import dataset_partitions

STAGES = [
    "raw_instructions",
    "proxy_embeddings",
    "balanced_clusters",
    "peripheral_subsets",
    "shard_manifests",
    "trained_checkpoint",
    "eval_report",
]

CPU_QUICK_CONFIG = dg.RunConfig(
    ops={
        "raw_instructions": RawInstructionsConfig(max_train_samples=600, max_heldout=64),
        "proxy_embeddings": ProxyEmbeddingsConfig(max_length=256),
        "balanced_clusters": BalancedClustersConfig(num_clusters=2),
        "peripheral_subsets": PeripheralSubsetsConfig(selector="peripheral", ratio=0.5),
        "trained_checkpoint": TrainedCheckpointConfig(
            max_length=256, per_device_batch_size=4, gradient_accumulation_steps=2,
            learning_rate=1e-4,
        ),
        "eval_report": EvalReportConfig(max_length=256, humaneval_problems=20, max_new_tokens=256),
    }
)

main_job = dg.define_asset_job(
    "main_job",
    selection=dg.AssetSelection.assets(*STAGES),
    partitions_def=dataset_partitions,
    config=CPU_QUICK_CONFIG,
    description="raw_instructions -> ... -> eval_report for one dataset partition.",
)

selection_job = dg.define_asset_job(
    "selection_job",
    selection=dg.AssetSelection.assets(*STAGES[:5]),
    partitions_def=dataset_partitions,
    description="The cheap selection chain, raw_instructions -> shard_manifests.",
)

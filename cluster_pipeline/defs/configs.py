"""Every stage's run config, the knobs a person turns per run (launchpad, YAML, CLI), in one
place: the stage assets take them, the run checks (``run_checks``) validate them before a
run's first step and the size profiles (``profiles``) set their defaults per job.

Each knob is defined once. The embedding, training and evaluation knobs are the torchrun jobs'
settings (training/config.py, evaluation/suites/), which the stage configs inherit;
``peripheral_subsets``' knobs are those of every selection (``SelectionKnobs``) and each
selector's own (its spec's ``knobs``), composed from the selector registry, so a selector
module adds its knobs to the run config without an edit here. The run-config schema this
makes is pinned, knob for knob, by cluster_pipeline_tests/defs/test_run_config_schema.py.
"""

from collections.abc import Mapping
from typing import Any, Literal

import dagster as dg
from pydantic import Field

from cluster_pipeline.evaluation.suites import EvalSettings
from cluster_pipeline.selection.clustering import DEFAULT_ALPHA, KMEANS_NITER, KMEANS_RESTARTS
from cluster_pipeline.selection.selectors import REGISTRY, SelectionKnobs, knob_classes
from cluster_pipeline.storage.names import (
    BALANCED_CLUSTERS,
    EVAL_REPORT,
    PERIPHERAL_SUBSETS,
    PROXY_EMBEDDINGS,
    RAW_INSTRUCTIONS,
    SHARD_MANIFESTS,
    TRAINED_CHECKPOINT,
)
from cluster_pipeline.training.config import EmbedSettings, TrainSettings


class RawInstructionsConfig(dg.Config):
    """The reading knobs of a run: the held-out split and the pool's size."""

    heldout_fraction: float = Field(
        default=0.05,
        ge=0.0,
        lt=1.0,
        description="Fraction of the deduplicated samples held out for evaluation, set aside "
        "before any selection.",
    )
    max_heldout: int | None = Field(
        default=100,
        ge=1,
        description="Cap on held-out samples (null = no cap; the cpu_quick default keeps 100, "
        "which tells the trained model from the base one on python_stdlib with room to spare; "
        "200 over 3 seeds detects a 1 % held-out loss difference, benchmarks/RESULTS.md).",
    )
    max_train_samples: int | None = Field(
        default=300,
        ge=1,
        description="Cap on the training pool N, a seeded subset (null = all; the cpu_quick "
        "default keeps 300).",
    )
    seed: int = Field(default=0, ge=0, description="Seed of the split and of the cap's subset.")


class ProxyEmbeddingsConfig(dg.Config, EmbedSettings):
    """The embedding knobs (:class:`~cluster_pipeline.training.config.EmbedSettings`) plus how
    this asset runs the pass."""

    world_size: int = Field(
        default=1,
        ge=1,
        description="torchrun processes (data-parallel "
        "inference) over all nodes; 1 on CPU, the number of GPUs otherwise.",
    )
    recompute: bool = Field(
        default=False,
        description="Embed every sample again and replace the cache of this model and these "
        "settings with the result (the old cache is kept until the new pass has finished).",
    )


class BalancedClustersConfig(dg.Config):
    """The clustering knobs of a run (launchpad, YAML, CLI)."""

    num_clusters: int = Field(
        default=2,
        ge=1,
        description="K: clusters = data-parallel ranks "
        "(GPUs) that will train, one cluster per rank.",
    )
    alpha: float = Field(
        default=DEFAULT_ALPHA,
        ge=1.0,
        description="Capacity slack: no cluster exceeds ceil(alpha * N / K); the cap binds only "
        "when k-means leaves a cluster above it. 1.5 = the CluSTER reference's soft cap (unequal "
        "clusters stay unequal and their ranks are re-weighted); 1.0 = exact balance (every "
        "weight w_c = 1 when K divides N).",
    )
    seed: int = Field(default=0, ge=0, description="k-means seed (sample and restarts).")
    niter: int = Field(
        default=KMEANS_NITER,
        ge=1,
        description="Most Lloyd iterations per k-means run (a run stops once its objective "
        "stops falling); the reference's max_iter is 300.",
    )
    restarts: int = Field(
        default=KMEANS_RESTARTS,
        ge=1,
        description="k-means runs from different k-means++ seedings; the lowest inertia wins "
        "(the reference's n_init is 10).",
    )
    representation: Literal["gradient_proxy", "hidden_mean"] = Field(
        default="gradient_proxy",
        description="What to cluster: gradient_proxy = the CluSTER embedding e (default); "
        "hidden_mean = the mean final hidden state over the response, from the same pass.",
    )


# The selectors' knob classes, last first, then the common knobs: pydantic lists a class's
# inherited fields from its last base to its first, so the launchpad shows selector, ratio,
# seed and balance first, then each selector's knobs in registry order.
_SELECTION_BASES = (*reversed(knob_classes()), SelectionKnobs)


class PeripheralSubsetsConfig(dg.Config, *_SELECTION_BASES):
    """The selection knobs of a run: selector, ratio r, balance and seed; a targeted selector's
    target set (rds, less), s2l's proxy run and trajectory clusters, and less's warm-up and
    projection."""


class ShardManifestsConfig(dg.Config):
    """The allocation knobs of a run: the seed of each shard's order."""

    seed: int = Field(default=0, ge=0, description="Seed of each shard's sample order.")


class TrainedCheckpointConfig(dg.Config, TrainSettings):
    """The training knobs (:class:`~cluster_pipeline.training.config.TrainSettings`) plus
    whether to reuse a finished checkpoint."""

    retrain: bool = Field(
        default=False,
        description="Train again even if a finished "
        "checkpoint of the same manifests, data, model and settings exists.",
    )


class EvalReportConfig(dg.Config, EvalSettings):
    """The evaluation knobs (:class:`~cluster_pipeline.evaluation.suites.EvalSettings`) plus which
    models the report compares."""

    compare_checkpoints: bool = Field(
        default=True,
        description="Also evaluate every other "
        "checkpoint of this dataset (other selectors, seeds).",
    )


# Each stage's run config class, in pipeline order.
STAGE_CONFIGS: dict[str, type[dg.Config]] = {
    RAW_INSTRUCTIONS: RawInstructionsConfig,
    PROXY_EMBEDDINGS: ProxyEmbeddingsConfig,
    BALANCED_CLUSTERS: BalancedClustersConfig,
    PERIPHERAL_SUBSETS: PeripheralSubsetsConfig,
    SHARD_MANIFESTS: ShardManifestsConfig,
    TRAINED_CHECKPOINT: TrainedCheckpointConfig,
    EVAL_REPORT: EvalReportConfig,
}

RUN_CONFIG_ARTIFACT = "run_config.yaml"


def tracked_knobs(config: dg.Config | Mapping[str, Any]) -> dict[str, object]:
    """The knobs of a ``peripheral_subsets`` config (or its recorded values) that its selector
    reads, as the MLflow run's params: the common ones and the selector's own (the others'
    values are defaults nobody chose, and would make runs of one selector look different by
    knobs it ignores); also what a run config repeats (:func:`repeatable_config`)."""
    values = dict(config) if isinstance(config, Mapping) else config.model_dump()
    own = REGISTRY[values["selector"]].knobs.model_fields
    return {k: v for k, v in values.items() if k in SelectionKnobs.model_fields or k in own}


def repeatable_config(stage: str, values: Mapping[str, Any]) -> dict[str, Any]:
    """A stage's config (as recorded, or as a run launched it) in the form a run config takes
    again: every knob, but for ``peripheral_subsets`` only those its selector reads
    (:func:`tracked_knobs`), since the run checks refuse another selector's knobs even at their
    default values."""
    if stage == PERIPHERAL_SUBSETS and values.get("selector"):
        return tracked_knobs(values)
    return dict(values)

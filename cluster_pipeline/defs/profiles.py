"""Named size profiles: how big a run is, defined in one place.

``cpu_quick``, the default, *is* the stage configs' schema defaults (sized so that all seven
stages finish in about 12 minutes on 2 idle CPU cores with SmolLM2-135M on ``python_stdlib``).
Every way a run starts without a config therefore runs the same sizes: the launchpad of
``main_job``, *Materialize* in the asset graph, the nightly schedule, the automation sensor,
``make run`` and ``dagster asset materialize`` without ``-c``.

Any other profile overrides some of those defaults and has its own job, ``main_job_<profile>``,
whose launchpad shows the profile's values (edit them there as usual); ``make run
PROFILE=<profile>`` launches the same job from a shell.
"""

from typing import Any

import dagster as dg

from cluster_pipeline.defs.configs import (
    BalancedClustersConfig,
    EvalReportConfig,
    PeripheralSubsetsConfig,
    ProxyEmbeddingsConfig,
    RawInstructionsConfig,
    TrainedCheckpointConfig,
)
from cluster_pipeline.storage.names import (
    BALANCED_CLUSTERS,
    EVAL_REPORT,
    PERIPHERAL_SUBSETS,
    PROXY_EMBEDDINGS,
    RAW_INSTRUCTIONS,
    TRAINED_CHECKPOINT,
)

DEFAULT_PROFILE = "cpu_quick"

# The knobs a profile sets and a profile's run config shows, per stage.
KNOBS: dict[str, tuple[type[dg.Config], tuple[str, ...]]] = {
    RAW_INSTRUCTIONS: (RawInstructionsConfig, ("max_train_samples", "max_heldout")),
    PROXY_EMBEDDINGS: (
        ProxyEmbeddingsConfig,
        ("max_length", "world_size", "bf16", "max_packed_length"),
    ),
    BALANCED_CLUSTERS: (
        BalancedClustersConfig,
        ("num_clusters", "alpha", "restarts", "niter", "seed"),
    ),
    PERIPHERAL_SUBSETS: (PeripheralSubsetsConfig, ("selector", "ratio", "balance")),
    TRAINED_CHECKPOINT: (
        TrainedCheckpointConfig,
        (
            "max_length",
            "max_tokens_per_micro_batch",
            "max_packed_length",
            "gradient_accumulation_steps",
            "epochs",
            "learning_rate",
            "bf16",
        ),
    ),
    EVAL_REPORT: (
        EvalReportConfig,
        ("max_length", "humaneval_problems", "mbpp_problems", "max_new_tokens"),
    ),
}

# profile -> stage -> knob -> value, over the schema defaults.
PROFILES: dict[str, dict[str, dict[str, Any]]] = {
    DEFAULT_PROFILE: {},
    # One node of 8 GPUs, as in the CluSTER paper's runs (7B models, 4-8 H100s): the whole pool,
    # 2,048-token samples, K = 8 clusters = 8 training ranks, 8 embedding ranks, bfloat16,
    # 3 epochs at 8 ranks x 4 packed micro-batches of 8,192 tokens per step (about 128 samples
    # of ~500 tokens) and learning rate 2e-5, rows up to 4,096 tokens, and every HumanEval and
    # MBPP problem. Set num_clusters and world_size to your GPU count. Rows of 4,096 cost only
    # their samples' own attention where the variable-length kernel runs (data/attention.py:
    # CUDA with torch's varlen_attn or flash-attn); under sdpa's block mask they cost the whole
    # row's (an H200 measured 19k real tokens/s at 4,096 against 33k at 1,024, issue 39). The
    # row bound and micro-batch tokens are not re-tuned: benchmarks/gpu_step.py has not run on
    # a GPU yet (docs/guide/gpu.md).
    "gpu8": {
        RAW_INSTRUCTIONS: {"max_train_samples": None, "max_heldout": 500},
        PROXY_EMBEDDINGS: {
            "max_length": 2048,
            "world_size": 8,
            "bf16": True,
            "max_packed_length": 4096,
        },
        BALANCED_CLUSTERS: {"num_clusters": 8},
        TRAINED_CHECKPOINT: {
            "max_length": 2048,
            "max_tokens_per_micro_batch": 8192,
            "max_packed_length": 4096,
            "gradient_accumulation_steps": 4,
            "epochs": 3,
            "learning_rate": 2e-5,
            "bf16": True,
        },
        EVAL_REPORT: {
            "max_length": 2048,
            "humaneval_problems": 164,
            "mbpp_problems": 397,
            "max_new_tokens": 512,
        },
    },
}

LOGGERS = {"console": {"config": {"log_level": "INFO"}}}  # stage progress, not DEBUG events


class UnknownProfileError(ValueError):
    """A profile name that is not in :data:`PROFILES`."""


def profile_run_config(profile: str = DEFAULT_PROFILE, stages: list[str] | None = None) -> dict:
    """The run config of ``profile``: for each stage (all of :data:`KNOBS`, or ``stages``),
    the values of its size knobs, i.e. the stage config's schema default overridden by the
    profile, plus the INFO console logger.

    Raises:
        UnknownProfileError: ``profile`` is not a known profile (the message lists them).
        pydantic.ValidationError: a profile value outside its knob's bounds.
    """
    if profile not in PROFILES:
        raise UnknownProfileError(
            f"unknown size profile {profile!r}; choose from {', '.join(PROFILES)}"
        )
    ops = {}
    for stage, (config_cls, knobs) in KNOBS.items():
        if stages is not None and stage not in stages:
            continue
        config = config_cls(**PROFILES[profile].get(stage, {}))
        ops[stage] = {"config": {knob: getattr(config, knob) for knob in knobs}}
    return {"ops": ops, "loggers": LOGGERS}


def job_name(profile: str) -> str:
    """``main_job`` for the default profile, ``main_job_<profile>`` for the others."""
    return "main_job" if profile == DEFAULT_PROFILE else f"main_job_{profile}"

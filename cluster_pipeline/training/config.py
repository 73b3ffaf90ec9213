"""The knobs of the two torchrun jobs, each defined once.

:class:`EmbedSettings` and :class:`TrainSettings` hold what a person turns per run, with bounds
and help text (as TRL's ``SFTConfig``). The Dagster run config of ``proxy_embeddings`` and
``trained_checkpoint`` inherits them, so the launchpad shows the same fields, defaults and
descriptions. The asset wraps the settings in a job file (:class:`EmbedJob`, :class:`TrainJob`:
settings + the pinned inputs and output paths), ships it to every rank as JSON
(``model_dump_json``), and each rank validates it on load. Adding a training knob is one field
in :class:`TrainSettings`.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, Field

from cluster_pipeline.data.tokenization import PackingSettings, SequenceSettings
from cluster_pipeline.storage.job_files import JobFile, StrictModel
from cluster_pipeline.tracking.tracker import TrackingTarget

Schedule = Literal["cosine", "linear", "constant"]
# Training knobs that change how fast a step runs, not what it trains (the same loss and
# gradients to float32 rounding: training/kernels.py): left out of a checkpoint's identity
# (its folder's hash, the report's setups), so turning one neither retrains nor splits a group.
SPEED_ONLY_SETTINGS = frozenset({"fused_loss", "compile"})
Parallelism = Literal["ddp", "fsdp"]


class EmbedSettings(StrictModel, SequenceSettings, PackingSettings):
    """Knobs of the gradient-proxy embedding pass (docs/design.md, step 1); the sequence knobs
    (max_length, truncation, response_turns) are :class:`SequenceSettings`, the batching knobs
    (packing, max_packed_length) :class:`PackingSettings`."""

    max_batch_size: int = Field(
        default=16, ge=1, description="Without packing: max samples per forward pass."
    )
    max_batch_tokens: int = Field(
        default=8192,
        ge=1,
        description="Max tokens per forward pass (packed: real tokens; padded: padded tokens).",
    )
    chunk_size: int = Field(default=512, ge=1, description="Samples per resumable chunk.")
    bf16: bool = Field(default=False, description="bfloat16 autocast for the forward pass.")

    def cache_fields(self) -> dict[str, Any]:
        """The settings that change the stored embeddings (batching does not: padding is
        masked and position ids count real tokens)."""
        return self.model_dump(
            exclude={"max_batch_size", "max_batch_tokens", "packing", "max_packed_length"}
        )


class GradientPass(StrictModel):
    """less's gradient pass (selection/selectors/less.py) in place of the embedding: each
    sample's LoRA gradient of its mean response loss under one warm-up checkpoint, Adam-
    preconditioned with that checkpoint's optimizer state (``adam_*``, the pool) or plain
    (``sgd``, the target set), randomly projected and L2-normalised
    (selection/gradient_features.py); stored as the chunk's ``embedding`` column."""

    checkpoint: str = Field(
        description="A warm-up step folder: the peft adapter (adapter_config.json, "
        "adapter_model.safetensors) and training_state.pt with the AdamW state."
    )
    preconditioner: Literal["adam_released", "adam_paper", "sgd"] = Field(
        default="adam_released",
        description="adam_released: the authors' released update, m' / sqrt(v' + eps) without bias "
        "correction (LESS's collect_grad_reps.py); adam_paper: the paper's eq. (1), "
        "m_hat / (sqrt(v_hat) + eps); sgd: the plain gradient.",
    )
    projection_dim: int = Field(default=8192, ge=1, description="d of the projection.")
    projection_seed: int = Field(default=0, ge=0, description="Seed of the projection.")
    project_rows: int | None = Field(
        default=None,
        ge=1,
        description="Gradients projected together (the matrix is rebuilt once per group); "
        "None: as many as 1 GiB of float32 gradients holds (for SmolLM2-135M's rank-8 LoRA, "
        "582, so about one rebuild per chunk of 512).",
    )


class EmbedJob(JobFile):
    """One embedding pass: settings plus the pinned input table and the chunk folder."""

    settings: EmbedSettings
    model_path: str
    instructions_uri: str
    instructions_version: int = Field(ge=0)
    chunk_dir: str
    # A Parquet file with a sample_id column: embed only those samples of the split (the ones
    # the per-sample cache lacks); None = the whole split.
    sample_ids_file: str | None = None
    # ifd's unconditioned pass (data/tokenization.response_only): each sample's response tokens
    # without its prompt, so ``mean_loss`` is the response's loss alone.
    response_only: bool = False
    # ifd's passes (data/tokenization.without_end_of_turn): False = the trained turns' closing
    # tokens (the template's end-of-turn marker, or EOS) are not scored, as Cherry LLM's IFD.
    end_of_turn: bool = True
    # What ``hidden_mean`` pools (selection/embedding.py): the response positions, or (rds's
    # own pass, RDS+) every position with weights proportional to the position.
    pooling: Literal["response_mean", "position_weighted"] = "response_mean"
    # less's gradient pass instead of the embedding (the model is ``model_path`` with the
    # checkpoint's adapter); None = the embedding pass.
    gradients: GradientPass | None = None
    lm_head_chunk_rows: int = Field(default=1024, ge=1)
    progress_every_s: float = Field(default=30.0, gt=0)


class TrainSettings(StrictModel, SequenceSettings, PackingSettings):
    """Knobs of data-parallel fine-tuning (docs/design.md, steps 4-5); the sequence knobs
    (max_length, truncation, response_turns) are :class:`SequenceSettings`, the batching knobs
    (packing, max_packed_length) :class:`PackingSettings`."""

    max_tokens_per_micro_batch: int = Field(
        default=1024,
        ge=1,
        description="With packing: real tokens per rank per micro-batch (a longer sample goes "
        "alone).",
    )
    per_device_batch_size: int = Field(
        default=4,
        ge=1,
        description="Without packing (or for a model that cannot pack): samples per rank per "
        "micro-batch.",
    )
    gradient_accumulation_steps: int = Field(
        default=2, ge=1, description="Micro-batches per optimizer step."
    )
    epochs: int = Field(default=1, ge=1, description="Passes over each rank's shard.")
    max_steps: int | None = Field(
        default=None,
        ge=1,
        description="Stop after this many optimizer steps (null = all epochs; never more steps "
        "than the epochs hold).",
    )
    learning_rate: float = Field(default=1e-4, gt=0.0, description="Peak AdamW learning rate.")
    weight_decay: float = Field(default=0.0, ge=0.0, description="AdamW weight decay.")
    warmup_ratio: float = Field(
        default=0.1, ge=0.0, lt=1.0, description="Fraction of steps of linear warmup."
    )
    schedule: Schedule = Field(default="cosine", description="Decay after warmup.")
    max_grad_norm: float = Field(default=1.0, gt=0.0, description="Gradient clipping norm.")
    bf16: bool = Field(default=False, description="bfloat16 autocast.")
    reweight: bool = Field(
        default=True,
        description="Multiply rank c's loss by its manifest's w_c (n_c K / N, or K R_c / R "
        "under token balance; docs/design.md, step 5); off = plain balanced training.",
    )
    seed: int = Field(
        default=0,
        ge=0,
        description="Training seed: the order each rank visits its shard in, every epoch, and "
        "torch's RNG (rank r uses seed + r).",
    )
    save_every_steps: int | None = Field(
        default=None,
        ge=1,
        description="Save a resumable checkpoint every N optimizer steps (null = only at the end).",
    )
    keep_checkpoints: int = Field(default=2, ge=1, description="Intermediate checkpoints kept.")
    save_final_state: bool = Field(
        default=False,
        description="Also write the resumable step folder (optimizer state included) at the "
        "last step when it falls on save_every_steps: less reads the AdamW moments of every "
        "warm-up checkpoint, the last one too.",
    )
    grad_cosine_every: int | None = Field(
        default=5,
        ge=1,
        description="Every N optimizer steps, log the mean cosine between the ranks' local "
        "gradients (CluSTER Fig. 6a), from a fixed random projection; null = never.",
    )
    grad_sketch_dim: int = Field(
        default=1024, ge=16, description="Dimension of that projection (CountSketch)."
    )
    resume: bool = Field(
        default=True,
        description="Resume from the latest intermediate "
        "checkpoint of the same manifests and config, if one exists.",
    )
    parallelism: Parallelism = Field(
        default="ddp",
        description="ddp = a full replica of weights, gradients and optimizer state on every "
        "rank (fastest when the model fits); fsdp = FSDP2 (torch fully_shard per decoder layer "
        "and root): all three sharded over the ranks, for models DDP cannot hold.",
    )
    gradient_checkpointing: bool = Field(
        default=False,
        description="Recompute activations in the backward pass (transformers' gradient "
        "checkpointing): less memory for long sequences, about a third more compute.",
    )
    fused_loss: bool = Field(
        default=True,
        description="The loss from the final hidden states in chunks of tokens, never the "
        "whole (tokens x vocabulary) float32 logits (training/kernels.py; Liger-Kernel's fused "
        "linear cross-entropy on a GPU where liger-kernel is installed): the same loss and "
        "gradients to float32 rounding, less memory. Off = from the model's logits.",
    )
    compile: bool = Field(
        default=False,
        description="torch.compile each decoder layer (training/kernels.py): faster GPU steps "
        "once compiled (the first steps pay the compilation); inductor needs a C++ compiler on "
        "CPU.",
    )
    lora_r: int = Field(
        default=0, ge=0, description="LoRA rank (peft adapters); 0 = full fine-tuning."
    )
    lora_alpha: int = Field(default=16, ge=1, description="LoRA scaling numerator (alpha / r).")
    lora_dropout: float = Field(default=0.0, ge=0.0, lt=1.0, description="LoRA dropout.")
    lora_target_modules: list[str] | None = Field(
        default=None,
        description="Module names LoRA adapts; null = peft's default for the architecture "
        "(q_proj and v_proj for Llama).",
    )


class TrainJob(JobFile):
    """One fine-tuning run: settings, the pinned data, one shard manifest per rank, the output
    folder and provenance recorded into ``training_info.json``."""

    settings: TrainSettings
    model_path: str
    instructions_uri: str
    instructions_version: int = Field(ge=0)
    manifests: list[str] = Field(min_length=1, description="One shard manifest per rank.")
    output_dir: str
    provenance: dict[str, Any] = Field(default_factory=dict)
    # The MLflow run rank 0 logs every step into (None: no tracking).
    tracking: TrackingTarget | None = None


SettingsT = TypeVar("SettingsT", bound=BaseModel)


def settings_of(config: BaseModel, cls: type[SettingsT]) -> SettingsT:
    """The ``cls`` fields of a Dagster run config that inherits ``cls`` (asset-only knobs such
    as ``recompute`` are left out)."""
    return cls.model_validate(config.model_dump(include=set(cls.model_fields)))

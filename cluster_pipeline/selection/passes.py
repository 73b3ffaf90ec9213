"""What a selector asks of the model, as requests, and the runner that answers them
(docs/design.md, step 3, "A selector is one module").

A selector's inputs beyond the clustering come from model passes: the pool pass that
``proxy_embeddings`` already ran (its ``mean_loss`` and ``hidden_mean`` columns), and passes
of its own: a forward pass over the pool or a target set under the pool pass's settings
(ifd's responses without their prompts, rds's target set, s2l's loss under a checkpoint,
less's per-sample gradients), and a brief training run on the pool (s2l's proxy, less's LoRA
warm-up). A selector module declares them in its ``gather(knobs, pool, runner)``, as
:class:`ForwardPass` and :class:`BriefTraining` requests to a :class:`PassRunner`, and turns
the answers into its inputs, cost records and record details (:class:`Gathered`).

This module is Dagster- and process-free: the runner that launches torchrun, caches every pass
per sample and writes the tables is ``defs/pass_runner.py``; a test gives a selector a fake
runner that returns hand-made arrays, and the selector's own logic runs as in a real run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol

import numpy as np
import polars as pl
from pydantic import BaseModel, Field

# The pool pass (proxy_embeddings): the clustering's distances, the lengths, the conditioned
# mean loss and hidden_mean come from it. A selector's own passes are named in its module.
PASS_EMBEDDING = "embedding"


class PassFailed(Exception):
    """A selector's pass cannot give it what it needs (no target sample with a response
    token, a training run holding unexpected checkpoints); the message says why, without the
    dataset, which the caller adds."""


def round_mib(value: float | None) -> float | None:
    """A memory figure in MiB to 0.1 MiB (None stays None: not recorded)."""
    return None if value is None else round(value, 1)


def mib_of(stats: Mapping[str, Any], key: str) -> float | None:
    """``stats[key]`` (bytes) in MiB, None where absent."""
    return float(stats[key]) / 2**20 if stats.get(key) is not None else None


@dataclass(frozen=True)
class PassCost:
    """One model pass over samples that a selector's inputs came from.

    Attributes:
        name: the pass's name: ``"embedding"`` (the proxy_embeddings pass over the pool) or one
            that a selector module defines (``"unconditioned"``, ``"targets"``,
            ``"s2l_proxy"``, ``"s2l_loss"``, ``"less_warmup"``, ``"less_gradients"``,
            ``"less_targets"``; a pass run under several checkpoints has one entry per
            checkpoint, in step order).
        samples: samples passed forward, one forward pass each (for a training pass, the
            sample visits of all its optimizer steps over all ranks).
        tokens: tokens of those samples (as the model saw them).
        seconds: what the pass costs at the rate its cache measured (model load excluded), the
            same whether this run computed it or read it from the cache; a training pass's
            measured training seconds.
        backward: backward passes (per sample visit: s2l's proxy training, less's warm-up;
            one per sample for less's gradient passes).
        run_now: samples this run passed through the model (the others were cached).
        peak_rss_mib: the largest rank's peak resident memory (MiB) over the runs that
            computed the pass (None where they did not record it: a cache from before
            2026-12-02).
        peak_cuda_mib: the same for CUDA memory allocated by torch (0 on the CPU).
    """

    name: str
    samples: int
    tokens: int
    seconds: float
    backward: int = 0
    run_now: int = 0
    peak_rss_mib: float | None = None
    peak_cuda_mib: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (seconds rounded to 0.01 s, memory to 0.1 MiB)."""
        return {
            "name": self.name,
            "samples": self.samples,
            "tokens": self.tokens,
            "seconds": round(self.seconds, 2),
            "backward": self.backward,
            "run_now": self.run_now,
            "peak_rss_mib": round_mib(self.peak_rss_mib),
            "peak_cuda_mib": round_mib(self.peak_cuda_mib),
        }


@dataclass(frozen=True)
class Pool:
    """The clustered pool a selector chooses from: N samples in K clusters, in the
    ``balanced_clusters`` table's order.

    Attributes:
        dataset: the partition (for log lines; errors get it from the caller).
        sample_ids: (N,) the samples' ``sample_id``.
        labels: (N,) int64 cluster per sample, in [0, K).
        k: K.
        sq_distance: (N,) float32 squared distance to the sample's centroid.
        lengths: (N,) int64 tokens per sample (prompt and response, as embedded).
        response_tokens: (N,) int64 response tokens per sample.
        world_size: ranks of the pool pass; a selector's own passes run on as many.
        max_length: the pool pass's ``max_length`` (its passes' too), for messages.
        cost: the pool pass's cost record (:data:`PASS_EMBEDDING`).
    """

    dataset: str
    sample_ids: np.ndarray
    labels: np.ndarray
    k: int
    sq_distance: np.ndarray
    lengths: np.ndarray
    response_tokens: np.ndarray
    world_size: int = 1
    max_length: int = 0
    cost: PassCost | None = None

    @property
    def n(self) -> int:
        """N."""
        return len(self.labels)


@dataclass(frozen=True)
class GradientRequest:
    """A forward pass that yields per-sample gradients instead of the embedding (less): each
    sample's LoRA gradient of its mean response loss under the warm-up checkpoint
    ``checkpoint`` (a step folder with the adapter and the AdamW state),
    Adam-preconditioned (``"adam_released"``: the authors' ``m' / sqrt(v' + eps)``;
    ``"adam_paper"``: the paper's bias-corrected eq. (1); selection/gradient_features.py) or plain
    (``"sgd"``), randomly projected to ``projection_dim`` with seed ``projection_seed`` and
    L2-normalised; read as ``"embedding"``."""

    checkpoint: str
    preconditioner: Literal["adam_released", "adam_paper", "sgd"] = "adam_released"
    projection_dim: int = 8192
    projection_seed: int = 0


@dataclass(frozen=True)
class ForwardPass:
    """One per-sample pass of the embedding recipe under the pool pass's settings, cached per
    sample (a sample's row is computed once per model, settings and ``key``).

    Attributes:
        name: the pass's name in the cost record.
        over: ``"pool"`` (the N pool samples, in pool order) or ``"targets"`` (the target set
            that :meth:`PassRunner.target_set` read, in its order).
        key: the cache's name for the pass (its folder; ``name`` when empty).
        model: the model folder the pass runs (a proxy checkpoint); None: the pool pass's base
            model.
        response_only: each sample's response without its prompt (ifd's s(A)).
        end_of_turn: the trained turns' closing tokens (the template's end-of-turn marker, or
            EOS) are scored; False leaves them out of every loss (ifd's passes, as Cherry LLM).
        pooling: what ``hidden_mean`` pools: ``"response_mean"`` (the response positions, as
            the pool pass) or ``"position_weighted"`` (every position, weights proportional to
            the position: RDS+; selection/embedding.py).
        samples: indices into the pool of the samples to pass (``over="pool"`` only; the rows
            come back in that order); None: all of them.
        gradients: per-sample gradients instead of the embedding (:class:`GradientRequest`).
        read: the outputs wanted: ``"mean_loss"`` (mean token loss of the response, nats),
            ``"hidden_mean"`` (mean final hidden state over the response) or ``"embedding"``
            (the gradient proxy, or the gradient of a gradient pass).
        label: names the pass in log lines and errors (``"ifd unconditioned pass"``).
    """

    name: str
    over: Literal["pool", "targets"] = "pool"
    key: str = ""
    model: str | None = None
    response_only: bool = False
    end_of_turn: bool = True
    pooling: Literal["response_mean", "position_weighted"] = "response_mean"
    samples: tuple[int, ...] | None = None
    gradients: GradientRequest | None = None
    read: tuple[str, ...] = ("mean_loss",)
    label: str = ""


@dataclass(frozen=True)
class PassOutput:
    """What a :class:`ForwardPass` gave, one row per sample asked for, in that order.

    Attributes:
        ran: (n,) bool: the sample was passed (False: it has no response token within
            ``max_length``).
        values: each output of ``read``: ``mean_loss`` (n,) float32, nan where not ran;
            ``hidden_mean`` and ``embedding`` (n, d) float32, zero rows where not ran.
        cost: the pass's cost record.
        run_now: samples computed by this run (the others were cached).
    """

    ran: np.ndarray
    values: Mapping[str, np.ndarray]
    cost: PassCost
    run_now: int = 0


@dataclass(frozen=True)
class BriefTraining:
    """A brief training run of the pool pass's base model on pool samples (random
    token-balanced shards over the pool pass's world size, weight 1), under the pool pass's
    sequence settings; reused when a finished run of the same shards, data, model and
    settings exists, resumed when killed.

    Attributes:
        name: the run's name in the cost record.
        purpose: what it is for, in log lines, errors and the run's provenance
            (``"s2l proxy"``).
        steps: S, optimizer steps.
        checkpoints: C, checkpoints kept, every S / C steps (S a multiple of C).
        learning_rate: the peak AdamW learning rate.
        samples: (S,) int64 indices into the pool of the samples trained on; None: all.
        lora_r: LoRA adapters of this rank; 0: every parameter is trained.
        optimizer_states: every checkpoint keeps its AdamW state (the last one too), and the
            checkpoints are the C step folders; otherwise the C - 1 step folders and the final
            model.
        learning_rates: also give each checkpoint's mean learning rate (:class:`TrainedRun`).
    """

    name: str
    purpose: str
    steps: int
    checkpoints: int
    learning_rate: float
    samples: np.ndarray | None = None
    lora_r: int = 0
    optimizer_states: bool = False
    learning_rates: bool = False

    @property
    def every(self) -> int:
        """Steps between two checkpoints, S / C."""
        return self.steps // self.checkpoints


@dataclass(frozen=True)
class RunCheckpoint:
    """One checkpoint of a brief training run: its folder and its optimizer step."""

    path: str
    step: int


@dataclass(frozen=True)
class TrainedRun:
    """What a :class:`BriefTraining` gave.

    Attributes:
        checkpoints: the C checkpoints, in step order (at steps every, 2 every, ..., S).
        learning_rates: (C,) the mean learning rate of the steps since the previous
            checkpoint (the schedule's, steps 1-based); () unless the request asked.
        cost: the run's cost record (one forward and one backward pass per sample visit).
    """

    checkpoints: tuple[RunCheckpoint, ...]
    learning_rates: tuple[float, ...]
    cost: PassCost


class PassRunner(Protocol):
    """Carries out a selector's requests for one clustered pool (``defs/pass_runner.py``; a
    test's fake returns hand-made arrays)."""

    def pool_column(self, column: str) -> np.ndarray:
        """(N,) float32 ``column`` of the pool pass's table (``mean_loss``), in pool order, nan
        where null."""
        ...

    def pool_vectors(self, column: str) -> np.ndarray:
        """(N, d) float32 vectors of the pool pass's table (``hidden_mean_normalised``), in
        pool order."""
        ...

    def pool_sources(self) -> np.ndarray:
        """(N,) str each pool sample's source, in pool order: the file it was read from (its
        ``source_file``)."""
        ...

    def target_set(self, target: str | None, size: int) -> int:
        """Read the target set ``target`` (a benchmark's name or a folder of samples), at most
        ``size`` samples, before any model loads, and keep it for passes ``over="targets"``;
        written as the ``selection_targets`` table. Returns its sample count M.

        Raises:
            The runner's own failure (a target that cannot be read).
        """
        ...

    def target_tasks(self) -> np.ndarray:
        """(M,) str the task of each sample of the target set read last, in its order
        (evaluation/targets.target_tasks: MMLU's topic, a folder's file; "" for a benchmark
        without tasks)."""
        ...

    def forward(self, request: ForwardPass) -> PassOutput:
        """Run (or read from the cache) one forward pass."""
        ...

    def train(self, request: BriefTraining) -> TrainedRun:
        """Run (or reuse) one brief training run."""
        ...

    def write_table(self, name: str, frame: pl.DataFrame) -> None:
        """Write a table of the selector's own (``s2l_trajectories``) under the dataset; the
        selection's record lists it among its inputs."""
        ...

    def log(self, message: str) -> None:
        """One line in the run's log."""
        ...


@dataclass(frozen=True)
class Gathered:
    """What a selector's ``gather`` returns.

    Attributes:
        inputs: its inputs by name: fields of ``SelectionInputs`` (``unconditioned_loss``,
            ``targets``, ...) or names of its own (``SelectionInputs.extra``).
        passes: the cost records of its own passes, in the order run.
        details: what its record keeps (metadata entries, e.g. ``selection_target``); the keys
            its spec declares.
        reads_pool_pass: whether its inputs read the pool pass (its cost record then starts
            with it); None: as its spec's ``passes`` say (rds reads it only under
            ``rds_pooling: response_mean``).
    """

    inputs: Mapping[str, np.ndarray] = field(default_factory=dict)
    passes: tuple[PassCost, ...] = ()
    details: Mapping[str, Any] = field(default_factory=dict)
    reads_pool_pass: bool | None = None


@dataclass(frozen=True)
class SelectionFacts:
    """What a selector's rules know beyond its knobs; None where unknown (before the data is
    read).

    Attributes:
        selector: the selector's name (for messages).
        pool_size: N, the samples it will choose from.
        pool_is: what N counts, for messages (``"training samples of dataset 'x'"``).
        world_size: ranks of the pool pass (``proxy_embeddings.world_size``), which its own
            passes use.
        target_problem: why a target set cannot be read (None when it can), given the target,
            its size and the selector; None: not checked here.
    """

    selector: str = ""
    pool_size: int | None = None
    pool_is: str = "training samples of the dataset"
    world_size: int = 1
    target_problem: Callable[[str | None, int, str], str | None] | None = None


def knob(name: str, value: Any) -> str:
    """``peripheral_subsets.<name> = <value>``: how a refusal names a knob."""
    shown = repr(value) if isinstance(value, str) else str(value)
    return f"peripheral_subsets.{name} = {shown}"


class TargetKnobs(BaseModel):
    """The knobs of a selector that selects towards a target set (rds, less, cluster_less):
    which set, and how many of its samples (read by :meth:`PassRunner.target_set`)."""

    # How a refusal names the selectors that read these knobs.
    GROUP: ClassVar[str] = "the targeted selectors"

    target: str | None = Field(
        default=None,
        description="the targeted selectors (rds, less, cluster_less) only: the target set to "
        "select towards: a benchmark of "
        "evaluation/suites/ (humaneval, mbpp, mmlu, mmlu_medical; its prompts with reference "
        "solutions, read from data/eval/ like eval_report's) or the absolute path of a folder "
        "of samples in any input form.",
    )
    target_size: int = Field(
        default=64,
        ge=1,
        description="the targeted selectors only: at most this many target samples (a "
        "benchmark's first N items, a folder's first N distinct samples). Its tasks (MMLU's "
        "topics, a folder's files) are rds's round-robin turns and less's subtasks.",
    )


def checkpoint_rules(
    steps_knob: str, steps: int, checkpoints_knob: str, checkpoints: int, training: str
) -> list[str]:
    """A brief training's step count that its checkpoints divide (:class:`BriefTraining` saves
    one every steps / checkpoints steps): s2l's proxy, less's warm-up."""
    if steps % checkpoints == 0:
        return []
    return [
        f"{knob(steps_knob, steps)}: must be a multiple of {checkpoints_knob} = {checkpoints} "
        f"(the {training} saves a checkpoint every {steps_knob} / {checkpoints_knob} steps)"
    ]


def target_rules(knobs: TargetKnobs, facts: SelectionFacts) -> list[str]:
    """A target set that names a benchmark whose file is found, or a folder whose first
    ``target_size`` samples can be read (:attr:`SelectionFacts.target_problem`; nothing is
    checked where the facts give no way to)."""
    if facts.target_problem is None:
        return []
    problem = facts.target_problem(knobs.target, knobs.target_size, facts.selector)
    return [] if problem is None else [f"{knob('target', knobs.target)}: {problem}"]

"""The selector registry (docs/design.md, step 3): every way this project picks a subset of the
pool, one module each, behind one interface (``base``: :class:`SelectionInputs` ->
:class:`SelectionResult` with scores, plus its :class:`SelectionCost`).

``peripheral_subsets.selector`` chooses among :data:`REGISTRY`; the UI's description of that
knob is :func:`describe`. Adding a selector is one module (a function ``(inputs, params) ->
SelectionResult``, its formula and source in the docstring) and one :class:`SelectorSpec`
entry below, naming the inputs it reads and the model passes they come from; sharding
(cluster c on rank c for a ``clustered`` selector, random balanced shards otherwise), the
weights (w_c for a ``reweighted`` one, else 1) and the cost record follow from the entry.

:func:`select` is the entry point for the selectors that read only the clustering (the six
before the registry, with their signature); :func:`run_selector` takes any selector's inputs.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Literal

import numpy as np
import polars as pl

from cluster_pipeline.selection.selectors import global_random, ifd, less, peripheral, rds, s2l
from cluster_pipeline.selection.selectors.base import (
    PASS_EMBEDDING,
    PASS_LESS_GRADIENTS,
    PASS_LESS_TARGETS,
    PASS_LESS_WARMUP,
    PASS_S2L_LOSS,
    PASS_S2L_PROXY,
    PASS_TARGETS,
    PASS_UNCONDITIONED,
    PassCost,
    SelectionCost,
    SelectionInputs,
    SelectionParams,
    SelectionResult,
    SelectorSpec,
    cluster_tokens,
    cluster_weights,
    per_cluster_budget,
    token_budget,
)

__all__ = [
    "CLUSTER_SELECTORS",
    "REGISTRY",
    "REWEIGHTED_SELECTORS",
    "SELECTORS",
    "Balance",
    "PassCost",
    "SelectionCost",
    "SelectionInputs",
    "SelectionParams",
    "SelectionResult",
    "Selector",
    "SelectorSpec",
    "cluster_weights",
    "describe",
    "needs_targets",
    "per_cluster_budget",
    "per_cluster_summary",
    "run_selector",
    "select",
    "selection_from_table",
    "token_budget",
    "trains_a_proxy",
    "warms_up_lora",
]

_CLUSTERING = ("sq_distance",)

# Name -> selector, in the order the UI lists them (the first is the default).
REGISTRY: dict[str, SelectorSpec] = {
    s.name: s
    for s in (
        SelectorSpec(
            "peripheral",
            "farthest from the centroid in every cluster (CluSTER)",
            peripheral.peripheral,
            needs=_CLUSTERING,
            passes=(PASS_EMBEDDING,),
            clustered=True,
            reweighted=True,
            source="Kim et al., CluSTER",
        ),
        SelectorSpec(
            "core",
            "nearest to the centroid",
            peripheral.core,
            needs=_CLUSTERING,
            passes=(PASS_EMBEDDING,),
            clustered=True,
            reweighted=True,
            source="Kim et al., CluSTER, ablation",
        ),
        SelectorSpec(
            "random",
            "random within each cluster",
            peripheral.random_within,
            needs=_CLUSTERING,
            passes=(PASS_EMBEDDING,),
            clustered=True,
            reweighted=True,
            source="Kim et al., CluSTER, ablation",
        ),
        SelectorSpec(
            "uniform",
            "oversample every cluster to the largest, weight 1",
            peripheral.uniform,
            passes=(PASS_EMBEDDING,),
            clustered=True,
            source="this project",
        ),
        SelectorSpec(
            "random_global",
            "the same budget drawn from the whole pool, without clusters",
            global_random.random_global,
            source="Kim et al., CluSTER, random baseline",
        ),
        SelectorSpec(
            "full",
            "all data",
            global_random.full,
            source="full-data training",
        ),
        SelectorSpec(
            "ifd",
            "Cherry LLM's instruction-following difficulty, loss(response | prompt) / "
            "loss(response alone), highest first among samples below 1 (one extra forward pass "
            "without the prompt)",
            ifd.ifd,
            needs=("mean_loss", "unconditioned_loss"),
            passes=(PASS_EMBEDDING, PASS_UNCONDITIONED),
            source="Li et al. 2024, From Quantity to Quality (Cherry LLM)",
        ),
        SelectorSpec(
            "rds",
            "RDS+: round-robin over the target set (peripheral_subsets.target), each target "
            "taking its most similar pool sample by the cosine of mean response hidden states",
            rds.rds,
            needs=("hidden_mean", "targets"),
            passes=(PASS_EMBEDDING, PASS_TARGETS),
            source="Ivison et al. 2025, Large-Scale Data Selection for Instruction Tuning",
        ),
        SelectorSpec(
            "s2l",
            "SmallToLarge: k-means on each sample's loss trajectory over the checkpoints of a "
            "proxy trained briefly on the pool (peripheral_subsets.s2l_steps, s2l_checkpoints), "
            "then the same budget drawn evenly across the trajectory clusters, small ones whole",
            s2l.s2l,
            needs=("loss_trajectories",),
            passes=(PASS_S2L_PROXY, PASS_S2L_LOSS),
            source="Yang et al. 2024, SmallToLarge (S2L), NeurIPS 2024",
        ),
        SelectorSpec(
            "less",
            "LESS: the highest learning-rate-weighted cosine between a sample's "
            "Adam-preconditioned LoRA gradient and its best target's gradient "
            "(peripheral_subsets.target), both randomly projected, at the checkpoints of a short "
            "LoRA warm-up on a random share of the pool (peripheral_subsets.less_*)",
            less.less,
            needs=("less_gradients", "less_target_gradients", "less_learning_rates"),
            passes=(PASS_LESS_WARMUP, PASS_LESS_GRADIENTS, PASS_LESS_TARGETS),
            source="Xia et al. 2024, LESS: Selecting Influential Data for Targeted Instruction "
            "Tuning, ICML 2024",
        ),
    )
}

SELECTORS: tuple[str, ...] = tuple(REGISTRY)
# Selectors that keep the clusters: cluster c is trained on rank c with weight w_c.
CLUSTER_SELECTORS: tuple[str, ...] = tuple(n for n, s in REGISTRY.items() if s.clustered)
# Selectors whose ranks' losses are re-weighted by w_c.
REWEIGHTED_SELECTORS: tuple[str, ...] = tuple(n for n, s in REGISTRY.items() if s.reweighted)
Balance = Literal["tokens", "samples"]
if TYPE_CHECKING:
    Selector = str
else:
    # The run config's choices, built from the registry (Dagster shows them as an enum).
    Selector = Literal[SELECTORS]


def needs_targets(name: str) -> bool:
    """Whether the selector ``name`` reads a target set (``peripheral_subsets.target``)."""
    spec = REGISTRY.get(name)
    return spec is not None and bool({PASS_TARGETS, PASS_LESS_TARGETS} & set(spec.passes))


def warms_up_lora(name: str) -> bool:
    """Whether the selector ``name`` runs less's LoRA warm-up (the ``less_*`` knobs apply)."""
    spec = REGISTRY.get(name)
    return spec is not None and PASS_LESS_WARMUP in spec.passes


def trains_a_proxy(name: str) -> bool:
    """Whether the selector ``name`` trains a proxy model on the pool (s2l's knobs apply)."""
    spec = REGISTRY.get(name)
    return spec is not None and PASS_S2L_PROXY in spec.passes


def describe() -> str:
    """The UI's description of ``selector``: every registered selector, one clause each."""
    return "; ".join(f"{name} = {spec.summary}" for name, spec in REGISTRY.items()) + "."


def run_selector(
    name: str, inputs: SelectionInputs, params: SelectionParams | None = None
) -> SelectionResult:
    """Run the registered selector ``name`` on ``inputs``; the result carries its score and its
    cost record (the selector's own seconds, and the model passes of ``inputs`` it needs).

    Raises:
        ValueError: unknown selector or balance, an empty cluster, token balance without
            lengths or response tokens, an input the selector needs missing, r out of range, or
            a zero budget.
    """
    params = params or SelectionParams()
    if name not in REGISTRY:
        raise ValueError(f"unknown selector {name!r}; choose one of {SELECTORS}")
    if params.balance not in ("samples", "tokens"):
        raise ValueError(f"unknown balance {params.balance!r}; choose tokens or samples")
    spec = REGISTRY[name]
    labels = np.asarray(inputs.labels, dtype=np.int64)
    sizes = np.bincount(labels, minlength=inputs.k)
    if (sizes == 0).any():
        raise ValueError(f"cluster sizes {sizes.tolist()} include an empty cluster")
    if params.balance == "tokens":
        if inputs.lengths is None or inputs.response_tokens is None:
            raise ValueError("token balance needs the samples' lengths and response tokens")
        cluster_tokens(inputs)  # positive lengths
    missing = [need for need in spec.needs if getattr(inputs, need) is None]
    if missing:
        raise ValueError(f"selector {name!r} needs {', '.join(missing)}, which were not given")
    start = time.perf_counter()
    result = spec.run(replace(inputs, labels=labels), params)
    seconds = time.perf_counter() - start
    passes = tuple(p for p in inputs.passes if p.name in spec.passes)
    return replace(result, cost=SelectionCost(seconds, passes))


def select(
    labels: np.ndarray,
    sq_distance: np.ndarray,
    k: int,
    selector: str = "peripheral",
    r: float = 1.0,
    seed: int = 0,
    balance: str = "samples",
    lengths: np.ndarray | None = None,
    response_tokens: np.ndarray | None = None,
) -> SelectionResult:
    """:func:`run_selector` for the selectors that read only the clustering (and lengths).

    Args:
        labels: (N,) int64 cluster per sample, in [0, K).
        sq_distance: (N,) float32 squared distance to the sample's centroid.
        k: number of clusters K.
        selector: one of :data:`SELECTORS`.
        r: selection ratio in (0, 1].
        seed: seed of the random selectors.
        balance: ``"samples"`` (the published rule) or ``"tokens"`` (``peripheral`` module).
        lengths: (N,) int64 tokens per sample (prompt and response, as trained); needed for
            token balance.
        response_tokens: (N,) int64 response tokens per sample; the weights of token balance.

    Raises:
        ValueError: as :func:`run_selector` (a selector that needs more inputs names them).
    """
    inputs = SelectionInputs(
        labels=np.asarray(labels, dtype=np.int64),
        k=k,
        sq_distance=sq_distance,
        lengths=None if lengths is None else np.asarray(lengths, dtype=np.int64),
        response_tokens=(
            None if response_tokens is None else np.asarray(response_tokens, dtype=np.int64)
        ),
    )
    return run_selector(selector, inputs, SelectionParams(r, seed, balance))


def selection_from_table(
    frame: pl.DataFrame,
    selector: str,
    k: int,
    per_cluster: int,
    balance: str = "samples",
    token_budget: int | None = None,
) -> SelectionResult:
    """Rebuild a selector's result from a ``peripheral_subsets`` table (columns cluster,
    selected, copies, selection_rank, weight, and score where recorded); weights at full
    precision from the ``weight`` column."""
    per_cluster_weight = frame.group_by("cluster").agg(pl.col("weight").first()).sort("cluster")
    weights = np.ones(k)
    weights[per_cluster_weight["cluster"].to_numpy()] = per_cluster_weight["weight"].to_numpy()
    return SelectionResult(
        selector=selector,
        selected=frame["selected"].to_numpy(),
        copies=frame["copies"].to_numpy().astype(np.int64),
        selection_rank=frame["selection_rank"].to_numpy(),
        weight=frame["weight"].to_numpy(),
        cluster_weights=weights,
        per_cluster=per_cluster,
        balance=balance,
        token_budget=token_budget,
        score=frame["score"].to_numpy() if "score" in frame.columns else None,
    )


def per_cluster_summary(frame: pl.DataFrame) -> pl.DataFrame:
    """One row per cluster of a ``peripheral_subsets`` table (``cluster``, ``copies``,
    ``weight``, ``n_tokens``), in cluster order: ``n_c`` (its size), ``kept`` (samples kept,
    copies counted), ``kept_tokens`` (their tokens, copies counted) and ``w_c``."""
    return (
        frame.group_by("cluster")
        .agg(
            pl.len().alias("n_c"),
            pl.col("copies").sum().alias("kept"),
            (pl.col("n_tokens") * pl.col("copies")).sum().alias("kept_tokens"),
            pl.col("weight").first().alias("w_c"),
        )
        .sort("cluster")
    )

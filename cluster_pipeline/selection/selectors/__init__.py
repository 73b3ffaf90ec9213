"""The selector registry (docs/design.md, step 3): every way this project picks a subset of the
pool, one module each, behind one interface (``base``: :class:`SelectionInputs` ->
:class:`SelectionResult` with scores, plus its :class:`SelectionCost`).

``peripheral_subsets.selector`` chooses among :data:`REGISTRY`; the UI's description of that
knob is :func:`describe`. Adding a selector is one module here: its function ``(inputs,
params) -> SelectionResult`` (formula and source in the docstring) and its
specs (:class:`SelectorSpec`) in the module's ``SELECTORS``, which the registry finds by itself
(every module of this package that has one). The spec names its knobs (they join the run
config), its passes (``gather``, run by the Dagster layer's pass runner), its rules and its
record's details; sharding (cluster c on rank c for a ``clustered`` selector, random balanced
shards otherwise), the weights (w_c for a ``reweighted`` one, else 1) and the cost record
follow from it.

:func:`select` is the entry point for the selectors that read only the clustering (the six
before the registry, with their signature); :func:`run_selector` takes any selector's inputs,
:func:`gather_inputs` builds them through a pass runner.

Every selector is held to the ranks it must fill, here, whatever its module: before any of
its passes, :func:`fill_problems` refuses a pool it cannot give each of the K ranks a sample
from at the run's ratio and balance (issue 43: ifd, s2l, less and rds ran their expensive
passes on a pool of 3 for 2 ranks, then failed a stage later); after it ran,
:func:`empty_ranks` refuses a subset that leaves a rank with nothing, before anything is
written. :func:`smallest_pool` is the pool each needs.
"""

from __future__ import annotations

import importlib
import math
import pkgutil
import time
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import polars as pl
from pydantic import BaseModel, Field

from cluster_pipeline.selection.passes import (
    PASS_EMBEDDING,
    Gathered,
    PassCost,
    PassRunner,
    Pool,
    SelectionFacts,
)
from cluster_pipeline.selection.passes import knob as knob_named
from cluster_pipeline.selection.selectors.base import (
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
from cluster_pipeline.storage.tables import content_digest

__all__ = [
    "CLUSTER_SELECTORS",
    "REGISTRY",
    "REWEIGHTED_SELECTORS",
    "SELECTORS",
    "Balance",
    "PassCost",
    "SelectionCost",
    "SelectionInputs",
    "SelectionKnobs",
    "SelectionParams",
    "SelectionResult",
    "Selector",
    "SelectorSpec",
    "cluster_weights",
    "describe",
    "empty_ranks",
    "fill_problems",
    "problems_before_passes",
    "subset_version",
    "gather_inputs",
    "knob_classes",
    "knobs_of",
    "misplaced_knobs",
    "own_knobs",
    "needs_targets",
    "per_cluster_budget",
    "per_cluster_summary",
    "record_details",
    "run_selector",
    "select",
    "selection_from_table",
    "selector_rules",
    "smallest_pool",
    "token_budget",
    "with_selection",
]


def _discover() -> list[SelectorSpec]:
    """Every :class:`SelectorSpec` in the ``SELECTORS`` of this package's modules, in their
    ``order`` (then the module's own order)."""
    found: list[SelectorSpec] = []
    for module in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if module.name == "base":
            continue
        found += getattr(importlib.import_module(f"{__name__}.{module.name}"), "SELECTORS", ())
    names = [s.name for s in found]
    if len(set(names)) != len(names):
        raise ImportError(f"two selector modules register the same name: {sorted(names)}")
    return sorted(found, key=lambda s: s.order)


# Name -> selector, in the order the UI lists them (the first is the default).
REGISTRY: dict[str, SelectorSpec] = {s.name: s for s in _discover()}

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


def describe() -> str:
    """The UI's description of ``selector``: every registered selector, one clause each."""
    return "; ".join(f"{name} = {spec.summary}" for name, spec in REGISTRY.items()) + "."


class SelectionKnobs(BaseModel):
    """The knobs of every selection: the selector, ratio r, balance and seed (each selector's
    own knobs are its spec's ``knobs``)."""

    selector: Selector = Field(default=SELECTORS[0], description=describe())
    ratio: float = Field(
        default=0.5,
        gt=0.0,
        le=1.0,
        description="Selection ratio r: every "
        "cluster keeps floor(r * m) samples, m = smallest cluster size.",
    )
    seed: int = Field(default=0, ge=0, description="Seed of the random selectors.")
    balance: Balance = Field(
        default="tokens",
        description="tokens = every cluster keeps its selector's samples up to the same token "
        "budget, floor(r x the smallest cluster's tokens), so every rank does the same work; "
        "rank c's weight is K R_c / R (R_c the cluster's response tokens). samples = the "
        "published rule: floor(r x the smallest cluster's size) samples each, w_c = n_c K / N.",
    )


def needs_targets(name: str) -> bool:
    """Whether the selector ``name`` reads a target set (its knobs hold
    ``peripheral_subsets.target``)."""
    spec = REGISTRY.get(name)
    return spec is not None and "target" in spec.knobs.model_fields


def knob_classes() -> tuple[type[BaseModel], ...]:
    """Every selector's knob class, once each, in registry order (knob-less ones left out):
    the run config's selection knobs are :class:`SelectionKnobs` and these."""
    out: list[type[BaseModel]] = []
    for spec in REGISTRY.values():
        if spec.knobs.model_fields and spec.knobs not in out:
            out.append(spec.knobs)
    return tuple(out)


def knobs_of(selector: str, config: BaseModel | Mapping[str, Any]) -> BaseModel:
    """The knobs of ``selector`` (its spec's class) from a config holding them (the run
    config's ``peripheral_subsets``, or a dict of knob values; the rest ignored).

    Raises:
        KeyError: an unknown selector.
        pydantic.ValidationError: a knob outside its bounds.
    """
    fields = REGISTRY[selector].knobs.model_fields
    values = config.model_dump() if isinstance(config, BaseModel) else config
    return REGISTRY[selector].knobs.model_validate({k: v for k, v in values.items() if k in fields})


def own_knobs(selector: str) -> set[str]:
    """The ``peripheral_subsets`` knobs that apply to ``selector``: every selector's
    (:class:`SelectionKnobs`: selector, ratio, seed, balance) and its spec's knobs class's (the
    shared ones only for an unknown name)."""
    own = set(SelectionKnobs.model_fields)
    if selector in REGISTRY:
        own |= set(REGISTRY[selector].knobs.model_fields)
    return own


def _owners(knob: str) -> list[str]:
    return [name for name, spec in REGISTRY.items() if knob in spec.knobs.model_fields]


def _group(knob: str) -> str | None:
    """The ``GROUP`` of the knob class that declares ``knob`` (TargetKnobs: "the targeted
    selectors"), if it has one."""
    for spec in REGISTRY.values():
        for cls in spec.knobs.__mro__:
            if knob in vars(cls).get("__annotations__", {}):
                return vars(cls).get("GROUP")
    return None


def misplaced_knobs(selector: str, knobs: Iterable[str]) -> dict[str, str]:
    """Of ``knobs`` (given in a run config), those of other selectors than ``selector``, each
    with its rule: ``applies to selector s2l only (the selector is 'peripheral')`` (several
    owners: their group, e.g. ``the targeted selectors (rds, less)``)."""
    own = own_knobs(selector)
    out = {}
    for knob in knobs:
        owners = _owners(knob)
        if knob in own or not owners:
            continue
        group = _group(knob)
        if group is not None:
            who = f"{group} ({', '.join(owners)})"
        elif len(owners) == 1:
            who = f"selector {owners[0]}"
        else:
            who = f"the selectors {', '.join(owners)}"
        out[knob] = f"applies to {who} only (the selector is {selector!r})"
    return out


def selector_rules(selector: str, knobs: BaseModel, facts: SelectionFacts) -> list[str]:
    """The problems of ``selector``'s knobs under ``facts`` (its spec's ``rules``)."""
    spec = REGISTRY[selector]
    return spec.rules(knobs, replace(facts, selector=selector))


def _least_cluster(r: float) -> int:
    """The smallest cluster size m with floor(r m) >= 1 (r m rounded to 9 decimals, as the
    budgets round it)."""
    m = max(1, math.floor(1 / r))
    while math.floor(round(r * m, 9)) < 1:
        m += 1
    return m


def smallest_pool(selector: str, k: int, r: float, balance: str) -> int:
    """The smallest pool ``selector`` gives each of ``k`` ranks a sample from at ratio ``r``
    and ``balance``, the pool split into K equal clusters of equal samples (of at least 1 / r
    tokens under token balance):

    - a selector that keeps every cluster's share by a budget (``budgeted``): every cluster
      must keep floor(r m) >= 1 samples, m its size, so K ceil(1 / r) samples (sample
      balance); under token balance floor(r L_c) >= 1 token, and a clustered selector keeps at
      least each cluster's first sample: K samples; an unclustered one keeps the samples that
      fit K floor(r L_min) tokens, K of them only when r m >= 1: K ceil(1 / r) again;
    - one that keeps everything, or oversamples (``full``, ``uniform``): K.

    Raises:
        KeyError: an unknown selector.
    """
    spec = REGISTRY[selector]
    if not spec.budgeted or (balance == "tokens" and spec.clustered):
        return k
    return k * _least_cluster(r)


def _fill_advice(selector: str, k: int, r: float, balance: str) -> str:
    return (
        f"raise ratio, lower balanced_clusters.num_clusters, or add data ({selector} needs a "
        f"pool of at least {smallest_pool(selector, k, r, balance)} samples in {k} equal "
        f"clusters to fill {k} ranks at ratio {r}, balance {balance})"
    )


def problems_before_passes(
    selector: str, knobs: BaseModel, facts: SelectionFacts, pool: Pool, r: float, balance: str
) -> list[str]:
    """Everything that refuses ``selector`` on ``pool`` before any of its model passes: its
    own rules (:func:`selector_rules`) and whether it can fill every rank at ratio ``r`` and
    ``balance`` (:func:`fill_problems`); [] when none."""
    return selector_rules(selector, knobs, facts) + fill_problems(
        selector, pool.labels, pool.k, r, balance, pool.lengths
    )


def fill_problems(
    selector: str,
    labels: np.ndarray,
    k: int,
    r: float,
    balance: str,
    lengths: np.ndarray | None = None,
) -> list[str]:
    """Why ``selector`` cannot give each of the ``k`` ranks a sample from this clustered pool,
    known before any of its passes (one ``peripheral_subsets.<knob> = <value>: ...`` line; []
    when it can, as far as the budget tells: a selector that then keeps fewer samples than its
    budget allows, ifd leaving unscored samples out, is caught by :func:`empty_ranks`).

    Args:
        selector: a registered selector.
        labels: (N,) int64 cluster per sample, in [0, K).
        k: K, clusters = ranks.
        r: the selection ratio.
        balance: ``"samples"`` or ``"tokens"``.
        lengths: (N,) int64 tokens per sample (token balance).
    """
    spec = REGISTRY[selector]
    labels = np.asarray(labels, dtype=np.int64)
    sizes = np.bincount(labels, minlength=k)
    if len(labels) == 0 or (sizes == 0).any():
        return []  # the clustering's own refusal (an empty cluster) comes first
    advice = _fill_advice(selector, k, r, balance)
    ratio = knob_named("ratio", r)
    clusters = f"balanced_clusters.num_clusters = {k}"
    if not spec.budgeted:
        if spec.clustered or len(labels) >= k:
            return []
        return [
            f"{knob_named('selector', selector)}: deals the pool's {len(labels)} samples into "
            f"{k} ranks ({clusters}), fewer than one each; {advice}"
        ]
    if balance == "samples" or lengths is None:
        m = int(sizes.min())
        keep = math.floor(round(r * m, 9))
        if keep >= 1:
            return []
        return [
            f"{ratio}: {selector} keeps no sample: every cluster keeps floor(r x the smallest "
            f"cluster's size) = floor({r} x {m}) = 0 samples (cluster sizes {sizes.tolist()} "
            f"at {clusters}); {advice}"
        ]
    lengths = np.asarray(lengths, dtype=np.int64)
    totals = np.bincount(labels, weights=lengths, minlength=k).astype(np.int64)
    least = int(totals.min())
    per_cluster = math.floor(round(r * least, 9))
    if per_cluster == 0:
        return [
            f"{ratio}: {selector} keeps no sample: every cluster keeps floor(r x the smallest "
            f"cluster's tokens) = floor({r} x {least}) = 0 tokens (cluster tokens "
            f"{totals.tolist()} at {clusters}); {advice}"
        ]
    if spec.clustered:
        return []
    budget = k * per_cluster
    # The most samples the budget can hold: the shortest first (at least one, as kept).
    fits = max(1, int(np.searchsorted(np.cumsum(np.sort(lengths)), budget, side="right")))
    if fits >= k:
        return []
    return [
        f"{ratio}: {selector} can keep at most {fits} of the pool's {len(labels)} samples: its "
        f"budget, K x floor(r x the smallest cluster's tokens) = {k} x floor({r} x {least}) = "
        f"{budget} tokens, holds {fits} even taking the shortest first, and the {k} ranks "
        f"({clusters}) need a sample each; {advice}"
    ]


def empty_ranks(
    result: SelectionResult, labels: np.ndarray, k: int, r: float, pool_size: int
) -> str | None:
    """Why a selector's result would leave a rank with nothing to train (the one check before
    a subset is written, ``peripheral_subsets``); None when every rank gets a sample: a
    clustered selector's cluster c is rank c, so each cluster must keep a sample; an
    unclustered one's subset is dealt into K random shards, so it must keep K samples (copies
    counted).

    Args:
        result: the selector's result over the pool.
        labels: (N,) int64 cluster per sample.
        k: K.
        r: the ratio it ran at (for the message).
        pool_size: N (for the message).
    """
    selector = result.selector
    advice = "nothing was saved; raise ratio, lower balanced_clusters.num_clusters, or add data"
    if REGISTRY[selector].clustered:
        kept = np.bincount(np.asarray(labels, dtype=np.int64), weights=result.copies, minlength=k)
        empty = [c for c in range(k) if kept[c] == 0]
        if not empty:
            return None
        return (
            f"{knob_named('ratio', r)}: {selector} kept no sample of cluster(s) {empty} "
            f"(cluster c trains on rank c; kept per cluster {kept.astype(int).tolist()}), so "
            f"those ranks would train on nothing; {advice}"
        )
    n = int(result.copies.sum())
    if n >= k:
        return None
    return (
        f"{knob_named('ratio', r)}: {selector} kept {n} sample(s) of the pool's {pool_size} "
        f"for {k} ranks (balanced_clusters.num_clusters = {k}), so a rank would train on "
        f"nothing; {advice}"
    )


def record_details() -> dict[str, Any]:
    """Every selector's record details with the values recorded when it did not run, in
    registry order (the record of any selection holds them all)."""
    out: dict[str, Any] = {}
    for spec in REGISTRY.values():
        for key, value in spec.details.items():
            out.setdefault(key, value)
    return out


def gather_inputs(
    selector: str, knobs: BaseModel, pool: Pool, runner: PassRunner
) -> tuple[SelectionInputs, Gathered]:
    """The inputs of ``selector`` for ``pool``: the clustering's columns and what its
    ``gather`` asks of ``runner``; its cost record starts with the pool pass (for the
    selectors that read it).

    Returns:
        (the inputs, what its gather returned: its passes' costs and its record details).

    Raises:
        PassFailed: a pass cannot give the selector what it needs.
    """
    spec = REGISTRY[selector]
    gathered = spec.gather(knobs, pool, runner)
    fields = set(SelectionInputs.__dataclass_fields__)
    own = {k: v for k, v in gathered.inputs.items() if k in fields}
    extra = {k: v for k, v in gathered.inputs.items() if k not in fields}
    reads = gathered.reads_pool_pass
    reads = PASS_EMBEDDING in spec.passes if reads is None else reads
    # A clustered selector's clusters come from the pool pass, whatever its own passes read
    # (cluster_ifd: ifd's passes, which skip the pool pass's losses, and the clusters).
    reads = reads or spec.clustered
    first = (pool.cost,) if pool.cost is not None and reads else ()
    inputs = SelectionInputs(
        labels=np.asarray(pool.labels, dtype=np.int64),
        k=pool.k,
        sq_distance=pool.sq_distance,
        lengths=pool.lengths,
        response_tokens=pool.response_tokens,
        passes=(*first, *gathered.passes),
        extra=extra,
        **own,
    )
    return inputs, gathered


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
    missing = [need for need in spec.needs if inputs.get(need) is None]
    if missing:
        raise ValueError(f"selector {name!r} needs {', '.join(missing)}, which were not given")
    if not isinstance(params.knobs, spec.knobs):  # its defaults, or its knobs of a config
        params = replace(params, knobs=knobs_of(name, params.knobs or {}))
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


def with_selection(frame: pl.DataFrame, result: SelectionResult) -> pl.DataFrame:
    """``frame`` (the clustered pool, table order) with a selector's result as the columns of a
    ``peripheral_subsets`` table: ``selection_rank``, ``selected``, ``copies``, ``weight`` and
    ``score`` (null where nan or not recorded); :func:`selection_from_table` reads it back."""
    score = result.score if result.score is not None else np.full(frame.height, np.nan)
    return frame.with_columns(
        pl.Series("selection_rank", result.selection_rank),
        pl.Series("selected", result.selected),
        pl.Series("copies", result.copies),
        pl.Series("weight", result.weight),
        pl.Series("score", score, dtype=pl.Float64).fill_nan(None),
    )


def subset_version(frame: pl.DataFrame, selector: str, result: SelectionResult) -> str:
    """The data version of a ``peripheral_subsets`` table (:func:`with_selection`) made by
    ``selector``: its content and what ``shard_manifests`` reads beside it, how the subset is
    dealt (selector, balance, per-cluster budget, token budget); the same subset gives the same
    version."""
    return content_digest(
        frame,
        frame.columns,
        selector,
        result.balance,
        str(result.per_cluster),
        str(result.token_budget),
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

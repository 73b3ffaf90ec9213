"""Was the difference real? Paired comparisons with bootstrap intervals, and the gradient
diversity of a subset (docs/design.md, "Evaluation").

Two models are compared on the same items (held-out samples, benchmark problems): for item i,
a_{s,i} is the candidate's score from seed s and b_{t,i} the reference's from seed t. The
difference is the weighted mean over items of the seed-averaged scores,

    D = sum_i w_i (mean_s a_{s,i} - mean_t b_{t,i}) / sum_i w_i,

with w_i the item's weight (response tokens for a token-weighted loss, 1 otherwise). Its 95 %
confidence interval is a percentile bootstrap (``scipy.stats.bootstrap``) that resamples items,
candidate seeds and reference seeds independently (a two-level bootstrap: Davison & Hinkley,
*Bootstrap Methods and their Application*, 1997, sec. 3.8), so the interval holds seed variance
as well as item variance.

A percentile bootstrap over few items claims too much: with 8 benchmark problems, 3 solved by
the candidate alone and the other 5 tied, fewer than 2.5 % of resamples hold no solved problem,
so the interval [+0.125, +0.750] excludes 0, while only 3 items differ and an exact test gives
p = 0.25. So each comparison also carries the p-value of a paired randomization test (Fisher
1935; sign-flip test, Good, *Permutation Tests*, 2005, sec. 3.1): under "no difference" each
item's difference d_i = mean_s a_{s,i} - mean_t b_{t,i} is as likely to have either sign, and
p is the share of the 2^n sign patterns whose weighted mean is at least as far from 0 as D
(every pattern while 2^n <= 9,999, else 9,999 random ones, ``scipy.stats.permutation_test``).
For pass/fail items it is the exact sign test on the discordant items. The verdict is better
(or worse) only when the interval excludes 0 on that side *and* p < 0.05; otherwise no
detectable difference. The minimum detectable difference is (z_{0.975} + z_{0.8}) x SE = 2.80 SE,
the true difference a two-sided test at the 5 % level would detect with 80 % power given the
observed spread.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np
import polars as pl

Verdict = Literal["better", "no detectable difference", "worse"]
# (z_{1 - 0.05/2} + z_{0.8}): detectable at the 5 % level with 80 % power.
MDD_FACTOR = 1.959964 + 0.841621


@dataclass(frozen=True)
class Comparison:
    """A candidate against a reference on one metric.

    Attributes:
        difference: D above (candidate - reference), in the metric's unit.
        low / high: the 95 % bootstrap interval of D.
        standard_error: the bootstrap standard deviation of D.
        min_detectable: 2.80 x ``standard_error``.
        relative: D / the reference's mean (0.01 = 1 %).
        lower_is_better: True for losses, False for accuracies and pass rates.
        items, candidate_seeds, reference_seeds: how many of each went in.
        p_value: two-sided p of the paired sign-flip test of D (module docstring).
        confidence: the interval's coverage; the verdict's test level is 1 - confidence.
    """

    metric: str
    candidate: str
    reference: str
    difference: float
    low: float
    high: float
    standard_error: float
    min_detectable: float
    relative: float
    lower_is_better: bool
    items: int
    candidate_seeds: int
    reference_seeds: int
    p_value: float
    confidence: float = 0.95

    @property
    def verdict(self) -> Verdict:
        """Better / worse when the interval excludes 0 on that side and the sign-flip test
        rejects "no difference" at level 1 - confidence, else no detectable difference."""
        if (
            self.low <= 0.0 <= self.high
            or not np.isfinite([self.low, self.high]).all()
            or not self.p_value < 1.0 - self.confidence
        ):
            return "no detectable difference"
        improved = self.high < 0.0 if self.lower_is_better else self.low > 0.0
        return "better" if improved else "worse"

    def to_dict(self) -> dict:
        """The comparison as JSON-ready fields, its verdict included."""
        return {**asdict(self), "verdict": self.verdict}


def paired_bootstrap(
    candidate: np.ndarray,
    reference: np.ndarray,
    weights: np.ndarray | None = None,
    *,
    metric: str = "",
    names: tuple[str, str] = ("candidate", "reference"),
    lower_is_better: bool = True,
    confidence: float = 0.95,
    n_resamples: int = 2000,
    n_permutations: int = 9999,
    seed: int = 0,
) -> Comparison:
    """Compare per-item scores of two models (module docstring).

    Args:
        candidate: (S_a, n) float, one row per candidate seed, one column per item.
        reference: (S_b, n) float, the same items in the same order.
        weights: (n,) non-negative item weights (None = equal).
        metric: the metric's name, recorded in the result.
        names: (candidate, reference) group names, recorded in the result.
        lower_is_better: how to read the sign for the verdict.
        confidence: the interval's coverage (0.95).
        n_resamples: bootstrap resamples.
        n_permutations: sign patterns of the randomization test; all 2^n are used when there
            are no more than this.
        seed: the seed of the bootstrap and of a sampled randomization test.

    Raises:
        ValueError: the arrays disagree on n, n < 2, or the weights sum to 0.
    """
    from scipy.stats import bootstrap

    a = np.atleast_2d(np.asarray(candidate, dtype=np.float64))
    b = np.atleast_2d(np.asarray(reference, dtype=np.float64))
    n = a.shape[1]
    if b.shape[1] != n:
        raise ValueError(f"candidate has {n} items, reference {b.shape[1]}")
    if n < 2:
        raise ValueError("a paired bootstrap needs at least 2 items")
    w = np.ones(n) if weights is None else np.asarray(weights, dtype=np.float64)
    if w.shape != (n,) or (w < 0).any() or not w.sum() > 0:
        raise ValueError("weights must be (n,), non-negative, with a positive sum")
    # Items of weight 0 (e.g. no response token) count nowhere, so they are not resampled.
    keep = w > 0
    a, b, w = a[:, keep], b[:, keep], w[keep]
    n = int(keep.sum())
    if n < 2:
        raise ValueError("a paired bootstrap needs at least 2 items of positive weight")

    def difference(items, seeds_a, seeds_b) -> np.ndarray:
        # items: (..., n) resampled item indices; seeds_*: (..., S) resampled seed indices.
        mean_a = a[seeds_a].mean(axis=-2)  # (..., n)
        mean_b = b[seeds_b].mean(axis=-2)
        d = np.take_along_axis(mean_a - mean_b, items, axis=-1)
        wi = w[items]
        return (wi * d).sum(axis=-1) / wi.sum(axis=-1)

    # Only seed axes with more than one seed are resampled (one seed has no seed variance).
    data = [np.arange(n)]
    resample_a, resample_b = a.shape[0] > 1, b.shape[0] > 1
    if resample_a:
        data.append(np.arange(a.shape[0]))
    if resample_b:
        data.append(np.arange(b.shape[0]))

    def statistic(*arrays, axis=-1):
        items = arrays[0]
        batch = items.shape[:-1]
        rest = list(arrays[1:])
        sa = rest.pop(0) if resample_a else np.zeros((*batch, 1), dtype=np.int64)
        sb = rest.pop(0) if resample_b else np.zeros((*batch, 1), dtype=np.int64)
        return difference(items, sa, sb)

    observed = float(difference(np.arange(n), np.arange(a.shape[0]), np.arange(b.shape[0])))
    result = bootstrap(
        tuple(data),
        statistic,
        paired=False,
        vectorized=True,
        n_resamples=n_resamples,
        confidence_level=confidence,
        method="percentile",
        batch=256,
        rng=np.random.default_rng(seed),
    )
    se = float(result.standard_error)
    items_difference = a.mean(axis=0) - b.mean(axis=0)
    p_value = sign_flip_p_value(items_difference, w, n_permutations, seed)
    ref_mean = float((w * b.mean(axis=0)).sum() / w.sum())
    return Comparison(
        metric=metric,
        candidate=names[0],
        reference=names[1],
        difference=observed,
        low=float(result.confidence_interval.low),
        high=float(result.confidence_interval.high),
        standard_error=se,
        min_detectable=MDD_FACTOR * se,
        relative=observed / ref_mean if ref_mean else float("nan"),
        lower_is_better=lower_is_better,
        items=n,
        candidate_seeds=a.shape[0],
        reference_seeds=b.shape[0],
        p_value=p_value,
        confidence=confidence,
    )


def sign_flip_p_value(
    difference: np.ndarray, weights: np.ndarray, n_permutations: int = 9999, seed: int = 0
) -> float:
    """Two-sided p-value of the paired randomization (sign-flip) test of a weighted mean
    difference (module docstring; Good, *Permutation Tests*, 2005, sec. 3.1).

    Args:
        difference: (n,) float, each item's candidate - reference score.
        weights: (n,) positive item weights, fixed to their items.
        n_permutations: exact over all 2^n sign patterns when 2^n <= this, else this many
            random patterns (p then counts the observed pattern too, so it is never 0).
        seed: the random patterns' seed.

    Returns:
        p in (0, 1]; 1.0 when every difference is 0.
    """
    from scipy.stats import permutation_test

    d = np.asarray(difference, dtype=np.float64)
    w = np.asarray(weights, dtype=np.float64)
    if not np.any(d):
        return 1.0

    def weighted_mean(x, axis=-1):
        return (w * x).sum(axis=axis) / w.sum()

    result = permutation_test(
        (d,),
        weighted_mean,
        permutation_type="samples",
        alternative="two-sided",
        n_resamples=n_permutations,
        vectorized=True,
        rng=np.random.default_rng(seed),
    )
    return min(1.0, float(result.pvalue))


class DiversitySums:
    """Streaming :func:`gradient_diversity`: add (b, d) batches of gradients, each with a
    count (times it is trained), then read ``value``; float64 sums, memory (d,)."""

    def __init__(self) -> None:
        self.sq_norms = 0.0
        self.total: np.ndarray | None = None
        self.count = 0

    def add(self, vectors: np.ndarray, copies: np.ndarray | None = None) -> None:
        """Add (b, d) gradients, each trained ``copies`` times (default once)."""
        g = np.asarray(vectors, dtype=np.float64)
        c = np.ones(len(g)) if copies is None else np.asarray(copies, dtype=np.float64)
        self.sq_norms += float(c @ np.einsum("ij,ij->i", g, g))
        part = c @ g
        self.total = part if self.total is None else self.total + part
        self.count += int(c.sum())

    @property
    def value(self) -> float:
        """Delta of everything added (see :func:`gradient_diversity`).

        Raises:
            ValueError: nothing was added.
        """
        if self.total is None or self.count == 0:
            raise ValueError("gradient_diversity needs an (n, d) array with n >= 1")
        total = float(np.square(self.total).sum())
        return self.sq_norms / total if total > 0 else float("inf")


def gradient_diversity(vectors: np.ndarray) -> float:
    """Gradient diversity of a set of per-sample gradients (Yin et al., 2018, "Gradient
    Diversity: a Key Ingredient for Scalable Distributed Learning", Def. 1; the measure CluSTER
    reports for its subsets, Table 8):

        Delta = sum_i ||g_i||^2 / ||sum_i g_i||^2

    computed here on the proxy embeddings e_i (the gold-row last-layer gradients, (n, d)
    float32). It is 1/n when all gradients are equal and grows as they disagree (it exceeds 1
    when they partly cancel); larger is more diverse. Compare subsets of equal size.

    Raises:
        ValueError: fewer than one vector.
    """
    g = np.asarray(vectors)
    if g.ndim != 2 or len(g) == 0:
        raise ValueError("gradient_diversity needs an (n, d) array with n >= 1")
    sums = DiversitySums()
    sums.add(g)
    return sums.value


def subset_and_pool_diversity(
    batches: Iterable[tuple[pl.Series, np.ndarray]], copies: pl.DataFrame
) -> tuple[float, float]:
    """Gradient diversity (:func:`gradient_diversity`) of a subset as trained and of its pool,
    streamed: ``batches`` of (sample ids, (b, d) gradient proxies), ``copies`` a frame of
    ``sample_id`` and ``copies`` (times trained, 0 outside the subset) for the pool's samples;
    samples absent from ``copies`` (not clustered) are left out of both.

    Raises:
        ValueError: no sample of the batches is in ``copies``, or the subset is empty.
    """
    subset, pool = DiversitySums(), DiversitySums()
    for ids, gradients in batches:
        counts = ids.to_frame().join(copies, on="sample_id", how="left", maintain_order="left")
        clustered = counts["copies"].is_not_null().to_numpy()
        subset.add(gradients[clustered], counts["copies"].to_numpy()[clustered])
        pool.add(gradients[clustered])
    return subset.value, pool.value


def p_text(p: float, equals: bool = False) -> str:
    """A p-value at 3 significant digits, ``< 0.001`` below that (``= 0.25`` / ``< 0.001``
    with ``equals``)."""
    if p < 0.001:
        return "< 0.001"
    return f"= {p:.3g}" if equals else f"{p:.3g}"

"""Allocation (docs/design.md, step 4): one shard manifest per data-parallel rank.

For the clustered selectors, cluster c is trained on rank c, with the cluster's weight w_c. For
``random_global`` and ``full`` the selected samples are shuffled and dealt into K shards (weight
1): under sample balance K equal shards, up to K - 1 samples that do not fill a last row dropped
and counted; under token balance each sample, in the shuffled order, goes to the rank with the
fewest tokens so far (so the ranks' totals differ by less than one sample, nothing dropped).
Under sample balance every shard holds the same number of samples; under token balance the same
number of tokens, to within one sample. Either way the trainer plans the same number of
optimizer steps on every rank (unequal counts hang DDP; training/plan.py). Each shard's order is
a seeded shuffle.

A manifest's content hash is the sha256 of its ordered ``sample_id``/weight lines; a checkpoint
names the hashes of the manifests it was trained on.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import polars as pl

from cluster_pipeline.selection.selectors import (
    CLUSTER_SELECTORS,
    REWEIGHTED_SELECTORS,
    SelectionResult,
)
from cluster_pipeline.storage import atomic

# The checks of :func:`check_allocation`, by name, as the asset checks describe them.
CHECKS = {
    "equal_shards": "Every rank holds the same number of samples (sample balance) or of tokens "
    "to within its longest sample or 2 % (token balance), so no rank waits for another.",
    "coverage": "Every selected sample (with its copies) is in exactly one shard position.",
    "weights": "Each rank's loss weight equals n_c K / N (sample balance) or K R_c / R (token "
    "balance, R_c the cluster's response tokens), recomputed from the cluster labels.",
}

MANIFEST_SCHEMA = {
    "rank": pl.Int64,
    "position": pl.Int64,
    "sample_id": pl.String,
    "weight": pl.Float64,
    "manifest_sha256": pl.String,
}


def content_sha256(sample_ids: Sequence[str], weight: float) -> str:
    r"""A shard's content hash: sha256 over the lines ``"<sample_id>\t<repr(weight)>\n"`` in
    shard order (docs/design.md, step 4). 64 hex digits."""
    h = hashlib.sha256()
    for sid in sample_ids:
        h.update(f"{sid}\t{weight!r}\n".encode())
    return h.hexdigest()


@dataclass(frozen=True)
class ShardManifest:
    """The ordered samples that one rank trains on, and the weight of its loss."""

    dataset: str
    rank: int
    world_size: int
    selector: str
    weight: float
    seed: int
    sample_ids: tuple[str, ...]
    # Tokens of the shard's samples as the embedding pass counted them (0 if unknown); not part
    # of the content hash.
    tokens: int = 0

    @property
    def n_samples(self) -> int:
        """Entries of the shard (copies counted)."""
        return len(self.sample_ids)

    @property
    def sha256(self) -> str:
        """Content hash over the ordered (sample_id, weight) pairs (:func:`content_sha256`)."""
        return content_sha256(self.sample_ids, self.weight)

    def to_dict(self) -> dict:
        """The manifest as JSON-ready fields, with its size and content hash."""
        d = asdict(self)
        d["sample_ids"] = list(self.sample_ids)
        d["n_samples"] = self.n_samples
        d["sha256"] = self.sha256
        return d

    def write(self, folder: Path) -> Path:
        """Write ``rank_<rank>.json`` under ``folder``; returns its path."""
        folder.mkdir(parents=True, exist_ok=True)
        return atomic.write_text(
            folder / f"rank_{self.rank}.json", json.dumps(self.to_dict(), indent=1)
        )

    @classmethod
    def read(cls, path: Path) -> ShardManifest:
        """Load a manifest and verify its content hash (over the ordered sample ids and the
        weight, so a file reformatted without changing them, e.g. re-indented, still reads).

        Raises:
            FileNotFoundError: no file at ``path``.
            ValueError: the file is not a manifest (not JSON, fields missing or unknown), or
                its stored hash does not match its content (the file was edited); the message
                names the file and says to materialize shard_manifests again.
        """
        again = "materialize shard_manifests again"
        try:
            d = json.loads(Path(path).read_text())
            stored = d.pop("sha256", None)
            d.pop("n_samples", None)
            d["sample_ids"] = tuple(d["sample_ids"])
            manifest = cls(**d)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{path}: not a shard manifest ({e!r}); {again}") from None
        if stored is not None and stored != manifest.sha256:
            raise ValueError(
                f"{path}: content hash mismatch (stored sha256 {str(stored)[:12]}, content "
                f"{manifest.sha256[:12]}); the manifest was modified after shard_manifests "
                f"wrote it; {again}"
            )
        return manifest


def read_recorded_manifests(
    paths: Sequence[str | Path], sha256: Sequence[str], dataset: str
) -> list[ShardManifest]:
    """Each rank's manifest file, checked against the content hash ``shard_manifests``
    recorded for that rank: what training's pre-flight and the export both read. The hash is
    of the content (ordered sample ids and weight), so a whitespace-only reformat passes; ids
    added, removed or reordered, a weight edited, a manifest of another set or dataset copied
    in, or two ranks' files swapped are refused.

    Args:
        paths: the manifest files, in rank order (``ShardManifestsRecord.manifest_paths``).
        sha256: the recorded content hashes, in rank order.
        dataset: the dataset partition, for the messages.

    Returns:
        The K manifests, in rank order.

    Raises:
        ManifestMismatch: a file is gone, unreadable, edited, or not the one recorded for its
            rank; the message names the file, the expected and found hash prefixes and says to
            materialize shard_manifests again.
    """
    manifests = []
    for rank, (path, sha) in enumerate(zip(paths, sha256, strict=True)):
        try:
            manifest = ShardManifest.read(Path(path))
        except FileNotFoundError:
            raise ManifestMismatch(
                f"the shard manifest of rank {rank} of dataset {dataset!r}, {path}, is gone; "
                "materialize shard_manifests again"
            ) from None
        except ValueError as e:  # edited (hash mismatch) or not a manifest
            raise ManifestMismatch(str(e)) from None
        if manifest.sha256 != sha or manifest.rank != rank:
            raise ManifestMismatch(
                f"{path} holds rank {manifest.rank}'s manifest {manifest.sha256[:12]}, not the "
                f"rank {rank} manifest {sha[:12]} recorded by shard_manifests; materialize "
                "shard_manifests again"
            )
        manifests.append(manifest)
    return manifests


class ManifestMismatch(ValueError):
    """A shard manifest file is not the one ``shard_manifests`` recorded
    (:func:`read_recorded_manifests`)."""


@dataclass(frozen=True)
class Allocation:
    """The K shard manifests of a selection and the samples dropped to make shards equal."""

    manifests: list[ShardManifest]
    dropped: int

    @property
    def shard_size(self) -> int:
        """Samples of the largest shard (all shards under sample balance)."""
        return max(m.n_samples for m in self.manifests)

    @property
    def tokens_per_rank(self) -> list[int]:
        """Tokens of each rank's shard, in rank order."""
        return [m.tokens for m in self.manifests]

    @property
    def token_spread(self) -> float:
        """(max - min) / max of the ranks' tokens: 0 is perfect balance."""
        t = self.tokens_per_rank
        return (max(t) - min(t)) / max(t) if max(t) > 0 else 0.0


def allocate(
    dataset: str,
    sample_ids: np.ndarray,
    labels: np.ndarray,
    selection: SelectionResult,
    k: int,
    seed: int = 0,
    lengths: np.ndarray | None = None,
) -> Allocation:
    """Build the K shard manifests from a selection.

    Args:
        dataset: the partition, recorded in every manifest.
        sample_ids: (N,) str.
        labels: (N,) int64 cluster per sample.
        selection: the selector's result over the same N samples; its ``balance`` decides how
            unclustered selections are dealt.
        k: world size K.
        seed: seed of each shard's order (and of the unclustered deal).
        lengths: (N,) int64 tokens per sample (needed under token balance; recorded in the
            manifests when given).

    Raises:
        ValueError: fewer selected samples than ranks, token balance without lengths, or (a
            bug upstream) clustered shards of unequal size under sample balance.
    """
    sample_ids = np.asarray(sample_ids)
    rng = np.random.default_rng(seed)
    expanded = np.repeat(np.arange(len(sample_ids)), selection.copies)
    by_tokens = selection.balance == "tokens"
    if by_tokens and lengths is None:
        raise ValueError("token balance needs the samples' lengths")
    if selection.selector in CLUSTER_SELECTORS:
        shards = []
        for c in range(k):
            members = expanded[labels[expanded] == c]
            shards.append(members[rng.permutation(len(members))])
        if not by_tokens and len({len(s) for s in shards}) != 1:
            raise ValueError(f"shards of unequal size {[len(s) for s in shards]}")
        weights = selection.cluster_weights
        dropped = 0
    elif by_tokens and lengths is not None:
        if len(expanded) < k:
            raise ValueError(f"{len(expanded)} selected samples cannot fill {k} ranks")
        shuffled = expanded[rng.permutation(len(expanded))]
        load = np.zeros(k, dtype=np.int64)
        owner = np.empty(len(shuffled), dtype=np.int64)
        for j, i in enumerate(shuffled):
            owner[j] = int(np.argmin(load))
            load[owner[j]] += lengths[i]
        shards = [shuffled[owner == c] for c in range(k)]
        weights = np.ones(k)
        dropped = 0
    else:
        per_rank = len(expanded) // k
        if per_rank == 0:
            raise ValueError(f"{len(expanded)} selected samples cannot fill {k} ranks")
        shuffled = expanded[rng.permutation(len(expanded))]
        dropped = len(expanded) - per_rank * k
        shards = [shuffled[c * per_rank : (c + 1) * per_rank] for c in range(k)]
        weights = np.ones(k)
    manifests = [
        ShardManifest(
            dataset=dataset,
            rank=c,
            world_size=k,
            selector=selection.selector,
            weight=float(weights[c]),
            seed=seed,
            sample_ids=tuple(str(s) for s in sample_ids[shards[c]]),
            tokens=int(lengths[shards[c]].sum()) if lengths is not None else 0,
        )
        for c in range(k)
    ]
    return Allocation(manifests, dropped)


def manifests_frame(manifests: list[ShardManifest]) -> pl.DataFrame:
    """The ``shard_manifests`` table: one row per (rank, position) with the sample id, the rank's
    weight and its manifest's content hash (:data:`MANIFEST_SCHEMA`)."""
    return pl.concat(
        [
            pl.DataFrame(
                {
                    "rank": [m.rank] * m.n_samples,
                    "position": list(range(m.n_samples)),
                    "sample_id": list(m.sample_ids),
                    "weight": [m.weight] * m.n_samples,
                    "manifest_sha256": [m.sha256] * m.n_samples,
                },
                schema=MANIFEST_SCHEMA,
            )
            for m in manifests
        ]
    )


def manifest_set_hash(manifests: list[ShardManifest]) -> str:
    """sha256 over the ranks' manifest hashes, in rank order: names one allocation."""
    return hashlib.sha256("".join(m.sha256 for m in manifests).encode()).hexdigest()


def check_allocation(
    manifests: list[ShardManifest],
    sample_ids: np.ndarray,
    labels: np.ndarray,
    selection: SelectionResult,
    dropped: int,
    lengths: np.ndarray | None = None,
    response_tokens: np.ndarray | None = None,
) -> dict[str, tuple[bool, str]]:
    """Independent checks of an allocation against the selection it came from.

    Returns ``{name: (passed, description)}`` for:

    - ``equal_shards``: under sample balance every rank holds the same number of samples; under
      token balance the ranks' token totals (recomputed from ``lengths``) differ by at most the
      longest sample or 2 % of the largest total, whichever is more;
    - ``coverage``: the multiset of shard samples equals the selected samples with their copies
      (less the ``dropped`` remainder for the unclustered selectors);
    - ``weights``: each clustered rank's weight is n_c K / N of its cluster (sample balance) or
      K R_c / R (token balance, R_c the cluster's response tokens), recomputed from the labels
      and ``response_tokens`` (1 for the other selectors).
    """
    from collections import Counter

    sizes = [m.n_samples for m in manifests]
    if selection.balance == "tokens" and lengths is not None:
        index = {str(s): i for i, s in enumerate(sample_ids)}
        tokens = [int(sum(lengths[index[s]] for s in m.sample_ids)) for m in manifests]
        longest = int(max(lengths[index[s]] for m in manifests for s in m.sample_ids))
        allowed = max(longest, 0.02 * max(tokens))
        out = {
            "equal_shards": (
                max(tokens) - min(tokens) <= allowed,
                f"tokens per rank {tokens} (spread {max(tokens) - min(tokens)}, allowed "
                f"{allowed:.0f}), samples per rank {sizes}",
            )
        }
    else:
        out = {"equal_shards": (len(set(sizes)) == 1, f"shard sizes {sizes}")}
    pairs = zip(sample_ids, selection.copies, strict=True)
    expected = Counter({str(s): int(c) for s, c in pairs if c > 0})
    actual = Counter(sid for m in manifests for sid in m.sample_ids)
    missing = sum((expected - actual).values())
    extra = sum((actual - expected).values())
    covered = extra == 0 and missing == dropped
    out["coverage"] = (
        covered,
        f"{sum(actual.values())} shard entries; {missing} selected not in a shard "
        f"(allowed {dropped}), {extra} not selected",
    )
    k = len(manifests)
    if selection.selector in REWEIGHTED_SELECTORS and selection.balance == "tokens":
        if response_tokens is None:
            raise ValueError("checking token-balance weights needs the response tokens")
        r_c = np.bincount(labels, weights=response_tokens, minlength=k)
        want = r_c * k / r_c.sum()
    elif selection.selector in REWEIGHTED_SELECTORS:
        n_c = np.bincount(labels, minlength=k)
        want = n_c * k / n_c.sum()
    else:
        want = np.ones(k)
    got = np.array([m.weight for m in manifests])
    out["weights"] = (
        bool(np.allclose(got, want, rtol=1e-9)),
        f"rank weights {np.round(got, 6).tolist()}, expected {np.round(want, 6).tolist()}",
    )
    return out

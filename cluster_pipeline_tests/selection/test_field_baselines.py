"""The baselines the field now reports (issue 41): balanced_random (RDS+'s random-balanced),
longest (arXiv 2410.09335's token length) and cluster_less (DataFlex), each on hand-checked
pools, their passes asked of a fake runner (fake_runner.py)."""

import numpy as np
import pytest

from cluster_pipeline.selection.passes import PASS_EMBEDDING, ForwardPass, SelectionFacts
from cluster_pipeline.selection.selectors import (
    REGISTRY,
    SelectionInputs,
    SelectionParams,
    gather_inputs,
    knobs_of,
    misplaced_knobs,
    run_selector,
    selector_rules,
)
from cluster_pipeline.selection.selectors.balanced_random import round_robin_order
from cluster_pipeline_tests.selection.fake_runner import FakeRunner, tiny_pool

# --- balanced_random ---------------------------------------------------------------------------

# Seven samples from three files: a.jsonl holds 4, b.jsonl 2, c.jsonl 1 (first seen a, b, c).
SOURCES = np.array(["a.jsonl", "b.jsonl", "a.jsonl", "c.jsonl", "a.jsonl", "b.jsonl", "a.jsonl"])


def _released_balanced(per_source: dict[str, list[int]], num_samples: int) -> list[int]:
    """scripts/construct_downsampled_balanced.py:48-59 (automated-instruction-selection),
    transcribed: round robin over the datasets, popping each one's next sample, until
    num_samples (the final shuffle of line 64 only reorders the file)."""
    sampled_data: list[int] = []
    while len(sampled_data) < num_samples:
        for dataset_data in per_source.values():
            if len(dataset_data) == 0:
                continue
            if len(sampled_data) >= num_samples:
                break
            sampled_data.append(dataset_data.pop(0))
    return sampled_data


def _per_source(seed: int) -> dict[str, list[int]]:
    """Each source's samples in the seeded order the selector draws them (its turn within the
    source, read off the order it returns)."""
    order = round_robin_order(SOURCES, seed)
    out: dict[str, list[int]] = {}
    for i in order.tolist():
        out.setdefault(str(SOURCES[i]), []).append(i)
    return out


@pytest.mark.parametrize("budget", [3, 5, 6, 7])
def test_balanced_random_takes_the_sources_in_turn(budget):
    inputs = SelectionInputs(np.zeros(7, dtype=np.int64), 1, sources=SOURCES)
    result = run_selector("balanced_random", inputs, SelectionParams(r=budget / 7, seed=4))
    chosen = np.flatnonzero(result.selected)
    per_source = _per_source(4)
    assert sorted(_released_balanced({k: list(v) for k, v in per_source.items()}, budget)) == (
        chosen.tolist()
    )
    # By hand: 3 -> one of each; 5 -> a 2, b 2, c 1; 6 -> a 3; 7 -> all.
    counts = {s: int((SOURCES[chosen] == s).sum()) for s in ("a.jsonl", "b.jsonl", "c.jsonl")}
    want = {3: (1, 1, 1), 5: (2, 2, 1), 6: (3, 2, 1), 7: (4, 2, 1)}[budget]
    assert tuple(counts.values()) == want
    assert result.score is not None and np.isnan(result.score).all()
    assert (result.weight == 1).all()


def test_balanced_random_draws_at_random_within_a_source_and_by_tokens():
    draws = {tuple(_per_source(seed)["a.jsonl"]) for seed in range(8)}
    assert len(draws) > 1 and all(sorted(d) == [0, 2, 4, 6] for d in draws)
    # Token balance: lengths 10 each but sample 3 (c) 40; K = 1, L = 100, r = 0.5: B = 50. The
    # order a, b, c, ... cuts after a, b (20), since c's 40 would pass 50.
    lengths = np.array([10, 10, 10, 40, 10, 10, 10])
    inputs = SelectionInputs(
        np.zeros(7, dtype=np.int64), 1, lengths=lengths, response_tokens=lengths, sources=SOURCES
    )
    result = run_selector("balanced_random", inputs, SelectionParams(r=0.5, balance="tokens"))
    order = round_robin_order(SOURCES, 0)
    assert np.flatnonzero(result.selected).tolist() == sorted(order[:2].tolist())
    assert result.token_budget == 50


def test_balanced_random_reads_the_sources_and_runs_no_model_pass():
    runner = FakeRunner(sources=SOURCES.tolist())
    pool = tiny_pool([0, 0, 0, 1, 1, 1, 1])
    inputs, gathered = gather_inputs(
        "balanced_random", knobs_of("balanced_random", {}), pool, runner
    )
    assert runner.requests == [] and gathered.passes == ()
    assert inputs.sources is not None and inputs.sources.tolist() == SOURCES.tolist()
    assert runner.logs == ["balanced_random: 3 sources in the pool"]
    result = run_selector("balanced_random", inputs, SelectionParams(r=1 / 3))
    assert result.cost is not None and result.cost.passes == ()
    with pytest.raises(ValueError, match="needs sources"):
        run_selector("balanced_random", SelectionInputs(np.zeros(3, dtype=np.int64), 1))


# --- longest -----------------------------------------------------------------------------------


def test_longest_keeps_the_longest_responses_ties_to_the_lower_index():
    response = np.array([5, 9, 2, 9, 7, 1])
    lengths = np.array([20, 10, 30, 12, 9, 50])
    inputs = SelectionInputs(
        np.zeros(6, dtype=np.int64), 1, lengths=lengths, response_tokens=response
    )
    # Budget floor(0.5 x 6) = 3: T = 9 (1), 9 (3), 7 (4).
    result = run_selector("longest", inputs, SelectionParams(r=0.5))
    assert np.flatnonzero(result.selected).tolist() == [1, 3, 4]
    assert result.selection_rank.tolist() == [3, 0, 4, 1, 2, 5]
    assert result.score is not None and result.score.tolist() == response.tolist()
    # By the whole sample: 50 (5), 30 (2), 20 (0).
    whole = run_selector("longest", inputs, SelectionParams(r=0.5, knobs={"longest_by": "sample"}))
    assert np.flatnonzero(whole.selected).tolist() == [0, 2, 5]
    # Token balance: B = floor(0.5 x 131) = 65 tokens of the order 1 (10), 3 (12), 4 (9),
    # 0 (20): 51 tokens; 2 (30) would pass 65.
    tokens = run_selector("longest", inputs, SelectionParams(r=0.5, balance="tokens"))
    assert np.flatnonzero(tokens.selected).tolist() == [0, 1, 3, 4]
    assert REGISTRY["longest"].passes == () and "2410.09335" in REGISTRY["longest"].source


# --- cluster_less ------------------------------------------------------------------------------

D = 1024
# Nine samples in three obvious groups of representations: 0-2, 3-5, 6-8.
FEATURES = np.repeat(np.array([[1, 0], [0, 1], [-1, 0]], dtype=np.float32), 3, axis=0)
FEATURES = FEATURES + 0.01 * np.arange(9, dtype=np.float32)[:, None]
# Each sample's (first two coordinates of its) gradient: the first group's differ.
GRADIENTS = np.array(
    [[1, 0], [0, 1], [1, 0], [0, 1], [0, 1], [0, 1], [-1, 0], [-1, 0], [-1, 0]], dtype=np.float32
)
TARGETS = np.array([[1, 0], [0.6, 0.8]], dtype=np.float32)


def _padded(rows: np.ndarray) -> np.ndarray:
    out = np.zeros((len(rows), D), dtype=np.float32)
    out[:, :2] = rows / np.linalg.norm(rows, axis=1, keepdims=True)
    return out


def _answer(request: ForwardPass):
    if request.over == "pool":
        rows = GRADIENTS if request.samples is None else GRADIENTS[list(request.samples)]
        return np.ones(len(rows), dtype=bool), {"embedding": _padded(rows)}
    return np.ones(2, dtype=bool), {"embedding": _padded(TARGETS)}


def _dataflex_scores(labels, reps, rep_grads, targets):
    """src/dataflex/train/selector/cluster_less_selector.py:626-636, transcribed (one
    checkpoint): index_add the representatives' gradients per cluster, divide by the counts,
    normalise, then (cluster_grads @ eval.T).mean(dim=1) and each sample its cluster's."""
    num_clusters = int(labels.max()) + 1
    cluster_grads = np.zeros((num_clusters, rep_grads.shape[1]))
    cluster_counts = np.zeros((num_clusters, 1))
    np.add.at(cluster_grads, labels[reps], rep_grads)
    np.add.at(cluster_counts, labels[reps], 1.0)
    cluster_grads = cluster_grads / np.maximum(cluster_counts, 1.0)
    cluster_grads = cluster_grads / np.maximum(
        np.linalg.norm(cluster_grads, axis=1, keepdims=True), 1e-12
    )
    cluster_scores = (cluster_grads @ targets.T).mean(axis=1)
    return cluster_scores[labels]


def test_cluster_less_scores_each_cluster_by_its_representatives_mean_gradient():
    runner = FakeRunner(
        columns={"hidden_mean_normalised": FEATURES},
        answer=_answer,
        target_samples=2,
        learning_rates=(1.0,),
    )
    knobs = {
        "target": "mbpp",
        "less_warmup_steps": 2,
        "less_checkpoints": 1,
        "less_projection_dim": D,
        "less_warmup_fraction": 0.5,
        "cluster_less_cluster_size": 3,
        "cluster_less_samples_per_cluster": 2,
    }
    pool = tiny_pool([0] * 9)
    inputs, gathered = gather_inputs("cluster_less", knobs_of("cluster_less", knobs), pool, runner)
    labels = inputs.extra["cluster_less_labels"]
    reps = inputs.extra["cluster_less_representatives"]
    # k = ceil(9 / 3) = 3 clusters: the three groups; two representatives each.
    assert len({(int(a), b) for a, b in zip(labels, [0, 0, 0, 1, 1, 1, 2, 2, 2], strict=True)}) == 3
    assert len(set(labels.tolist())) == 3
    assert len(reps) == 6 and all((labels[reps] == c).sum() == 2 for c in np.unique(labels))
    # Only the representatives' gradients are asked, under less's own cache key.
    pool_passes = [r for r in runner.requests if isinstance(r, ForwardPass) and r.over == "pool"]
    assert [r.samples for r in pool_passes] == [tuple(reps.tolist())]
    assert pool_passes[0].key == "less_gradients-adam_released-d1024-s0"
    result = run_selector("cluster_less", inputs, SelectionParams(r=4 / 9, knobs=knobs))
    want = _dataflex_scores(labels, reps, _padded(GRADIENTS[reps]), _padded(TARGETS))
    assert result.score is not None
    np.testing.assert_allclose(result.score, want, atol=1e-6)
    # By hand: group 3-5 has gradient (0, 1): mean(0, 0.8) = 0.4; group 6-8 (-1, 0): -0.8;
    # group 0-2 holds (1, 0), (0, 1), (1, 0): representatives 0 and 2 give (1, 0), mean(1, 0.6)
    # = 0.8; one of them with 1 gives (1, 1) / sqrt 2, mean(0.707, 0.990) = 0.849.
    np.testing.assert_allclose(result.score[3:], [0.4] * 3 + [-0.8] * 3, atol=1e-6)
    first = 0.8 if set(reps[labels[reps] == labels[0]].tolist()) == {0, 2} else 2.4 / np.sqrt(8)
    assert result.score[0] == pytest.approx(first, abs=1e-6)
    # Budget 4: the best cluster whole (3 samples), then the next's lowest index.
    assert np.flatnonzero(result.selected).tolist() == [0, 1, 2, 3]
    assert result.n_selected == 4 and (result.weight == 1).all()
    assert gathered.details["cluster_less_clusters"] == 3
    assert result.cost is not None
    assert [p.name for p in result.cost.passes] == [
        PASS_EMBEDDING,
        "less_warmup",
        "less_gradients",
        "less_targets",
    ]
    assert result.cost.passes[2].samples == 6  # the representatives' gradients only


def test_cluster_less_knobs_are_less_s_and_its_own():
    assert misplaced_knobs("less", ["cluster_less_cluster_size", "less_lora_r"]) == {
        "cluster_less_cluster_size": "applies to selector cluster_less only (the selector is "
        "'less')"
    }
    facts = SelectionFacts(pool_size=10, pool_is="clustered samples")
    knobs = knobs_of("cluster_less", {"cluster_less_cluster_size": 64})
    assert selector_rules("cluster_less", knobs, facts) == [
        "peripheral_subsets.cluster_less_cluster_size = 64: more than the 10 clustered "
        "samples, so every sample would be one cluster; lower it"
    ]
    assert "DataFlex" in REGISTRY["cluster_less"].source

"""less (LESS, Xia et al. 2024): the Adam preconditioning on hand-checked moments, the
max-over-targets learning-rate-weighted sum on a hand-made case, the per-sample gradients of a
padded batch against one plain backward per sample, the projected cosine against the exact one
on a tiny model, and the errors."""

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from cluster_pipeline.data.packing import collate_rows
from cluster_pipeline.data.tokenization import encode_sample
from cluster_pipeline.selection.gradient_features import (
    AdamState,
    RademacherProjection,
    adam_precondition,
    gradient_dim,
    per_sample_gradients,
    rademacher_rows,
)
from cluster_pipeline.selection.selectors import (
    REGISTRY,
    SelectionInputs,
    SelectionParams,
    needs_targets,
    run_selector,
)
from cluster_pipeline.selection.selectors.less import (
    checkpoint_weights,
    influence_scores,
    subtasks_line,
)
from cluster_pipeline.training.config import TrainSettings
from cluster_pipeline.training.parallel import apply_lora


def test_adam_preconditioning_of_a_hand_checked_case():
    # m = 0.1, v = 0.01 after t = 1 step, g = 0.5 (b1 0.9, b2 0.999, eps 1e-8):
    # m' = 0.9 * 0.1 + 0.1 * 0.5 = 0.14,  m_hat = 0.14 / (1 - 0.9^2) = 0.14 / 0.19
    # v' = 0.999 * 0.01 + 0.001 * 0.25 = 0.01024,  v_hat = 0.01024 / (1 - 0.999^2) = 0.01024 /
    # 0.001999;  Gamma = m_hat / (sqrt(v_hat) + eps).
    # Second coordinate m = 0, v = 0, g = -2: m' = -0.2, v' = 0.004.
    state = AdamState(torch.tensor([0.1, 0.0]), torch.tensor([0.01, 0.0]), step=1)
    gamma = adam_precondition(torch.tensor([[0.5, -2.0]]), state, released=False)
    first = (0.14 / 0.19) / (math.sqrt(0.01024 / 0.001999) + 1e-8)
    second = (-0.2 / 0.19) / (math.sqrt(0.004 / 0.001999) + 1e-8)
    assert gamma.tolist()[0] == pytest.approx([first, second], rel=1e-6)
    assert first == pytest.approx(0.32556, rel=1e-5)  # 0.736842 / 2.263307


def test_the_default_preconditioning_is_the_authors_released_update():
    """less/data_selection/collect_grad_reps.py:113-125, transcribed: updated_avg = beta1 * avg
    + (1 - beta1) * g; updated_avg_sq = beta2 * avg_sq + (1 - beta2) * g ** 2; updated_avg /
    torch.sqrt(updated_avg_sq + eps), with beta1 0.9, beta2 0.999, eps 1e-08 and no bias
    correction."""
    rng = np.random.default_rng(0)
    avg = torch.tensor(rng.normal(0, 1e-3, 6), dtype=torch.float32)
    avg_sq = torch.tensor(rng.uniform(0, 1e-6, 6) * np.array([1, 1e-4, 1, 1e-6, 1, 0]))
    avg_sq = avg_sq.float()
    g = torch.tensor(rng.normal(0, 1e-3, (3, 6)), dtype=torch.float32)
    beta1, beta2, eps = 0.9, 0.999, 1e-08
    updated_avg = beta1 * avg + (1 - beta1) * g
    updated_avg_sq = beta2 * avg_sq + (1 - beta2) * g**2
    want = updated_avg / torch.sqrt(updated_avg_sq + eps)
    state = AdamState(avg, avg_sq, step=7)
    got = adam_precondition(g, state)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    # By hand on one coordinate: m = 0.1, v = 0.01, g = 0.5 -> 0.14 / sqrt(0.01024 + 1e-8).
    hand = AdamState(torch.tensor([0.1]), torch.tensor([0.01]), 1)
    one = adam_precondition(torch.tensor([[0.5]]), hand)
    assert one.item() == pytest.approx(0.14 / math.sqrt(0.01024 + 1e-8), rel=1e-6)
    # Where sqrt(v') is below 1e-4, eps under the root changes the direction: the cosine between
    # the released and the paper's Gamma is below 1 on these small moments.
    paper = adam_precondition(g, state, released=False)
    cos = torch.nn.functional.cosine_similarity(got, paper, dim=1)
    assert (cos < 0.999).all()


def test_the_influence_is_the_subtask_mean_then_the_max_as_the_authors_matching():
    """less/data_selection/matching.py:75-79, transcribed: influence_score += checkpoint_weight
    * train @ val.T over the checkpoints, then .reshape(N, N_SUBTASKS, -1).mean(-1).max(-1)
    (the validation samples stored subtask by subtask, equally many each)."""
    rng = np.random.default_rng(3)
    n, subtasks, per, c, d = 9, 3, 2, 2, 5

    def unit(shape):
        x = rng.normal(size=shape)
        return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)

    pool, targets = unit((n, c, d)), unit((subtasks * per, c, d))
    weights = [0.75, 0.25]
    influence_score = torch.zeros(n, subtasks * per, dtype=torch.float64)
    for i in range(c):
        influence_score += (
            weights[i] * torch.tensor(pool[:, i]).double() @ torch.tensor(targets[:, i]).double().T
        )
    want = influence_score.reshape(n, subtasks, -1).mean(-1).max(-1)[0].numpy()
    tasks = np.repeat(np.arange(subtasks), per)
    got = influence_scores(pool, targets, [3.0, 1.0], subtasks=tasks)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    # Through the selector, with the tasks named and shuffled: the same scores.
    perm = rng.permutation(len(targets))
    names = np.array(["algebra", "anatomy", "astronomy"])[tasks]
    inputs = SelectionInputs(
        np.zeros(n, dtype=np.int64),
        1,
        less_gradients=pool,
        less_target_gradients=targets[perm],
        less_learning_rates=np.array([3.0, 1.0]),
        target_tasks=names[perm],
    )
    result = run_selector("less", inputs, SelectionParams(r=1 / 3))
    assert result.score is not None
    np.testing.assert_allclose(result.score, want, rtol=1e-6)
    # less_subtasks: max is the max over single targets, which is not the same here.
    single = run_selector("less", inputs, SelectionParams(r=1 / 3, knobs={"less_subtasks": "max"}))
    assert single.score is not None
    np.testing.assert_allclose(single.score, influence_scores(pool, targets, [3.0, 1.0]))
    assert not np.allclose(single.score, want)
    # One named task (every record's `task` the same): one subtask, the mean over every target,
    # as matching.py's reshape(N, 1, -1).mean(-1).max(-1); no task named (""): the max.
    one = influence_score.reshape(n, 1, -1).mean(-1).max(-1)[0].numpy()
    same = replace(inputs, target_tasks=np.array(["same"] * len(targets)))
    got_one = run_selector("less", same, SelectionParams(r=1 / 3)).score
    assert got_one is not None
    np.testing.assert_allclose(got_one, one, rtol=1e-6)
    unnamed = replace(inputs, target_tasks=np.array([""] * len(targets)))
    got_max = run_selector("less", unnamed, SelectionParams(r=1 / 3)).score
    assert got_max is not None
    np.testing.assert_allclose(got_max, influence_scores(pool, targets, [3.0, 1.0]))
    # The run's line says which.
    assert subtasks_line(names, "mean_max") == (
        "less: the mean over each of the target set's 3 task(s), then the max over them (6 "
        "samples; less_subtasks: mean_max, matching.py)"
    )
    assert subtasks_line(np.array(["same"] * 6), "mean_max").startswith(
        "less: the mean over each of the target set's 1 task(s)"
    )
    assert subtasks_line(np.array([""] * 6), "mean_max") == (
        "less: the target set names no task: the max over its 6 samples"
    )
    assert (
        subtasks_line(names, "max")
        == "less: the max over the 6 target samples (less_subtasks: max)"
    )


def test_adam_state_from_an_optimizer_state_dict():
    a, b = torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.AdamW([a, b], lr=0.1, betas=(0.8, 0.99), eps=1e-6)
    a.grad, b.grad = torch.ones(2, 2), torch.full((3,), 2.0)
    opt.step()
    state = AdamState.from_optimizer_state(opt.state_dict())
    assert state.step == 1 and state.betas == (0.8, 0.99) and state.eps == 1e-6
    # After one step from zero moments: m = (1 - b1) g, v = (1 - b2) g^2, in parameter order.
    assert state.exp_avg.tolist() == pytest.approx([0.2] * 4 + [0.4] * 3)
    assert state.exp_avg_sq.tolist() == pytest.approx([0.01] * 4 + [0.04] * 3)
    with pytest.raises(ValueError, match="no Adam moments"):
        fresh = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
        AdamState.from_optimizer_state(fresh.state_dict())


def test_influence_is_the_max_over_targets_of_the_lr_weighted_cosine_sum():
    # Two checkpoints with eta = 3 and 1 (weights 0.75, 0.25), d = 2, unit vectors.
    e1, e2 = [1.0, 0.0], [0.0, 1.0]
    diag = [math.sqrt(0.5), math.sqrt(0.5)]
    pool = np.array([[e1, e1], [e2, e1], [diag, e2]], dtype=np.float32)  # (N=3, C=2, d=2)
    targets = np.array([[e1, e1], [e2, e2]], dtype=np.float32)  # (M=2, C=2, d=2)
    score = influence_scores(pool, targets, [3.0, 1.0])
    # z0: t0 0.75 * 1 + 0.25 * 1 = 1;   t1: 0 + 0 = 0                    -> 1
    # z1: t0 0 + 0.25 = 0.25;           t1: 0.75 + 0 = 0.75              -> 0.75
    # z2: t0 0.75 * 0.7071 + 0 = 0.530; t1: 0.75 * 0.7071 + 0.25 = 0.780 -> 0.780
    assert score.tolist() == pytest.approx([1.0, 0.75, 0.75 * math.sqrt(0.5) + 0.25])
    # The max is over the sum (eq. (2), then the max), not a sum of per-checkpoint maxima:
    # z1's per-checkpoint maxima would give 0.75 * 1 + 0.25 * 1 = 1.
    assert checkpoint_weights([3.0, 1.0]).tolist() == [0.75, 0.25]
    # One checkpoint given as (N, d).
    assert influence_scores(pool[:, 0], targets[:, 0], [1.0]).tolist() == pytest.approx(
        [1.0, 1.0, math.sqrt(0.5)]
    )


def _inputs(pool, targets, eta, k=1):
    n = len(pool)
    return SelectionInputs(
        labels=np.arange(n) % k,
        k=k,
        lengths=np.full(n, 10),
        response_tokens=np.full(n, 5),
        less_gradients=pool,
        less_target_gradients=targets,
        less_learning_rates=np.asarray(eta, dtype=np.float64),
    )


def test_less_keeps_the_top_scores_up_to_the_global_budget():
    rng = np.random.default_rng(0)
    pool = rng.normal(size=(8, 2, 4)).astype(np.float32)
    pool /= np.linalg.norm(pool, axis=2, keepdims=True)
    targets = pool[[5, 2]]  # pool samples 5 and 2 are targets: both score 1
    result = run_selector("less", _inputs(pool, targets, [1.0, 1.0], k=2), SelectionParams(r=0.5))
    # Global budget: K floor(r m) = 2 * floor(0.5 * 4) = 4 samples.
    assert result.n_selected == 4
    order = np.argsort(result.selection_rank)
    score = result.score
    assert score is not None
    assert set(order[:2].tolist()) == {2, 5} and score[[2, 5]] == pytest.approx([1, 1])
    assert (np.diff(score[order]) <= 1e-12).all()  # best first
    assert result.selected[order[:4]].all() and not result.selected[order[4:]].any()
    assert (result.weight == 1).all()
    # Token balance: K B tokens with B = floor(0.5 * 40) = 20: 40 tokens = 4 samples of 10.
    tokens = run_selector(
        "less", _inputs(pool, targets, [1.0, 1.0], k=2), SelectionParams(0.5, balance="tokens")
    )
    assert tokens.selected.tolist() == result.selected.tolist()


def test_less_refuses_mismatched_gradients_and_is_registered():
    pool = np.ones((3, 2, 4), dtype=np.float32) / 2
    with pytest.raises(ValueError, match="same checkpoints"):
        run_selector("less", _inputs(pool, pool[:, :1], [1.0, 1.0]))
    with pytest.raises(ValueError, match="must be >= 0"):
        run_selector("less", _inputs(pool, pool, [0.0, 0.0]))
    with pytest.raises(ValueError, match="needs less_gradients"):
        run_selector("less", SelectionInputs(labels=np.zeros(3, dtype=np.int64), k=1))
    assert "less" in REGISTRY and needs_targets("less") and needs_targets("rds")
    assert not needs_targets("s2l") and not needs_targets("peripheral")
    assert "Xia et al. 2024" in REGISTRY["less"].source


def test_the_rademacher_matrix_is_seeded_balanced_and_blockwise_consistent():
    r = rademacher_rows(0, 300, 512, seed=3, device="cpu")
    assert set(r.unique().tolist()) == {-1.0, 1.0}
    assert abs(float(r.mean())) < 0.01  # 153,600 signs: std of the mean 0.0026
    assert torch.equal(rademacher_rows(100, 50, 512, 3, "cpu"), r[100:150])
    assert not torch.equal(rademacher_rows(0, 300, 512, 4, "cpu"), r)

    def mix(x: int) -> int:  # the docstring's hash, in Python integers
        x &= 0xFFFFFFFF
        x = (((x >> 16) ^ x) * 0x45D9F3B) & 0xFFFFFFFF
        x = (((x >> 16) ^ x) * 0x45D9F3B) & 0xFFFFFFFF
        return (x >> 16) ^ x

    seed = (3 * 0x9E3779B1) % 2**32
    for i, j in [(0, 0), (0, 31), (7, 32), (299, 511), (123, 200)]:
        bit = (mix(mix(i + seed) + j // 32) >> (j % 32)) & 1
        assert r[i, j] == (1.0 if bit else -1.0)
    # d not a multiple of 32: the first d columns of the next multiple's matrix
    assert torch.equal(
        rademacher_rows(5, 3, 40, 3, "cpu"), rademacher_rows(5, 3, 64, 3, "cpu")[:, :40]
    )
    x = torch.randn(5, 300)
    whole = RademacherProjection(300, 512, seed=3, block_rows=1000)(x)
    blocks = RademacherProjection(300, 512, seed=3, block_rows=7)(x)
    assert torch.allclose(whole, blocks, atol=1e-4)
    assert torch.allclose(whole, x @ r / math.sqrt(512), atol=1e-4)


def _lora_model(tiny_model):
    import copy

    model = apply_lora(copy.deepcopy(tiny_model), TrainSettings(lora_r=4, seed=0))
    # LoRA starts with B = 0 (so dL/dA = 0); give B values, as a warm-up would.
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.1)
    return model.eval()


def _samples(tokenizer, n):
    texts = [
        ("What is 2 + 2?", "4"),
        ("Reverse the word cat.", "tac"),
        ("Name a colour.", "Blue, or green if you prefer a longer answer."),
        ("Add 10 and 5.", "10 + 5 = 15"),
        ("Say hi.", "hi there"),
    ]
    return [encode_sample(tokenizer, "", p, r, 64) for p, r in texts[:n]]


def test_per_sample_gradients_equal_one_plain_backward_per_sample(tiny_model, tiny_tokenizer):
    model = _lora_model(tiny_model)
    encoded = _samples(tiny_tokenizer, 4)
    batch = collate_rows(encoded, [[i] for i in range(4)], tiny_tokenizer.pad_token_id, False)
    grads, losses = per_sample_gradients(model, batch)
    assert grads.shape == (4, gradient_dim(model))
    params = [p for p in model.parameters() if p.requires_grad]
    for i, sample in enumerate(encoded):
        model.zero_grad()
        out = model(
            input_ids=torch.tensor([sample.input_ids]), labels=torch.tensor([sample.labels])
        )
        out.loss.backward()
        plain = torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None])
        assert float(losses[i]) == pytest.approx(out.loss.item(), abs=1e-5)
        assert torch.allclose(grads[i], plain, atol=1e-5, rtol=0)
        assert float(plain.norm()) > 1e-3  # a real gradient, not zeros


def test_projected_cosine_is_within_tolerance_of_the_exact_cosine(tiny_model, tiny_tokenizer):
    # JL: with d = 8192 a projected cosine's error has standard deviation at most
    # 1 / sqrt(d) = 0.011; 0.05 is more than four of them (the projection is seeded, so the
    # outcome is fixed).
    model = _lora_model(tiny_model)
    encoded = _samples(tiny_tokenizer, 5)
    batch = collate_rows(encoded, [[i] for i in range(5)], tiny_tokenizer.pad_token_id, False)
    grads, _ = per_sample_gradients(model, batch)
    state = AdamState(torch.zeros(grads.shape[1]), torch.full((grads.shape[1],), 1e-6), step=3)
    pool = adam_precondition(grads, state)
    targets = grads[[0, 3]]  # plain gradients, as for a target set
    exact = (
        torch.nn.functional.normalize(pool, dim=1) @ torch.nn.functional.normalize(targets, dim=1).T
    )
    project = RademacherProjection(grads.shape[1], 8192, seed=0)
    approx = (
        torch.nn.functional.normalize(project(pool), dim=1)
        @ torch.nn.functional.normalize(project(targets), dim=1).T
    )
    assert grads.shape[1] == 896  # the tiny model's LoRA (r = 4 on q_proj, v_proj, 2 layers)
    error = float((approx - exact).abs().max())
    assert error < 0.05, error
    assert exact.abs().max() > 0.1  # cosines far from 0 are compared, not noise

"""The projected (CountSketch) cosine between two gradients matches the exact one."""

import numpy as np
import pytest
import torch

from cluster_pipeline.data.tokenization import collate, encode_sample
from cluster_pipeline.training.gradients import cosine_matrix, count_sketch, mean_offdiagonal
from cluster_pipeline_tests.helpers import build_model, build_tokenizer, tiny_records


def _gradient(model, tok, records) -> list[torch.Tensor]:
    enc = [
        encode_sample(tok, "", r["instruction"] + " " + r["input"], r["output"], 64)
        for r in records
    ]
    batch = collate(enc, int(tok.pad_token_id))
    model.zero_grad()
    keys = ("input_ids", "attention_mask", "position_ids", "labels")
    model(**{k: batch[k] for k in keys}).loss.backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_sketch_cosine_is_within_its_stated_tolerance_of_the_exact_cosine():
    tok = build_tokenizer()
    model = build_model(len(tok), pad_token_id=tok.pad_token_id)
    model.train()
    records = tiny_records(24)
    # Two "ranks": arithmetic vs word reversal (different clusters), and two of one kind.
    grads = [
        _gradient(model, tok, records[0:12:2]),
        _gradient(model, tok, records[1:12:2]),
        _gradient(model, tok, records[12:24:2]),
    ]
    flat = torch.stack([torch.cat([g.reshape(-1) for g in gs]).double() for gs in grads])
    n_params = flat.shape[1]
    assert n_params > 20 * 1024  # the projection really reduces the dimension
    exact = cosine_matrix(flat)
    sketched = cosine_matrix(torch.stack([count_sketch(gs, 1024, seed=7) for gs in grads]))
    # The sketch's error on a cosine is O(1/sqrt(D)) = 0.031 for D = 1024; allow 3 sigma.
    np.testing.assert_allclose(sketched.numpy(), exact.numpy(), atol=0.1)
    assert exact[0, 2] > exact[0, 1]  # same-topic gradients agree more than cross-topic ones
    # The same seed and parameter order give the same projection.
    assert torch.equal(count_sketch(grads[0], 1024, seed=7), count_sketch(grads[0], 1024, seed=7))


def test_mean_offdiagonal():
    m = torch.tensor([[1.0, 0.2, 0.4], [0.2, 1.0, 0.6], [0.4, 0.6, 1.0]])
    assert mean_offdiagonal(m) == pytest.approx(0.4)
    assert np.isnan(mean_offdiagonal(torch.ones(1, 1)))

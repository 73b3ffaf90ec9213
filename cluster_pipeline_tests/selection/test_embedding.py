"""The gradient-proxy embedding against autograd, and its independence from batching."""

import numpy as np
import pytest
import torch

from cluster_pipeline.data.tokenization import collate, encode_sample
from cluster_pipeline.selection.embedding import embed_batch
from cluster_pipeline.selection.embedding_table import l2_normalise
from cluster_pipeline_tests.helpers import build_model, build_tokenizer

SAMPLES = [
    ("", "Add 3 and 4.", "The sum is 7."),
    ("", "Reverse the word apple.", "elppa"),
    (
        "Be brief.",
        "Write a python function that returns the sum of a list.",
        "def f(xs):\n    return sum(xs)",
    ),
    ("", "Explain the river.", "A river is water that flows to the sea " * 3),
    ("", "x", "y"),
    ("", "Multiply 12 by 3 and explain the product of the numbers in words.", "36, thirty six."),
    ("", "Sort the list [3, 1, 2].", "[1, 2, 3]"),
    ("", "Describe a cat.", "A cat is a small animal with letters c a t."),
]


def autograd_embedding(model, sample) -> tuple[np.ndarray, float, int]:
    """e = sum_t dL/dz_{t,y_t} h_t with h detached, L the mean token cross-entropy."""
    batch = collate([sample], 0, "right")
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    with torch.no_grad():
        hidden = decoder(input_ids=batch["input_ids"]).last_hidden_state[0, :-1]
    z = head(hidden).detach().requires_grad_(True)
    targets = batch["labels"][0, 1:]
    loss = torch.nn.functional.cross_entropy(z, targets, ignore_index=-100)
    loss.backward()
    mask = targets != -100
    gold_grad = z.grad[torch.arange(len(targets)), targets.clamp(min=0)] * mask
    e = (gold_grad[:, None] * hidden).sum(0)
    return e.numpy(), float(loss.detach()), int(mask.sum())


@pytest.mark.parametrize("index", range(4))
def test_embedding_equals_autograd_gold_logit_gradient(tiny_model, tiny_tokenizer, index):
    sample = encode_sample(tiny_tokenizer, *SAMPLES[index], max_length=128)
    want, want_loss, want_t = autograd_embedding(tiny_model, sample)
    got = embed_batch(tiny_model, collate([sample], tiny_tokenizer.pad_token_id))
    np.testing.assert_allclose(got.embedding[0], want, rtol=1e-4, atol=1e-7)
    assert got.mean_loss[0] == pytest.approx(want_loss, rel=1e-5)
    assert got.n_response_tokens[0] == want_t == sample.n_response_tokens


def test_embedding_matches_the_design_formula_by_hand(tiny_model, tiny_tokenizer):
    """(1/T) sum_t (p_t - 1) h_t written out with an explicit softmax."""
    sample = encode_sample(tiny_tokenizer, *SAMPLES[0], max_length=128)
    ids = torch.tensor([sample.input_ids])
    with torch.no_grad():
        h = tiny_model.model(input_ids=ids).last_hidden_state[0]
        probs = torch.softmax(tiny_model.lm_head(h), dim=-1)
    terms = []
    for pos in range(len(sample.labels) - 1):
        y = sample.labels[pos + 1]
        if y != -100:
            terms.append((probs[pos, y] - 1.0) * h[pos])
    want = torch.stack(terms).mean(0).numpy()
    got = embed_batch(tiny_model, collate([sample], 0)).embedding[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("padding_side", ["left", "right"])
@pytest.mark.parametrize("pad_kind", ["pad_token", "pad_is_eos", "no_pad_token"])
def test_embedding_is_the_same_alone_and_in_a_padded_batch(padding_side, pad_kind):
    pad = {"pad_token": "<pad>", "pad_is_eos": "<|im_end|>", "no_pad_token": None}[pad_kind]
    tok = build_tokenizer(pad=pad)
    pad_id = int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    model = build_model(len(tok), seed=3, pad_token_id=tok.pad_token_id)
    encoded = [encode_sample(tok, *s, max_length=128) for s in SAMPLES]
    assert len({len(e) for e in encoded}) > 4, "the batch must mix lengths"
    together = embed_batch(model, collate(encoded, pad_id, padding_side))
    for i, e in enumerate(encoded):
        alone = embed_batch(model, collate([e], pad_id, padding_side))
        np.testing.assert_allclose(together.embedding[i], alone.embedding[0], rtol=1e-4, atol=1e-6)
        assert together.mean_loss[i] == pytest.approx(alone.mean_loss[0], rel=1e-4)


def test_lm_head_chunking_does_not_change_the_result(tiny_model, tiny_tokenizer):
    encoded = [encode_sample(tiny_tokenizer, *s, max_length=128) for s in SAMPLES]
    batch = collate(encoded, tiny_tokenizer.pad_token_id)
    a = embed_batch(tiny_model, batch, chunk_rows=3)
    b = embed_batch(tiny_model, batch, chunk_rows=100000)
    np.testing.assert_allclose(a.embedding, b.embedding, rtol=1e-5, atol=1e-7)


def test_a_sample_without_response_tokens_is_refused(tiny_model, tiny_tokenizer):
    sample = encode_sample(
        tiny_tokenizer, "", "Add 3 and 4. " * 20, "7", max_length=16, truncation="skip"
    )
    assert sample.skip_reason == "no_response_tokens"
    with pytest.raises(ValueError, match="no response tokens"):
        embed_batch(tiny_model, collate([sample], 0))


def test_l2_normalise_gives_unit_rows_and_keeps_zero_rows():
    x = np.array([[3.0, 4.0], [0.0, 0.0]], dtype=np.float32)
    out = l2_normalise(x)
    np.testing.assert_allclose(out, [[0.6, 0.8], [0.0, 0.0]])


def test_bf16_autocast_stays_close_to_float32(tiny_model, tiny_tokenizer):
    encoded = [encode_sample(tiny_tokenizer, *s, max_length=128) for s in SAMPLES]
    batch = collate(encoded, tiny_tokenizer.pad_token_id)
    full = embed_batch(tiny_model, batch)
    half = embed_batch(tiny_model, batch, autocast_dtype=torch.bfloat16)
    assert half.embedding.dtype == np.float32
    cos = (full.embedding * half.embedding).sum(1) / (
        np.linalg.norm(full.embedding, axis=1) * np.linalg.norm(half.embedding, axis=1)
    )
    assert (cos > 0.99).all()
    np.testing.assert_allclose(half.mean_loss, full.mean_loss, rtol=0.02)


def test_hidden_mean_equals_the_mean_final_hidden_state_over_the_response(
    tiny_model, tiny_tokenizer
):
    """From the model's own hidden states (output_hidden_states, after the final norm), one
    sample at a time, at the positions that predict a response token; in a padded batch."""
    encoded = [encode_sample(tiny_tokenizer, *s, max_length=128) for s in SAMPLES]
    got = embed_batch(tiny_model, collate(encoded, tiny_tokenizer.pad_token_id))
    for i, sample in enumerate(encoded):
        with torch.no_grad():
            out = tiny_model(input_ids=torch.tensor([sample.input_ids]), output_hidden_states=True)
        h = out.hidden_states[-1][0]  # Llama: the final norm's output
        predicts_response = [p for p in range(len(sample) - 1) if sample.labels[p + 1] != -100]
        want = h[predicts_response].mean(0).numpy()
        np.testing.assert_allclose(got.hidden_mean[i], want, rtol=1e-4, atol=1e-6)

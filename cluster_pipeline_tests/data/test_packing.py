"""Packed batches against padded ones: the same outputs, losses and gradients per sample, with
sdpa's block mask and with variable-length attention; the packing gate told from rounding."""

import numpy as np
import pytest
import torch

from cluster_pipeline.data import attention
from cluster_pipeline.data.attention import forward_kwargs, reference_kernel, use_packed_attention
from cluster_pipeline.data.packing import (
    ALONE_EPS,
    CROSSING_EPS,
    PackCheck,
    can_pack,
    collate_rows,
    pack_check,
    pack_rows,
    padded_tokens,
    real_tokens,
    token_batches,
)
from cluster_pipeline.data.tokenization import IGNORE_INDEX, EncodedSample, encode_sample
from cluster_pipeline.selection.embedding import embed_batch, embed_samples
from cluster_pipeline.training.step import token_loss_sum
from cluster_pipeline_tests.selection.test_embedding import SAMPLES


def test_rows_by_hand():
    # Sorted 5, 4, 3, 3, 2 into rows of 8: first fit needs three rows (5+3 | 4+3 | 2, longest
    # 8); spread over three rows, longest first into the emptiest: 5 | 4+2 | 3+3 (longest 6).
    assert pack_rows([5, 4, 3, 3, 2], 8) == [[0], [1, 4], [2, 3]]
    # 6, 2, 2: first fit 6+2 | 2 (longest 8); even 6 | 2+2 (longest 6).
    assert pack_rows([6, 2, 2], 8) == [[0], [1, 2]]
    # Spreading cannot shorten the longest row: first fit's rows stay.
    assert pack_rows([4, 4, 4, 4], 8) == [[0, 1], [2, 3]]
    assert pack_rows([7, 1, 1, 1, 1, 1, 1, 1, 1, 1], 8) == [[0, 1], [2, 3, 4, 5, 6, 7, 8, 9]]
    # A sample longer than the bound gets a row of its own.
    assert pack_rows([10, 1], 8) == [[0], [1]]
    with pytest.raises(ValueError, match="max_row_tokens"):
        pack_rows([1], 0)


@pytest.mark.parametrize("seed", range(5))
def test_token_batches_place_every_sample_once_within_the_bounds(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 300, 200).tolist()
    batches = token_batches(lengths, max_batch_tokens=1000, max_row_tokens=256)
    flat = [i for b in batches for row in b for i in row]
    assert sorted(flat) == list(range(200))
    for b in batches:
        assert sum(lengths[i] for row in b for i in row) <= 1000 or sum(len(r) for r in b) == 1
        for row in b:
            assert sum(lengths[i] for i in row) <= 256 or len(row) == 1


def _sample(ids, labels):
    return EncodedSample(ids, labels, sum(x != IGNORE_INDEX for x in labels), False)


def test_collate_rows_restarts_positions_and_masks_each_first_label():
    a = _sample([5, 6, 7], [5, 6, 7])  # every label trained, the first one included
    b = _sample([8, 9], [IGNORE_INDEX, 9])
    c = _sample([1, 2, 3, 4], [IGNORE_INDEX, IGNORE_INDEX, 3, 4])
    batch = collate_rows([a, b, c], [[0, 1], [2]], pad_token_id=0)
    assert "attention_mask" not in batch
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9], [1, 2, 3, 4, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]]
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, 9], [-100, -100, 3, 4, -100]]
    assert batch["sample_index"].tolist() == [[0, 0, 0, 1, 1], [2, 2, 2, 2, -1]]
    assert real_tokens(batch) == 9 and padded_tokens(batch) == 10
    padded = collate_rows([a, b], [[0], [1]], pad_token_id=0, packed=False)
    assert padded["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    with pytest.raises(ValueError, match="one sample per row"):
        collate_rows([a, b], [[0, 1]], pad_token_id=0, packed=False)


@pytest.fixture
def encoded(tiny_tokenizer):
    return [encode_sample(tiny_tokenizer, *s, max_length=128) for s in SAMPLES]


def test_the_tiny_model_packs(tiny_model):
    assert can_pack(tiny_model)


def test_packed_embeddings_equal_padded_ones(tiny_model, tiny_tokenizer, encoded):
    pad = tiny_tokenizer.pad_token_id
    padded = embed_batch(tiny_model, collate_rows(encoded, [[i] for i in range(8)], pad, False))
    rows = [[0, 3, 5], [1, 2], [4, 6, 7]]
    packed = embed_batch(tiny_model, collate_rows(encoded, rows, pad, packed=True))
    order = [i for row in rows for i in row]
    np.testing.assert_allclose(packed.embedding, padded.embedding[order], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(packed.hidden_mean, padded.hidden_mean[order], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(packed.mean_loss, padded.mean_loss[order], rtol=1e-5)
    assert packed.n_response_tokens.tolist() == padded.n_response_tokens[order].tolist()
    # Through embed_samples: packed and padded batching give the same table, in input order.
    a, was_packed = embed_samples(tiny_model, encoded, pad, max_packed_length=64)
    b, was_padded = embed_samples(tiny_model, encoded, pad, packing=False)
    assert was_packed and not was_padded
    np.testing.assert_allclose(a.embedding, b.embedding, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(a.mean_loss, b.mean_loss, rtol=1e-5)


def _per_sample_losses_and_grads(model, batch, n):
    """Each sample's summed target cross-entropy and the gradient of their total (on the
    model's device)."""
    device = next(model.parameters()).device
    inputs = forward_kwargs(model, batch, device)  # the boundaries too, where the model reads them
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    model.zero_grad()
    logits = model(**inputs).logits
    ce = torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(),
        batch["labels"][:, 1:].flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    )
    owner = batch["sample_index"][:, 1:].flatten()
    keep = batch["labels"][:, 1:].flatten() != IGNORE_INDEX
    losses = torch.zeros(n, device=device).index_add_(0, owner[keep], ce[keep])
    total = token_loss_sum(logits, batch["labels"])
    torch.testing.assert_close(total, losses.sum(), rtol=1e-6, atol=1e-5)
    total.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    return losses.detach(), grads


def _check_packed_equals_padded(model, encoded, pad, rows, tolerance):
    model.train()
    try:
        _compare(model, encoded, pad, rows, tolerance)
    finally:
        model.eval()


def _compare(model, encoded, pad, rows, tolerance):
    n = len(encoded)
    padded = collate_rows(encoded, [[i] for i in range(n)], pad, packed=False)
    loss_pad, grad_pad = _per_sample_losses_and_grads(model, padded, n)
    packed = collate_rows(encoded, rows, pad, packed=True)
    loss_pack, grad_pack = _per_sample_losses_and_grads(model, packed, n)
    order = [i for row in rows for i in row]
    torch.testing.assert_close(loss_pack, loss_pad[order], rtol=tolerance, atol=tolerance)
    # Gradients sum over every token of the batch in another order: their float32 rounding is
    # measured relative to each parameter tensor's gradient norm.
    worst = max(
        float((grad_pack[k] - grad_pad[k]).norm() / grad_pad[k].norm().clamp(min=1e-30))
        for k in grad_pad
    )
    assert worst <= tolerance, worst
    # Without the restarted positions and boundaries (one sequence per row) the losses differ:
    # the test can tell packed attention from attention across samples.
    crossed = dict(packed)
    r, width = packed["input_ids"].shape
    crossed["position_ids"] = torch.arange(width).expand_as(packed["input_ids"])
    crossed["cu_seq_lens"] = torch.arange(0, (r + 1) * width, width, dtype=torch.int32)
    crossed["max_length"] = torch.tensor(width)
    loss_crossed, _ = _per_sample_losses_and_grads(model, crossed, n)
    assert not torch.allclose(loss_crossed, loss_pad[order], rtol=1e-3)
    return worst


@pytest.mark.parametrize("kernel", ["sdpa", "varlen"])
def test_packed_losses_and_gradients_equal_padded_ones_on_the_tiny_model(
    tiny_model, tiny_tokenizer, encoded, kernel, monkeypatch
):
    # float32: every per-sample loss and every parameter gradient within 1e-5; "varlen": the
    # registered variable-length attention with the CPU reference in place of the GPU kernel
    # (the padded batch runs its sdpa fallback).
    import copy

    model = tiny_model
    if kernel == "varlen":
        calls = []

        def counted(device_type):
            ref = reference_kernel()
            return attention.Kernel("reference", lambda *a: calls.append(1) or ref.run(*a), False)

        monkeypatch.setattr(attention, "packed_kernel", counted)
        model = copy.deepcopy(tiny_model)
        assert use_packed_attention(model, "cpu") == "reference"
    _check_packed_equals_padded(
        model, encoded, tiny_tokenizer.pad_token_id, [[0, 3, 5], [1, 2], [4, 6, 7]], 1e-5
    )
    if kernel == "varlen":
        # One forward of the packed and one of the crossed batch through every layer; the
        # padded batch ran sdpa.
        assert len(calls) == 2 * model.config.num_hidden_layers


@pytest.mark.slow
def test_packed_losses_and_gradients_equal_padded_ones_on_smollm2():
    from cluster_pipeline.models.loading import (
        BUILTIN_MODEL,
        load_model_and_tokenizer,
        resolve_model,
    )
    from cluster_pipeline.storage.layout import PROJECT_ROOT

    try:  # the folder `make run` converts the model into (about 30 s the first time)
        path = resolve_model(BUILTIN_MODEL, PROJECT_ROOT / "data" / "models")
    except Exception as e:  # noqa: BLE001 - any failure to find the package
        pytest.skip(f"the built-in model is not installed ({e}); run `make setup`")
    model, tok = load_model_and_tokenizer(path)
    encoded = [encode_sample(tok, *s, max_length=128) for s in SAMPLES[:6]]
    _check_packed_equals_padded(model, encoded, tok.pad_token_id, [[0, 1, 2], [3, 4, 5]], 1e-5)


@pytest.mark.gpu
def test_packed_losses_and_gradients_equal_padded_ones_on_cuda(tiny_model, tiny_tokenizer, encoded):
    # The same check on the GPU path (sdpa's CUDA kernels), float32 without TF32 matmuls.
    import copy

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = copy.deepcopy(tiny_model).cuda()
    rows = [[0, 3, 5], [1, 2], [4, 6, 7]]
    _check_packed_equals_padded(model, encoded, tiny_tokenizer.pad_token_id, rows, 1e-5)


@pytest.mark.gpu
def test_packed_losses_and_gradients_equal_padded_ones_on_cuda_with_varlen(
    tiny_model, tiny_tokenizer, encoded
):
    """The variable-length kernel (bfloat16 weights: it takes half dtypes only) against the
    padded batch's sdpa, to bfloat16 rounding: per-sample losses within 2 % and every
    gradient within 5 % of its norm; the kernel ran (the block-masked packed batch would
    agree as well, so the counter is the proof)."""
    import copy

    model = copy.deepcopy(tiny_model).to("cuda", torch.bfloat16)
    assert use_packed_attention(model, "cuda") in ("torch varlen_attn", "flash-attn varlen")
    kernel = attention.packed_kernel("cuda")
    assert kernel is not None
    calls = []
    original = kernel.run
    object.__setattr__(kernel, "run", lambda *a: calls.append(1) or original(*a))
    try:
        rows = [[0, 3, 5], [1, 2], [4, 6, 7]]
        _check_packed_equals_padded(model, encoded, tiny_tokenizer.pad_token_id, rows, 5e-2)
    finally:
        object.__setattr__(kernel, "run", original)
    assert calls


def _leaky_model(tiny_model, dtype):
    """The tiny model on eager attention with a deliberately wrong mask: plain causal over the
    whole row, so a packed sample attends to the samples before it."""
    import copy

    from transformers import AttentionInterface
    from transformers.models.llama.modeling_llama import eager_attention_forward

    def leaky(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        n = query.shape[2]
        low = torch.finfo(query.dtype).min
        causal = torch.full((n, n), low, dtype=query.dtype, device=query.device).triu(1)[None, None]
        return eager_attention_forward(module, query, key, value, causal, scaling, dropout)

    AttentionInterface.register("leaky_eager", leaky)
    model = copy.deepcopy(tiny_model).to(dtype)
    model.set_attn_implementation("leaky_eager")
    return model


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_model_held_in_half_precision_packs(tiny_model, dtype):
    import copy

    model = copy.deepcopy(tiny_model).to(dtype)
    check = pack_check(model)
    assert check.ok and check.dtype == str(dtype)
    # Same shapes, same positions: b's logits do not move when the sample before it changes.
    assert check.crossing == 0.0
    assert check.crossing_tolerance == pytest.approx(
        1e-3 + CROSSING_EPS * torch.finfo(dtype).eps * check.logit_scale
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_model_that_attends_across_samples_is_refused(tiny_model, dtype):
    model = _leaky_model(tiny_model, dtype)
    check = pack_check(model)
    assert not check.ok
    # Its crossing is a fraction of the logits' magnitude (0.35 of the largest here), several
    # times the rounding bound (8 eps of it: 0.06 in bfloat16).
    assert check.crossing > 0.2 * check.logit_scale
    assert check.crossing > 4 * check.crossing_tolerance
    assert "attends across packed samples" in check.reason("LlamaForCausalLM")
    assert not can_pack(model)


def test_rounding_between_packed_and_alone_logits_is_accepted_in_bfloat16(tiny_model):
    """A model whose packed and alone logits differ by a few bfloat16 roundings (as on a GPU,
    where the two forwards run kernels of other shapes; on the CPU they agree exactly, so the
    rounding is added here: 4 units in the last place of the largest logit on the alone
    forward) packs; the fixed 1e-3 of the old gate refused it."""
    import copy

    model = copy.deepcopy(tiny_model).to(torch.bfloat16)
    scale = float(pack_check(model).logit_scale)
    ulp = torch.finfo(torch.bfloat16).eps * scale

    def round_alone(module, args, output):
        if output.shape[0] == 1:  # the alone forward: one row
            sign = torch.ones_like(output).index_fill_(-1, torch.arange(0, output.shape[-1], 2), -1)
            return output + (4 * ulp * sign).to(output.dtype)
        return output

    handle = model.lm_head.register_forward_hook(round_alone)
    try:
        check = pack_check(model)
    finally:
        handle.remove()
    assert check.ok and check.crossing == 0.0
    assert 1e-3 < check.alone <= check.alone_tolerance
    assert check.alone_tolerance == pytest.approx(
        1e-3 + ALONE_EPS * torch.finfo(torch.bfloat16).eps * check.logit_scale
    )


def test_the_gate_checks_the_variable_length_kernel_where_the_model_runs_it(
    tiny_model, monkeypatch
):
    import copy

    calls = []

    def counted(device_type):
        ref = reference_kernel()
        return attention.Kernel("reference", lambda *a: calls.append(a[3].tolist()) or ref.run(*a))

    monkeypatch.setattr(attention, "packed_kernel", counted)
    model = copy.deepcopy(tiny_model).to(torch.bfloat16)
    assert use_packed_attention(model, "cpu") == "reference"
    check = pack_check(model)
    assert check.ok and check.crossing == 0.0
    # The packed forward ran the kernel in every layer, over rows [a, b] and [a', b].
    assert calls == [[0, 16, 24, 40, 48]] * model.config.num_hidden_layers


def test_the_gate_says_why_it_refused():
    crossing = PackCheck(False, 0.5, 0.01, 0.4, 0.2, "torch.bfloat16", 2.0)
    assert "attends across packed samples" in crossing.reason("M")
    positions = PackCheck(False, 0.0, 0.01, 0.4, 0.2, "torch.float32", 2.0)
    assert "does not honour restarted position ids" in positions.reason("M")
    assert "keeps packed samples apart" in PackCheck(True, 0, 1, 0, 1, "x", 1).reason("M")


@pytest.mark.gpu
@pytest.mark.parametrize("attn", ["sdpa", "varlen"])
def test_the_gate_accepts_bfloat16_and_refuses_crossing_on_cuda(tiny_model, attn):
    """On the GPU's kernels (sdpa or the variable-length one) a model held in bfloat16 packs,
    and the wrong-mask model is refused in bfloat16."""
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    # Deeper and wider than the tiny model: more rounding to tell from structure.
    config = LlamaConfig(
        vocab_size=2000, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=2,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to("cuda", torch.bfloat16)
    if attn == "varlen":
        use_packed_attention(model, "cuda")
    check = pack_check(model)
    assert check.ok, check
    leaky = _leaky_model(copy.deepcopy(tiny_model), torch.bfloat16).cuda()
    assert not pack_check(leaky).ok

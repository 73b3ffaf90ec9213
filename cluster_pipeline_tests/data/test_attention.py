"""Variable-length attention for packed rows (data/attention.py): the CPU reference of the
varlen contract against attention written out by hand, the boundaries of every row layout, and
the registered attention function (with the reference in place of the GPU kernel) against the
model's own sdpa numerics; on a GPU, PyTorch's kernel against the reference."""

import math

import pytest
import torch

from cluster_pipeline.data import attention
from cluster_pipeline.data.attention import (
    IMPLEMENTATION,
    Kernel,
    forward_kwargs,
    implementation,
    packed_attention,
    packed_attention_forward,
    reference_kernel,
    reference_varlen_attn,
    torch_varlen_kernel,
    use_packed_attention,
)
from cluster_pipeline.data.packing import collate_rows, sequence_boundaries
from cluster_pipeline.data.tokenization import IGNORE_INDEX, EncodedSample
from cluster_pipeline_tests.helpers import build_model


def by_hand(q, k, v, bounds, causal, scale=None):
    """Attention written out: per segment, scores = q k^T x scale (key heads repeated for
    grouped queries), a causal mask, softmax, times v. float64."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = scale if scale is not None else 1 / math.sqrt(q.shape[-1])
    out = torch.zeros_like(q)
    for s, e in zip(bounds, bounds[1:], strict=False):
        scores = torch.einsum("ihd,jhd->hij", q[s:e], k[s:e]) * scale
        if causal:
            n = e - s
            scores = scores.masked_fill(torch.ones(n, n).triu(1).bool(), -math.inf)
        out[s:e] = torch.einsum("hij,jhd->ihd", scores.softmax(-1), v[s:e])
    return out


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("causal", [True, False])
def test_the_reference_is_attention_per_segment(heads, causal):
    h, hk = heads
    g = torch.Generator().manual_seed(0)
    bounds = [0, 4, 5, 11, 18]
    q = torch.randn(18, h, 8, generator=g)
    k, v = torch.randn(18, hk, 8, generator=g), torch.randn(18, hk, 8, generator=g)
    cu = torch.tensor(bounds, dtype=torch.int32)
    got = reference_varlen_attn(
        q, k, v, cu, cu, 7, 7, window_size=(-1, 0) if causal else (-1, -1), enable_gqa=h != hk
    )
    torch.testing.assert_close(got.double(), by_hand(q, k, v, bounds, causal), atol=1e-6, rtol=0)
    # The scale is the one given (0.5 here), not 1/sqrt(D).
    got = reference_varlen_attn(q, k, v, cu, None, 7, 7, scale=0.5, enable_gqa=h != hk)
    torch.testing.assert_close(
        got.double(), by_hand(q, k, v, bounds, False, 0.5), atol=1e-6, rtol=0
    )


def test_the_reference_refuses_what_it_does_not_compute():
    q = torch.zeros(4, 2, 8)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="window"):
        reference_varlen_attn(q, q, q, cu, cu, 4, 4, window_size=(2, 0))
    with pytest.raises(ValueError, match="past max"):
        reference_varlen_attn(q, q, q, cu, cu, 3, 3)
    with pytest.raises(ValueError, match="GQA"):
        reference_varlen_attn(q, q[:, :1], q[:, :1], cu, cu, 4, 4)


@pytest.mark.parametrize(
    ("rows", "width", "offsets", "longest"),
    [
        ([[5]], 5, [0, 5], 5),  # one sample, as long as the row
        ([[3]], 5, [0, 5], 5),  # padding at the row's end counted in the sample
        ([[3, 1]], 6, [0, 3, 6], 3),  # two samples, the second one padded
        ([[6], [2, 3]], 6, [0, 6, 8, 12], 6),  # a full row, then a padded row of two
        ([[3, 2], [4]], 5, [0, 3, 5, 10], 5),  # several rows
        ([[1, 1, 1]], 3, [0, 1, 2, 3], 1),  # one-token samples
    ],
)
def test_the_boundaries_of_every_row_layout(rows, width, offsets, longest):
    assert sequence_boundaries(rows, width) == (offsets, longest)


def _sample(n, start=3):
    ids = list(range(start, start + n))
    return EncodedSample(ids, ids, n, False)


def test_the_collate_boundaries_are_where_positions_restart():
    samples = [_sample(n, 3 + 7 * i) for i, n in enumerate([5, 3, 7, 2, 6, 1])]
    rows = [[0, 1], [2], [3, 4, 5]]
    batch = collate_rows(samples, rows, pad_token_id=0, packed=True)
    flat = batch["position_ids"].flatten()
    width = batch["input_ids"].shape[1]
    # A sample starts where its position is 0; a row's padding continues its last sample.
    starts = (flat == 0).nonzero().flatten().tolist()
    assert batch["cu_seq_lens"].tolist() == [*starts, len(flat)]
    assert batch["cu_seq_lens"].dtype == torch.int32
    segments = torch.tensor([*starts, len(flat)]).diff()
    assert int(batch["max_length"]) == int(segments.max()) == width
    padded = collate_rows(samples, [[0], [1]], pad_token_id=0, packed=False)
    assert "cu_seq_lens" not in padded and "max_length" not in padded


def test_the_boundaries_refuse_a_row_that_does_not_fit():
    with pytest.raises(ValueError, match="more than the width"):
        sequence_boundaries([[3, 3]], 5)
    with pytest.raises(ValueError, match="no sample"):
        sequence_boundaries([[2], []], 5)


class Counting:
    """The reference kernel, counting its calls (so a test sees the kernel path ran, not the
    sdpa fallback)."""

    def __init__(self):
        self.calls = 0
        self.kernel = reference_kernel()

    def __call__(self, device_type):
        def run(*args):
            self.calls += 1
            return self.kernel.run(*args)

        return Kernel("reference", run, half_only=self.kernel.half_only)


@pytest.fixture
def reference(monkeypatch):
    """The reference kernel in place of the GPU one, on every device type."""
    counting = Counting()
    monkeypatch.setattr(attention, "packed_kernel", counting)
    return counting


SAMPLES = [[5, 3], [7], [2, 6], [8]]  # rows of sample lengths: padding, several, a full row


def _packed_batch(vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    samples, rows, k = [], [], 0
    for row in SAMPLES:
        rows.append(list(range(k, k + len(row))))
        for n in row:
            ids = torch.randint(3, vocab, (n,), generator=g).tolist()
            samples.append(EncodedSample(ids, [IGNORE_INDEX] + ids[1:], n - 1, False))
            k += 1
    return samples, rows


def _varlen_copy(model):
    import copy

    other = copy.deepcopy(model)
    assert use_packed_attention(other, "cpu") == "reference"
    assert implementation(other) == IMPLEMENTATION
    return other


def test_the_registered_attention_equals_sdpa_on_packed_rows(tiny_model, reference):
    """float32: logits of packed rows (padding, several samples, a sample as long as its row)
    through the reference kernel equal sdpa's block-masked ones; the kernel ran in every
    layer (grouped-query heads: 4 query, 2 key/value)."""
    samples, rows = _packed_batch(tiny_model.config.vocab_size)
    batch = collate_rows(samples, rows, 0, packed=True)
    with torch.no_grad():
        want = tiny_model(**forward_kwargs(tiny_model, batch, "cpu")).logits
        varlen = _varlen_copy(tiny_model)
        kwargs = forward_kwargs(varlen, batch, "cpu")
        assert kwargs["max_length_q"] == 8 and kwargs["cu_seq_lens_q"].tolist() == [
            0, 5, 8, 16, 18, 24, 32,
        ]  # fmt: skip
        got = varlen(**kwargs).logits
    assert reference.calls == tiny_model.config.num_hidden_layers
    real = batch["sample_index"] >= 0
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)


def test_the_registered_attention_falls_back_to_sdpa_where_the_kernel_does_not_apply(
    tiny_model, tiny_tokenizer, reference
):
    """Padded batches (an attention mask) and generate() (a KV cache) run sdpa with the mask
    transformers built: the same numbers as the sdpa model, the kernel never called."""
    samples, _ = _packed_batch(tiny_model.config.vocab_size)
    padded = collate_rows(samples, [[i] for i in range(4)], 0, packed=False)
    varlen = _varlen_copy(tiny_model)
    with torch.no_grad():
        want = tiny_model(**forward_kwargs(tiny_model, padded, "cpu")).logits
        got = varlen(**forward_kwargs(varlen, padded, "cpu")).logits
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        prompt = torch.tensor([samples[0].input_ids])
        a = tiny_model.generate(prompt, max_new_tokens=5, do_sample=False)
        b = varlen.generate(prompt, max_new_tokens=5, do_sample=False)
    assert a.tolist() == b.tolist()
    assert reference.calls == 0


class _Layer(torch.nn.Module):
    is_causal = True


# Every case where the variable-length kernel does not compute what the layer asks (module
# docstring): each must take transformers' sdpa path with its arguments untouched.
NOT_THE_KERNELS = {
    "dropout": {"dropout": 0.1},
    "not causal": {"is_causal": False},
    "sliding window": {"sliding_window": 2},
    "soft-capping": {"softcap": 30.0},
    "sink tokens": {"s_aux": torch.zeros(2)},
    "position bias": {"position_bias": torch.zeros(1, 2, 6, 6)},
    "no boundaries": {"cu_seq_lens_q": None},
}


@pytest.mark.parametrize("case", list(NOT_THE_KERNELS))
def test_each_case_the_kernel_does_not_compute_falls_back_to_sdpa(case, reference, monkeypatch):
    """The attention function called directly, boundaries given (two samples of 3 in a row of
    6): the reference kernel runs only where it computes what the layer asks; dropout, a
    non-causal layer, a sliding window, soft-capping, sink tokens, a position bias or missing
    boundaries go to sdpa, called with the same arguments (what sdpa returns is returned)."""
    from transformers.integrations import sdpa_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=g) for _ in range(3))
    base = {"cu_seq_lens_q": torch.tensor([0, 3, 6], dtype=torch.int32), "max_length_q": 3}
    seen: list[dict] = []

    def sdpa(module, query, key, value, mask, **kwargs):
        seen.append(kwargs)
        return torch.full((1, 6, 2, 4), 7.0), None

    monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward", sdpa)
    out, _ = packed_attention_forward(_Layer(), q, k, v, None, **base)
    assert reference.calls == 1 and not seen  # the kernel computes this one
    tq, tk, tv = (x[0].transpose(0, 1) for x in (q, k, v))  # (tokens, heads, dim)
    cu = torch.tensor([0, 3, 6], dtype=torch.int32)
    want = reference_varlen_attn(tq, tk, tv, cu, None, 3, 3, window_size=(-1, 0))
    torch.testing.assert_close(out[0], want, rtol=1e-6, atol=1e-6)
    args = {**base, **NOT_THE_KERNELS[case]}
    out, _ = packed_attention_forward(_Layer(), q, k, v, None, **args)
    assert reference.calls == 1, case  # not called again
    assert len(seen) == 1 and torch.equal(out, torch.full((1, 6, 2, 4), 7.0))
    for name, value in NOT_THE_KERNELS[case].items():
        given = seen[0].get(name)
        assert given is value or given == value, (name, given)


def test_a_query_shorter_than_its_keys_falls_back_to_sdpa(reference):
    """A KV cache's decoding step (1 query against 6 cached keys) of a causal layer runs sdpa,
    which returns the softmax-weighted values of all 6 keys (the newest query sees every
    key)."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 1, 4, generator=g)
    k, v = (torch.randn(1, 2, 6, 4, generator=g) for _ in range(2))
    cu = torch.tensor([0, 1], dtype=torch.int32)
    out, _ = packed_attention_forward(_Layer(), q, k, v, None, cu_seq_lens_q=cu, max_length_q=1)
    assert reference.calls == 0
    weights = torch.softmax(q @ k.transpose(-1, -2) / 2.0, dim=-1)  # 1/sqrt(4)
    torch.testing.assert_close(out, (weights @ v).transpose(1, 2), rtol=1e-5, atol=1e-6)


def test_the_registered_attention_runs_autocast_in_its_dtype(tiny_model, reference):
    """bfloat16 autocast over float32 weights (the embedding pass's bf16 setting): q and k
    come out of the rotary embedding in float32, v in bfloat16; the kernel gets all three in
    bfloat16, as sdpa would under autocast, and agrees with sdpa to bfloat16 rounding."""
    samples, rows = _packed_batch(tiny_model.config.vocab_size, seed=1)
    batch = collate_rows(samples, rows, 0, packed=True)
    varlen = _varlen_copy(tiny_model)
    seen = []
    kernel = reference.kernel.run

    def spy(q, k, v, *rest):
        seen.append((q.dtype, k.dtype, v.dtype))
        return kernel(q, k, v, *rest)

    reference.kernel = Kernel("spy", spy, half_only=True)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = tiny_model(**forward_kwargs(tiny_model, batch, "cpu")).logits.float()
        got = varlen(**forward_kwargs(varlen, batch, "cpu")).logits.float()
    assert seen and set(seen) == {(torch.bfloat16,) * 3}
    real = batch["sample_index"] >= 0
    scale = float(want[real].abs().max())
    assert float((got[real] - want[real]).abs().max()) <= 8 * 2**-8 * scale


def test_float32_without_autocast_stays_on_sdpa_for_a_half_only_kernel(tiny_model, reference):
    samples, rows = _packed_batch(tiny_model.config.vocab_size)
    batch = collate_rows(samples, rows, 0, packed=True)
    varlen = _varlen_copy(tiny_model)
    reference.kernel = Kernel("half only", reference.kernel.run, half_only=True)
    with torch.no_grad():
        want = tiny_model(**forward_kwargs(tiny_model, batch, "cpu")).logits
        got = varlen(**forward_kwargs(varlen, batch, "cpu")).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert reference.calls == 0


def _old_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False,
                     scale=None):  # fmt: skip
    """torch 2.9-2.10's signature (``is_causal``, no GQA), computed by the reference."""
    assert key.shape[1] == query.shape[1], "this signature takes no grouped heads"
    window = (-1, 0) if is_causal else (-1, -1)
    return reference_varlen_attn(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window_size=window
    )


@pytest.mark.parametrize("fn", [reference_varlen_attn, _old_varlen_attn], ids=["2.13", "2.10"])
def test_the_kernel_adapter_speaks_both_varlen_signatures(fn):
    """Causality as window_size=(-1, 0) or is_causal=True; grouped heads by enable_gqa or by
    repeating the key/value heads: the same attention either way."""
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(9, 4, 8, generator=g), *torch.randn(2, 9, 2, 8, generator=g)
    cu = torch.tensor([0, 3, 9], dtype=torch.int32)
    got = torch_varlen_kernel(fn, half_only=False).run(q, k, v, cu, 6, None)
    torch.testing.assert_close(got.double(), by_hand(q, k, v, [0, 3, 9], True), atol=1e-6, rtol=0)


def test_the_kernel_is_chosen_by_device_and_what_is_installed():
    assert attention.packed_kernel("cpu") is None
    cuda = attention.packed_kernel("cuda")
    # This torch has varlen_attn and no flash-attn is installed: PyTorch's kernel (chosen, not
    # run: no GPU here).
    assert cuda is not None and cuda.name == "torch varlen_attn" and cuda.half_only


def test_a_model_switches_only_where_a_kernel_exists_and_it_attends_with_sdpa(
    tiny_model, reference
):
    import copy

    model = copy.deepcopy(tiny_model)
    with packed_attention(model, "cpu") as name:
        assert name == "reference" and implementation(model) == IMPLEMENTATION
    assert implementation(model) == "sdpa"  # restored
    model.set_attn_implementation("eager")
    assert use_packed_attention(model, "cpu") == "eager"  # the user's choice is kept
    assert implementation(model) == "eager"


def test_without_a_kernel_nothing_changes(tiny_model, monkeypatch):
    import copy

    monkeypatch.setattr(attention, "packed_kernel", lambda device_type: None)
    model = copy.deepcopy(tiny_model)
    assert use_packed_attention(model, "cpu") == "sdpa" and implementation(model) == "sdpa"
    samples, rows = _packed_batch(model.config.vocab_size)
    kwargs = forward_kwargs(model, collate_rows(samples, rows, 0, packed=True), "cpu")
    assert "cu_seq_lens_q" not in kwargs  # sdpa reads the positions, not the boundaries


@pytest.mark.gpu
def test_torch_varlen_attn_equals_the_reference_on_cuda():
    kernel = attention.packed_kernel("cuda")
    assert kernel is not None
    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 100, 117, 400, 512], dtype=torch.int32, device="cuda")
    q = torch.randn(512, 8, 64, generator=g).to("cuda", torch.bfloat16)
    k, v = (torch.randn(512, 2, 64, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    got = kernel.run(q, k, v, cu, 283, None).float()
    want = reference_varlen_attn(
        q.float(), k.float(), v.float(), cu, cu, 283, 283, window_size=(-1, 0), enable_gqa=True
    )
    assert float((got - want).abs().max()) <= 2e-2


@pytest.mark.gpu
def test_a_small_llama_attends_with_varlen_on_cuda_as_with_sdpa():
    model = build_model(1000, seed=0).to("cuda", torch.bfloat16)
    samples, rows = _packed_batch(1000)
    batch = collate_rows(samples, rows, 0, packed=True)
    with torch.no_grad():
        want = model(**forward_kwargs(model, batch, "cuda")).logits.float()
        assert use_packed_attention(model, "cuda") in ("torch varlen_attn", "flash-attn varlen")
        got = model(**forward_kwargs(model, batch, "cuda")).logits.float()
    real = (batch["sample_index"] >= 0).cuda()
    scale = float(want[real].abs().max())
    assert float((got[real] - want[real]).abs().max()) <= 8 * 2**-8 * scale

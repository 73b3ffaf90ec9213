"""The training step's kernels (training/kernels.py): the chunked loss against hand-computed
values and torch's cross-entropy, the loss module against the model's logits, the kernel
choice by device and what is installed, fused AdamW and compiled layers against today's
numerics; MFU by hand (training/mfu.py)."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from cluster_pipeline.data.packing import collate_rows
from cluster_pipeline.data.tokenization import IGNORE_INDEX, EncodedSample
from cluster_pipeline.training import kernels
from cluster_pipeline.training.kernels import (
    CausalLMLoss,
    adamw_options,
    compile_layers,
    decoder_layers,
    fusable,
    linear_cross_entropy_sum,
    loss_kernel,
    token_loss_sum,
)
from cluster_pipeline.training.mfu import mfu, mfu_record, peak_flops


def test_the_chunked_loss_by_hand():
    # Zero hidden states: every logit 0, each row's loss log V exactly, for any chunk size.
    hidden = torch.zeros(5, 3, requires_grad=True)
    weight = torch.randn(7, 3, requires_grad=True)
    targets = torch.tensor([0, 6, 2, 2, 5])
    for chunk in (1, 2, 5, 64):
        loss = linear_cross_entropy_sum(hidden, weight, targets, chunk_rows=chunk)
        assert float(loss.detach()) == pytest.approx(5 * math.log(7), rel=1e-7)
    # Two words, logits (0, ln 3): p = (1/4, 3/4); the loss of target 1 is -ln(3/4), its
    # gradient w.r.t. the logits (1/4, -1/4), so dL/dh = W^T (1/4, -1/4) = -ln(3)/4 and
    # dL/dW = (1/4, -1/4)^T h = (1/4, -1/4).
    hidden = torch.tensor([[1.0]], requires_grad=True)
    weight = torch.tensor([[0.0], [math.log(3)]], requires_grad=True)
    loss = linear_cross_entropy_sum(hidden, weight, torch.tensor([1]))
    assert float(loss.detach()) == pytest.approx(-math.log(0.75), rel=1e-7)
    loss.backward()
    assert hidden.grad is not None and weight.grad is not None
    assert float(hidden.grad) == pytest.approx(-math.log(3) / 4, rel=1e-6)
    assert weight.grad.flatten().tolist() == pytest.approx([0.25, -0.25], rel=1e-6)


@pytest.mark.parametrize("chunk", [1, 7, 1024])
@pytest.mark.parametrize("bias", [False, True])
def test_the_chunked_loss_equals_torch_cross_entropy_in_float32(chunk, bias):
    """Loss and the gradients of hidden states, weight and bias within 1e-6 (relative) of
    F.cross_entropy over the whole logits, with an upstream gradient other than 1."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=g).requires_grad_(True)
    weight = torch.randn(50, 16, generator=g).requires_grad_(True)
    b = torch.randn(50, generator=g).requires_grad_(True) if bias else None
    targets = torch.randint(0, 50, (37,), generator=g)
    inputs = [x for x in (hidden, weight, b) if x is not None]
    want = F.cross_entropy(F.linear(hidden, weight, b), targets, reduction="sum")
    want_grads = torch.autograd.grad(want * 2.5, inputs)
    got = linear_cross_entropy_sum(hidden, weight, targets, b, chunk_rows=chunk)
    got_grads = torch.autograd.grad(got * 2.5, inputs)
    assert got.dtype == torch.float32
    assert float((got - want).abs() / want.abs()) <= 1e-6
    for a, c in zip(want_grads, got_grads, strict=True):
        assert float((a - c).norm() / a.norm()) <= 1e-6


def test_the_chunked_loss_skips_gradients_nobody_asked_for():
    hidden = torch.randn(4, 3, requires_grad=True)
    weight = torch.randn(5, 3)  # frozen (a LoRA run's head)
    loss = linear_cross_entropy_sum(hidden, weight, torch.tensor([0, 1, 2, 3]))
    loss.backward()
    assert hidden.grad is not None and weight.grad is None
    with pytest.raises(ValueError, match="chunk_rows"):
        linear_cross_entropy_sum(hidden, weight, torch.tensor([0, 1, 2, 3]), chunk_rows=0)
    with pytest.raises(ValueError, match="targets"):
        linear_cross_entropy_sum(hidden, weight, torch.tensor([0]))


def _batch(vocab: int, seed: int = 0):
    """A packed batch of four samples in two rows (padding, first labels -100) and a padded
    one of the same samples."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for n, prompt in [(9, 3), (5, 2), (12, 4), (6, 1)]:
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        samples.append(EncodedSample(ids, [IGNORE_INDEX] * prompt + ids[prompt:], n, False))
    packed = collate_rows(samples, [[0, 1], [2, 3]], 0, packed=True)
    padded = collate_rows(samples, [[i] for i in range(4)], 0, packed=False)
    return packed, padded


def _loss_and_grads(module, batch):
    from cluster_pipeline.data.attention import forward_kwargs

    module.zero_grad()
    loss = module(labels=batch["labels"], **forward_kwargs(module, batch, "cpu"))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    return loss.detach(), grads


@pytest.mark.parametrize("layout", ["packed", "padded"])
@pytest.mark.parametrize("tied", [False, True])
def test_the_loss_module_equals_the_logits_loss(layout, tied):
    """float32: the chunked loss module's loss and every parameter's gradient within 1e-6
    (relative) of the model's logits and token_loss_sum, tied embeddings too."""
    from cluster_pipeline_tests.helpers import build_model

    model = build_model(300, seed=1, tie_word_embeddings=tied).train()
    batch = _batch(300)[0 if layout == "packed" else 1]
    chunked = CausalLMLoss(model, "chunked", chunk_rows=5)
    assert chunked.kernel == "chunked"
    logits = CausalLMLoss(copy.deepcopy(model), "logits")
    got, got_grads = _loss_and_grads(chunked, batch)
    want, want_grads = _loss_and_grads(logits, batch)
    assert float((got - want).abs() / want) <= 1e-6
    assert got_grads.keys() == want_grads.keys()
    for name, g in want_grads.items():
        assert float((got_grads[name] - g).norm() / g.norm()) <= 1e-6, name
    # Without labels the module is the model: logits, for the packing gate.
    with torch.no_grad():
        inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
        torch.testing.assert_close(chunked(**inputs).logits, model(**inputs).logits)


def test_a_micro_batch_without_targets_gives_zero_and_zero_gradients():
    """The step plan's placeholder micro-batch (one padding token, no target): loss 0 and a
    zero gradient for every parameter (DDP's synchronising backward expects all of them)."""
    from cluster_pipeline_tests.helpers import build_model

    model = build_model(100).train()
    module = CausalLMLoss(model, "chunked")
    one = torch.zeros((1, 1), dtype=torch.long)
    loss = module(labels=one + IGNORE_INDEX, input_ids=one, position_ids=one, use_cache=False)
    loss.backward()
    assert float(loss) == 0.0
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and float(g.abs().max()) == 0.0 for g in grads)


def test_the_loss_runs_on_logits_where_the_head_is_not_a_plain_linear_map():
    from peft import LoraConfig, get_peft_model

    from cluster_pipeline_tests.helpers import build_model

    model = build_model(100)
    assert fusable(model)
    lora_head = get_peft_model(
        copy.deepcopy(model), LoraConfig(r=2, target_modules=["q_proj", "lm_head"])
    )
    assert not fusable(lora_head)
    assert CausalLMLoss(lora_head, "chunked").kernel == "logits"
    lora = get_peft_model(copy.deepcopy(model), LoraConfig(r=2, target_modules=["q_proj"]))
    assert fusable(lora)
    capped = copy.deepcopy(model)
    capped.config.final_logit_softcapping = 30.0
    assert not fusable(capped)


def test_the_loss_kernel_is_chosen_by_device_and_what_is_installed(monkeypatch):
    assert not kernels.liger_installed()  # the project's CPU machines do not install it
    assert loss_kernel("cpu") == "chunked"
    assert loss_kernel("cuda") == "chunked"  # no liger-kernel: the torch chunked loss
    assert loss_kernel("cuda", fused=False) == loss_kernel("cpu", fused=False) == "logits"
    monkeypatch.setattr(kernels, "liger_installed", lambda: True)
    assert loss_kernel("cuda") == "liger"
    assert loss_kernel("cpu") == "chunked"  # Liger's kernels are Triton: CUDA only
    with pytest.raises(ValueError, match="loss kernel"):
        CausalLMLoss(torch.nn.Linear(2, 2), "fused")


def test_liger_kernels_are_not_applied_where_the_package_is_absent():
    from cluster_pipeline_tests.helpers import build_model

    model = build_model(100)
    why = kernels.apply_liger_kernels(model)
    assert why is not None and "not installed" in why


def test_fused_adamw_is_chosen_on_cuda_and_equals_the_default():
    assert adamw_options(torch.device("cpu")) == {}
    assert adamw_options(torch.device("cuda", 0)) == {"fused": True}
    # The fused implementation (its CPU kernel here) takes the same steps as the for-each
    # default, within 1e-6 after three steps with weight decay.
    g = torch.Generator().manual_seed(0)
    start = torch.randn(64, 8, generator=g)
    grads = [torch.randn(64, 8, generator=g) for _ in range(3)]
    out = []
    for fused in (False, True):
        p = torch.nn.Parameter(start.clone())
        opt = torch.optim.AdamW([p], lr=1e-2, weight_decay=0.1, fused=fused)
        for grad in grads:
            p.grad = grad.clone()
            opt.step()
        out.append(p.detach())
    torch.testing.assert_close(out[1], out[0], rtol=1e-6, atol=1e-6)
    assert not torch.equal(out[0], start)


def test_decoder_layers_are_found_through_the_loss_module():
    from cluster_pipeline_tests.helpers import build_model

    model = build_model(100)
    assert len(decoder_layers(model)) == 2
    assert decoder_layers(CausalLMLoss(model)) == decoder_layers(model)


@pytest.mark.slow
def test_compiled_layers_give_the_same_loss_and_gradients():
    """``compile: true``: each decoder layer through torch.compile (the aot_eager backend here:
    the graph capture and autograd of compilation without a C++ compiler) gives today's loss
    and gradients within 1e-6."""
    from cluster_pipeline_tests.helpers import build_model

    model = build_model(300, seed=2).train()
    batch = _batch(300)[0]
    want, want_grads = _loss_and_grads(CausalLMLoss(copy.deepcopy(model)), batch)
    assert compile_layers(model, backend="aot_eager") == 2
    got, got_grads = _loss_and_grads(CausalLMLoss(model), batch)
    assert float((got - want).abs() / want) <= 1e-6
    for name, g in want_grads.items():
        assert float((got_grads[name] - g).norm() / g.norm()) <= 1e-6, name


def test_token_loss_sum_is_the_cross_entropy_of_each_next_token():
    logits = torch.zeros(1, 3, 4)
    logits[0, 0, 2] = math.log(3)  # position 0 predicts token 2 with p = 3/6
    labels = torch.tensor([[IGNORE_INDEX, 2, IGNORE_INDEX]])
    assert float(token_loss_sum(logits, labels)) == pytest.approx(-math.log(0.5), rel=1e-6)


def test_mfu_by_hand():
    # 6 x 1e9 parameters x 1e6 tokens / (10 s x 1 rank x 1e15 FLOP/s) = 0.6.
    assert mfu(10**9, 10**6, 10.0, 1e15) == pytest.approx(0.6)
    assert mfu(10**9, 10**6, 10.0, 1e15, ranks=2) == pytest.approx(0.3)
    assert mfu(10**9, 10**6, 10.0, 1e15, lora=True) == pytest.approx(0.4)
    with pytest.raises(ValueError, match="positive"):
        mfu(1, 1, 0.0, 1e15)
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA GeForce RTX 4090") is None
    record = mfu_record(1_100_000_000, 2_000_000, 100.0, "NVIDIA H200", 1)
    assert record["value"] == round(6 * 1.1e9 * 2e6 / (100.0 * 989e12), 4) == 0.1335
    assert mfu_record(10, 10, 1.0, "an unknown GPU", 1)["value"] is None


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["chunked", "liger"])
def test_the_fused_losses_equal_the_logits_loss_on_cuda_in_bfloat16(kernel):
    """On the GPU, bfloat16 autocast over float32 weights (the bf16 knob): the chunked loss
    and Liger-Kernel's fused linear cross-entropy (where installed) against the logits' loss,
    to bfloat16 rounding (loss within 1e-2, gradients within 5e-2 of their norms)."""
    if kernel == "liger":
        pytest.importorskip("liger_kernel")
    from cluster_pipeline_tests.helpers import build_model

    model = build_model(300, seed=1).cuda().train()
    batch = {k: v.cuda() for k, v in _batch(300)[0].items()}
    out = []
    for name in (kernel, "logits"):
        module = CausalLMLoss(copy.deepcopy(model), name)
        assert module.kernel == name
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = module(
                labels=batch["labels"],
                input_ids=batch["input_ids"],
                position_ids=batch["position_ids"],
                use_cache=False,
            )
        loss.backward()
        grads = {n: p.grad.float() for n, p in module.named_parameters() if p.grad is not None}
        out.append((float(loss.detach()), grads))
    (got, got_grads), (want, want_grads) = out
    assert abs(got - want) <= 1e-2 * want
    for name, g in want_grads.items():
        assert float((got_grads[name] - g).norm() / g.norm()) <= 5e-2, name

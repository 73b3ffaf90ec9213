"""The GPU training step and embedding pass, configuration by configuration: real tokens per
second and MFU, against the padded step measured in the same run.

    python benchmarks/gpu_step.py                    # one H200: ~1.1B Llama, bf16, < 8 min
    python benchmarks/gpu_step.py --smoke            # CPU, a tiny Llama, seconds (a test runs it)
    python benchmarks/gpu_step.py --out gpu_step.jsonl --peak-tflops 989

One rank trains rank 0's token-balanced shard of ``alpaca_cherry_5pct`` (the lengths of
``benchmarks/throughput_lengths.json``, random token ids; the product selected them) on a
randomly initialised Llama of TinyLlama's shape (22 layers, hidden 2,048, 32 heads, 4 key/value
heads, vocabulary 32,000: 1.1B parameters), weights in bfloat16, through the product's own
step (``training/plan.py``'s plans, ``training/step.accumulate``, ``data/packing.py``'s
collate), at the ``gpu8`` profile's knobs: packed micro-batches of 8,192 real tokens in rows of
4,096, 4 accumulated; the padded baseline takes 16 samples per micro-batch, 4 accumulated.
Each configuration adds one thing to the one before:

1. ``padded``: one sample per row, an attention mask (sdpa), the logits' loss, AdamW for-each;
2. ``packed sdpa``: packed rows, sdpa with transformers' block mask over each row;
3. ``packed varlen``: the variable-length kernel over the collate's boundaries
   (data/attention.py: PyTorch's ``varlen_attn``, or flash-attn's where installed);
4. ``+ fused CE``: the loss without whole-vocabulary logits (training/kernels.py: the chunked
   torch loss, or Liger-Kernel's fused linear cross-entropy where installed);
5. ``+ fused AdamW``: ``torch.optim.AdamW(fused=True)`` (the full packed step: target MFU
   >= 45 %);
6. ``+ compile``: ``torch.compile`` of each decoder layer (its first steps compile, untimed);

and, between 5 and 6, ``embedding pass``: ``selection/embedding.embed_samples`` (the gradient-
proxy embedding, packed, variable-length attention) against ``plain forward``: the model's
forward with its logits over the same packed batches (target: the pass >= 1.1x the forward's
throughput: it applies the LM head to response tokens only). Every configuration starts from
the same initial weights, so the first step's loss of the packed configurations agrees to
bfloat16 rounding (a check that no kernel changed the numbers; the padded plan's first step
holds other samples). The packing gate's verdict on the bfloat16 model is printed first
(``data/packing.pack_check``).

Output: one JSON line per configuration (``config``, ``steps`` timed after ``warmup_steps``,
``seconds``, ``real_tokens``, ``tokens_per_s``, ``vs_padded``, ``mfu`` = 6 N x real tokens /
(seconds x peak), ``peak_gib``, the kernels used, ``first_loss``, the target where there is
one); a configuration that fails prints its error and the run goes on. ``--budget-s`` (default
450) skips what is left once spent. ``--smoke`` runs every configuration but ``+ compile`` on
the CPU with a tiny Llama, small batches and the CPU reference of the variable-length kernel
(``data/attention.reference_kernel``) in place of the GPU one: a check that the script and the
paths it drives run, no speed claim (compiling takes minutes on a shared CPU; compiled layers'
numerics are tested in ``cluster_pipeline_tests/training/test_kernels.py``).

Imports torch, transformers, numpy and the product's torch-only modules (data/packing.py,
data/attention.py, training/plan.py, training/step.py, training/kernels.py, training/mfu.py,
selection/embedding.py): no Dagster, polars, deltalake or pydantic, so it runs on a bare GPU
machine that has nothing else.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere: this checkout's package
    sys.path.insert(0, str(ROOT))

from arguments import positive_int  # noqa: E402

LENGTHS = ROOT / "benchmarks" / "throughput_lengths.json"
TARGET_MFU = 0.45
HEAVY = ("pydantic", "polars", "dagster", "deltalake")
TARGET_EMBEDDING = 1.1


@dataclass
class Sample:
    """An encoded sample as the product's collate and embedding pass read it."""

    input_ids: list[int]
    labels: list[int]
    skip_reason: str | None = None

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass(frozen=True)
class Shape:
    """The run's sizes: the model and the step's knobs."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    max_tokens: int  # packed: real tokens per micro-batch
    row: int  # packed: tokens per row
    batch: int  # padded: samples per micro-batch
    accumulation: int
    epochs: int
    warmup_steps: int
    embed_repeat: int  # the embedding's samples: every shard's lengths, this many times
    embed_tokens: int  # embedding: real tokens per batch
    samples: int | None  # None: the whole shard


FULL = Shape(22, 2048, 5632, 32, 4, 32000, 8192, 4096, 16, 4, 12, 2, 6, 16384, None)
SMOKE = Shape(2, 64, 128, 4, 2, 1000, 512, 256, 4, 2, 1, 1, 1, 1024, 16)


def random_samples(lengths: list[int], targets: list[int], vocab: int, seed: int) -> list[Sample]:
    """Random token ids of the saved lengths; the last ``targets`` + 1 labels trained (the
    shape of the product's encoded samples: prompt first, response after)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for n, t in zip(lengths, targets, strict=True):
        ids = rng.integers(3, vocab, n).tolist()
        # A sample without a target is skipped, as the product skips it (skip_reason).
        skip = "no response token" if t < 1 else None
        out.append(Sample(ids, [-100] * (n - t) + ids[n - t :], skip))
    return out


def build_model(shape: Shape, device, dtype):
    """A randomly initialised Llama of ``shape`` (seed 0) on ``device`` in ``dtype``, sdpa."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=8192,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    model.config.use_cache = False
    return model.train()


class Run:
    """One run's shared state: device, model and its initial weights, data, output."""

    def __init__(self, args):
        import torch

        self.args = args
        self.shape = SMOKE if args.smoke else FULL
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.start = time.perf_counter()
        self.out = open(args.out, "w") if args.out else None  # noqa: SIM115 - closed in main
        table = json.loads(Path(args.lengths).read_text())[args.dataset]
        shards = table["tokens"]
        n = self.shape.samples
        shard = shards[0]
        self.samples = random_samples(
            shard["lengths"][:n], shard["targets"][:n], self.shape.vocab, seed=0
        )
        lengths = [x for r in shards for x in r["lengths"]][: n or None] * self.shape.embed_repeat
        targets = [x for r in shards for x in r["targets"]][: n or None] * self.shape.embed_repeat
        self.embed_samples = random_samples(lengths, targets, self.shape.vocab, seed=1)
        self.model = build_model(self.shape, self.device, self.dtype)
        self.initial = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.parameters = sum(p.numel() for p in self.model.parameters())
        self.baseline: float | None = None
        if args.smoke:
            # The CPU reference in place of the GPU kernel: the varlen configurations run the
            # product's wiring on the CPU (data/attention.py).
            from cluster_pipeline.data import attention

            attention.packed_kernel = lambda device_type: attention.reference_kernel()

    def emit(self, record: dict) -> None:
        """One JSON line to stdout (and to --out)."""
        record = {"elapsed_s": round(time.perf_counter() - self.start, 1), **record}
        line = json.dumps(record)
        print(line, flush=True)
        if self.out is not None:
            self.out.write(line + "\n")
            self.out.flush()

    def mfu(self, tokens: int, seconds: float) -> float:
        """6 N x real tokens / (seconds x peak) (training/mfu.py)."""
        from cluster_pipeline.training.mfu import mfu

        return round(mfu(self.parameters, tokens, seconds, self.args.peak_tflops * 1e12), 4)

    def peak_gib(self) -> float | None:
        import torch

        if self.device.type != "cuda":
            return None
        return round(torch.cuda.max_memory_allocated(self.device) / 2**30, 2)

    def fresh(self, attention: str) -> str:
        """The model back at its initial weights, attending as ``attention`` ("sdpa" or
        "varlen"); returns what packed rows attend with."""
        import torch

        from cluster_pipeline.data.attention import use_packed_attention

        self.model.load_state_dict(self.initial)
        self.model.zero_grad(set_to_none=True)
        self.model.set_attn_implementation("sdpa")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        if attention == "varlen":
            return use_packed_attention(self.model, self.device.type)
        return "sdpa"


def train_config(
    run: Run,
    *,
    packed: bool,
    attention: str,
    loss: str,
    fused_adamw: bool,
    compile_backend: str | None = None,
) -> dict:
    """Train ``run``'s shard with one configuration; the timed figures after warm-up."""
    import torch

    from cluster_pipeline.training.kernels import CausalLMLoss, compile_layers, loss_kernel
    from cluster_pipeline.training.plan import plan_packed, plan_padded
    from cluster_pipeline.training.step import accumulate, clock

    shape, device = run.shape, run.device
    attends = run.fresh(attention)
    if compile_backend is not None:
        compile_layers(run.model, None if compile_backend == "inductor" else compile_backend)
    kernel = loss_kernel(device.type) if loss == "fused" else "logits"
    module = CausalLMLoss(run.model, kernel)
    lengths = [len(s) for s in run.samples]
    if packed:
        plan = plan_packed(
            [lengths], shape.max_tokens, shape.row, shape.accumulation, shape.epochs, 0
        )[0]
    else:
        plan = plan_padded([len(lengths)], shape.batch, shape.accumulation, shape.epochs, 0)[0]
    params = [p for p in run.model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5, fused=True if fused_adamw else None)
    warm = min(shape.warmup_steps, len(plan) - 1)
    first_loss = None
    real = 0
    start = 0.0
    for k, step in enumerate(plan):
        if k == warm:
            start, real = clock(device), 0
        done = accumulate(
            module, step, run.samples, 0, packed, 1.0, device, lambda last: nullcontext()
        )
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        real += done.real_tokens
        if first_loss is None:
            first_loss = round(done.loss_sum / max(done.targets, 1), 4)
    seconds = clock(device) - start
    del optimizer
    return {
        "steps": len(plan) - warm,
        "warmup_steps": warm,
        "seconds": round(seconds, 3),
        "real_tokens": real,
        "tokens_per_s": round(real / seconds, 1),
        "mfu": run.mfu(real, seconds),
        "peak_gib": run.peak_gib(),
        "first_loss": first_loss,
        "attention": attends if packed else "sdpa (padded: attention mask)",
        "loss": module.kernel,
        "optimizer": "AdamW fused" if fused_adamw else "AdamW for-each",
        "compiled_layers": compile_backend or "none",
    }


def embedding_config(run: Run) -> list[dict]:
    """The embedding pass against a plain forward with logits over the same packed batches
    (variable-length attention for both); returns the two records."""
    import torch

    from cluster_pipeline.data.attention import forward_kwargs
    from cluster_pipeline.data.packing import collate_rows, token_batches
    from cluster_pipeline.selection.embedding import embed_samples
    from cluster_pipeline.training.step import clock

    shape, device, model = run.shape, run.device, run.model
    attends = run.fresh("varlen")
    model.eval()
    samples = run.embed_samples
    tokens = sum(len(s) for s in samples)
    row = shape.row

    def embed() -> bool:
        return embed_samples(
            model, samples, 0, max_batch_tokens=shape.embed_tokens, max_packed_length=row
        )[1]

    batches = token_batches([len(s) for s in samples], shape.embed_tokens, row)

    def forward() -> None:
        with torch.inference_mode():
            for rows in batches:
                batch = collate_rows(samples, rows, 0, packed=True)
                model(**forward_kwargs(model, batch, device)).logits  # noqa: B018 - timed work

    timed: dict[str, float] = {}
    packed = False
    for name, fn in (("forward", forward), ("embedding", embed)):
        fn()  # warm-up (and the packing gate, once per model)
        t0 = clock(device)
        result = fn()
        timed[name] = clock(device) - t0
        if name == "embedding":
            packed = bool(result)
    model.train()
    ratio = timed["forward"] / timed["embedding"]
    common = {"real_tokens": tokens, "attention": attends, "peak_gib": run.peak_gib()}
    return [
        {
            "config": "plain forward",
            **common,
            "seconds": round(timed["forward"], 3),
            "tokens_per_s": round(tokens / timed["forward"], 1),
            "mfu_forward": round(run.mfu(tokens, timed["forward"]) / 3, 4),  # 2N, not 6N
        },
        {
            "config": "embedding pass",
            **common,
            "packed": packed,
            "seconds": round(timed["embedding"], 3),
            "tokens_per_s": round(tokens / timed["embedding"], 1),
            "vs_plain_forward": round(ratio, 3),
            "target": f"embedding / forward >= {TARGET_EMBEDDING}",
            "meets_target": ratio >= TARGET_EMBEDDING,
        },
    ]


TRAINING = [
    ("padded", dict(packed=False, attention="sdpa", loss="logits", fused_adamw=False)),
    ("packed sdpa", dict(packed=True, attention="sdpa", loss="logits", fused_adamw=False)),
    ("packed varlen", dict(packed=True, attention="varlen", loss="logits", fused_adamw=False)),
    ("+ fused CE", dict(packed=True, attention="varlen", loss="fused", fused_adamw=False)),
    ("+ fused AdamW", dict(packed=True, attention="varlen", loss="fused", fused_adamw=True)),
]
FULL_STEP = {"+ fused AdamW", "+ compile"}


def gate(run: Run) -> dict:
    """The packing gate's figures on the run's model (bfloat16 on a GPU)."""
    from dataclasses import asdict

    from cluster_pipeline.data.packing import pack_check

    run.fresh("sdpa")
    check = pack_check(run.model)
    return {"config": "packing gate", **asdict(check)}


def run_configs(run, configs: list[tuple[str, Callable[[], list[dict]]]]) -> int:
    """Run each configuration, emit its records (with ``vs_padded`` against the ``padded``
    line and the targets of the full step), an error line for one that fails, a skip line past
    the time budget; returns how many failed."""
    failed = 0
    for name, fn in configs:
        if run.args.smoke and name == "+ compile":
            run.emit({"config": name, "skipped": "--smoke: compiling takes minutes on a CPU"})
            continue
        if time.perf_counter() - run.start > run.args.budget_s:
            budget = run.args.budget_s
            run.emit({"config": name, "skipped": f"past the time budget of {budget} s"})
            continue
        try:
            for record in fn():
                record = {"config": name, **record}
                if "tokens_per_s" in record and record["config"] not in (
                    "plain forward",
                    "embedding pass",
                ):
                    if name == "padded":
                        run.baseline = record["tokens_per_s"]
                    if run.baseline:
                        record["vs_padded"] = round(record["tokens_per_s"] / run.baseline, 3)
                if name in FULL_STEP:
                    record["target"] = f"mfu >= {TARGET_MFU}"
                    record["meets_target"] = record["mfu"] >= TARGET_MFU
                run.emit(record)
        except Exception as e:  # noqa: BLE001 - one configuration's failure ends only it
            failed += 1
            run.emit(
                {
                    "config": name,
                    "error": f"{type(e).__name__}: {e}"[:500],
                    "traceback": traceback.format_exc()[-1500:],
                }
            )
    return failed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="CPU, tiny Llama, seconds")
    p.add_argument("--lengths", default=str(LENGTHS), help="saved shard lengths (JSON)")
    p.add_argument("--dataset", default="alpaca_cherry_5pct")
    p.add_argument(
        "--peak-tflops", type=float, default=989.0, help="the GPU's dense bf16 peak (H100/H200)"
    )
    p.add_argument("--budget-s", type=positive_int, default=450, help="skip what is left after")
    p.add_argument(
        "--compile-backend",
        default=None,
        help="torch.compile backend of '+ compile' (default: inductor; eager under --smoke)",
    )
    p.add_argument("--out", default=None, help="also write the JSON lines to this file")
    args = p.parse_args(argv)
    backend = args.compile_backend or ("eager" if args.smoke else "inductor")
    import torch
    import transformers

    run = Run(args)
    run.emit(
        {
            "config": "environment",
            "device": torch.cuda.get_device_name(run.device)
            if run.device.type == "cuda"
            else "cpu",
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "parameters": run.parameters,
            "weights": str(run.dtype),
            "shape": run.shape.__dict__,
            "train_samples": len(run.samples),
            "train_tokens_per_epoch": sum(len(s) for s in run.samples),
            "peak_tflops": args.peak_tflops,
            "smoke": args.smoke,
            # What this script must run without (a bare GPU machine): none of it imported.
            "heavy_modules": sorted(m for m in HEAVY if m in sys.modules),
        }
    )
    configs: list[tuple[str, Callable[[], list[dict]]]] = [("packing gate", lambda: [gate(run)])]
    configs += [
        (name, lambda kw=kw: [train_config(run, **kw)])  # type: ignore[misc]
        for name, kw in TRAINING
    ]
    configs.append(("embedding pass", lambda: embedding_config(run)))
    configs.append(
        (
            "+ compile",
            lambda: [train_config(run, **TRAINING[-1][1], compile_backend=backend)],  # type: ignore[arg-type]
        )
    )
    failed = run_configs(run, configs)
    run.emit({"config": "done", "failed": failed})
    if run.out is not None:
        run.out.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

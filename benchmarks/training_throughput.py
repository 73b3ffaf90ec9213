"""Where training compute goes: padded vs packed micro-batches, sample- vs token-balanced shards.

    python benchmarks/training_throughput.py                      # both pools, CPU, ~90 min
    python benchmarks/training_throughput.py --modes a d --repeat 1   # the equal-token check
    python benchmarks/training_throughput.py --datasets python_stdlib --sweep-only   # row bounds
    # the timing core alone, on a GPU (one rank, bf16, a random ~1B Llama, saved lengths):
    python benchmarks/training_throughput.py core --lengths benchmarks/throughput_lengths.json \
        --dataset alpaca_cherry_5pct --mode c --random-llama 1b --bf16 --out result.json

The same selected pool is trained three ways, the same epochs and the same average samples per
optimizer step (K = 2 clusters = 2 ranks, ``torchrun --nproc_per_node=2``, gloo on CPU):

- (a) **as before**: CluSTER's published rule (every cluster keeps floor(r m) samples), padded
  micro-batches of ``--batch`` samples x ``--accumulation``;
- (b) **packed**: the same shards, padding-free micro-batches of up to ``--batch`` x the pool's
  mean sample length tokens, in rows of at most ``--row`` tokens;
- (c) **packed and token-balanced**: every cluster keeps its peripheral samples up to the same
  token budget (``balance: tokens``, the product's rule B = floor(r min_c L_c)), packed as (b);
- (d) **packed and token-balanced at (a)'s tokens**: as (c), with the ratio chosen so that the
  token budget is (a)'s real tokens / K (r' = T_a / (K min_c L_c)), so (d) trains the same
  number of real tokens as (a), spread evenly over the ranks. (c) keeps 13-15 % more tokens than
  (a) at the same r, so its time mixes more data with less waste; (d) separates the two.

Per run: wall seconds of the training loop, real tokens per second, the useful-compute fraction
(Σ real tokens / (ranks x the busiest rank's tensor tokens), per step, over the run), seconds the
ranks waited for each other, and the final loss; ratios (c)/(a), (d)/(a) and (b)/(a) against
the targets (useful compute >= 0.95 for (c) and (d); time <= 0.75 of (a) on python_stdlib,
<= 0.65 on alpaca_cherry_5pct). ``--sweep`` also times (c) with rows of 256, 512, 1,024 and
2,048 tokens (the same first 6 optimizer steps at every bound) to find the fastest row bound on
this machine, each as a ratio to the default 512; ``--sweep-only`` times the sweep alone.

``prepare`` (run first, automatically) selects the pools with the product itself: the built-in
``python_stdlib`` at the ``make run`` sizes (600 samples, 256 tokens) and the shared
``alpaca_cherry_5pct`` at 1,024 tokens (600 samples), SmolLM2-135M-Instruct's embedding pass,
balanced k-means (alpha 1.5), peripheral r = 0.5 under both balances. It writes the encoded shards
to ``--work`` and their lengths to ``benchmarks/throughput_lengths.json`` (committed: the GPU run
needs no data, only the lengths).

The timing core (``core``) imports torch, transformers, numpy and the product's torch-only
modules (``training/plan.py``, ``training/step.py``, ``data/packing.py``): no Dagster, polars or
deltalake, so it runs on the accelerator machine the ``device`` tool lends. With ``--lengths`` it
trains on random token ids of the saved lengths (the loss is then not meaningful), with
``--samples`` on the real encoded shards. On CUDA it also reports model FLOPs utilisation,
6 x parameters x real tokens / (seconds x the GPU's peak bf16 FLOP/s, --peak-tflops).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

from arguments import fraction, positive_int

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = ROOT / "benchmarks" / "throughput_lengths.json"
POOLS = {
    "python_stdlib": {"max_length": 256, "pool": 600},
    "alpaca_cherry_5pct": {"max_length": 1024, "pool": 600},
}
SHARED_TRAIN = ROOT.parent / "shared" / "datasets" / "train"


# --------------------------------------------------------------------------- prepare (product)


def prepare(datasets: list[str], work: Path, ratio: float) -> None:
    """Select each pool with the product's own stages (Dagster-free core functions) and save
    the shards of both balances: encoded samples to ``work``, lengths to :data:`LENGTHS`."""
    import numpy as np
    import polars as pl

    from cluster_pipeline.data.datasets import build_instruction_table
    from cluster_pipeline.data.formats import iter_file_records, normalise_record
    from cluster_pipeline.data.stdlib_dataset import iter_stdlib_samples
    from cluster_pipeline.data.tokenization import encode_rows
    from cluster_pipeline.models.loading import (
        BUILTIN_MODEL,
        load_model_and_tokenizer,
        resolve_model,
    )
    from cluster_pipeline.selection.clustering import balanced_kmeans
    from cluster_pipeline.selection.embedding_table import l2_normalise
    from cluster_pipeline.selection.selectors import select
    from cluster_pipeline.selection.sharding import allocate
    from cluster_pipeline.storage.tables import series_to_matrix
    from cluster_pipeline.training.config import EmbedSettings, TrainSettings
    from cluster_pipeline.training.embedding_pass import embed_frame

    model_path = resolve_model(BUILTIN_MODEL, ROOT / "data" / "models")
    model, tokenizer = load_model_and_tokenizer(model_path)
    lengths = json.loads(LENGTHS.read_text()) if LENGTHS.exists() else {}
    for name in datasets:
        sizes = POOLS[name]
        if name == "python_stdlib":
            records = list(iter_stdlib_samples())
        else:
            path = SHARED_TRAIN / f"{name}.json"
            records = [normalise_record(r, str(path), line) for line, r in iter_file_records(path)]
        frame, _ = build_instruction_table(records, 0.05, 200, sizes["pool"], seed=0)
        train = frame.filter(pl.col("split") == "train")
        t0 = time.perf_counter()
        emb = embed_frame(model, tokenizer, train, EmbedSettings(max_length=sizes["max_length"]))
        emb = emb.filter(pl.col("skip_reason").is_null())
        clusters = balanced_kmeans(l2_normalise(series_to_matrix(emb["embedding"])), 2, seed=0)
        print(
            f"[{name}] embedded and clustered {emb.height} samples in "
            f"{time.perf_counter() - t0:.0f} s; k-means sizes {clusters.kmeans_sizes.tolist()}",
            flush=True,
        )
        ids = emb["sample_id"].to_numpy()
        tokens = emb["n_tokens"].to_numpy()
        by_id = dict(zip(train["sample_id"].to_list(), range(train.height), strict=True))
        settings = TrainSettings(max_length=sizes["max_length"])
        out: dict = {}
        cluster_tokens = np.bincount(clusters.labels, weights=tokens, minlength=2)
        for balance in ("samples", "tokens", "tokens_at_samples"):
            r = ratio
            if balance == "tokens_at_samples":
                # (d): the budget B = floor(r' min_c L_c) equal to (a)'s tokens per rank.
                kept = sum(sum(len(x) for x in rank["input_ids"]) for rank in out["samples"])
                r = min(1.0, kept / (2 * float(cluster_tokens.min())))
            sel = select(
                clusters.labels,
                clusters.sq_distance,
                2,
                "peripheral",
                r,
                balance="samples" if balance == "samples" else "tokens",
                lengths=tokens,
                response_tokens=emb["n_response_tokens"].to_numpy(),
            )
            alloc = allocate(name, ids, clusters.labels, sel, 2, lengths=tokens)
            ranks = []
            for m in alloc.manifests:
                rows = train[[by_id[s] for s in m.sample_ids]]
                encoded = encode_rows(tokenizer, rows, settings)
                ranks.append(
                    {
                        "weight": m.weight,
                        "input_ids": [e.input_ids for e in encoded],
                        "labels": [e.labels for e in encoded],
                    }
                )
            out[balance] = ranks
            print(
                f"[{name}] balance {balance}: samples per rank "
                f"{[len(r['labels']) for r in ranks]}, tokens per rank "
                f"{[sum(len(x) for x in r['input_ids']) for r in ranks]}, weights "
                f"{[round(r['weight'], 4) for r in ranks]}",
                flush=True,
            )
        out["ratio"] = ratio
        (work / f"{name}.json").write_text(json.dumps(out))
        lengths[name] = {
            balance: [
                {
                    "weight": r["weight"],
                    "lengths": [len(x) for x in r["input_ids"]],
                    "targets": [sum(t != -100 for t in lab[1:]) for lab in r["labels"]],
                }
                for r in ranks
            ]
            for balance, ranks in out.items()
            if balance != "ratio"
        }
        lengths[name]["mean_length"] = _mean_length(out["samples"])
    LENGTHS.write_text(json.dumps(lengths, indent=0))


def _mean_length(ranks: list[dict]) -> float:
    """Mean tokens per sample over the shards (of the sample-balanced selection)."""
    sizes = [len(x) for r in ranks for x in r["input_ids"]]
    return sum(sizes) / len(sizes)


# --------------------------------------------------------------------------- timing core


class Sample:
    """An encoded sample as the collate functions read it."""

    __slots__ = ("input_ids", "labels")

    def __init__(self, input_ids: list[int], labels: list[int]):
        self.input_ids, self.labels = input_ids, labels

    def __len__(self) -> int:
        return len(self.input_ids)


def _random_samples(spec: dict, vocab: int, seed: int) -> list[Sample]:
    """Random token ids of the saved lengths; the last ``targets`` + 1 labels trained."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for n, t in zip(spec["lengths"], spec["targets"], strict=True):
        ids = rng.integers(0, vocab, n).tolist()
        labels = [-100] * (n - t) + ids[n - t :]
        out.append(Sample(ids, labels))
    return out


def _model(args, device):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    if args.random_llama:
        # ~1.1B parameters: TinyLlama's shape (22 layers, hidden 2048, 32 heads, 4 KV heads).
        config = LlamaConfig(
            vocab_size=32000,
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=22,
            num_attention_heads=32,
            num_key_value_heads=4,
            max_position_embeddings=4096,
        )
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=args.attention)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation=args.attention)
    dtype = torch.bfloat16 if args.bf16 and device.type == "cuda" else torch.float32
    model.to(device=device, dtype=dtype)  # pyright: ignore[reportCallIssue]  (a torch Module)
    return model


def core(args) -> dict:
    """Train one configuration on this rank; rank 0 returns the run's figures."""
    import numpy as np
    import torch
    import torch.distributed as dist

    from cluster_pipeline.data.packing import can_pack
    from cluster_pipeline.training.plan import plan_packed, plan_padded, useful_compute_fraction
    from cluster_pipeline.training.step import accumulate, clock

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local}" if torch.cuda.is_available() else "cpu")
    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    balance = {"a": "samples", "b": "samples", "c": "tokens", "d": "tokens_at_samples"}[args.mode]
    if args.samples:
        saved = json.loads(Path(args.samples).read_text())
        spec = saved[balance]
        shards = [
            [Sample(ids, labels) for ids, labels in zip(r["input_ids"], r["labels"], strict=True)]
            for r in spec
        ]
        weights = [r["weight"] for r in spec]
        mean_length = _mean_length(saved["samples"])
    else:
        table = json.loads(Path(args.lengths).read_text())[args.dataset]
        spec = table[balance]
        weights = [r["weight"] for r in spec]
        shards = None
        mean_length = table["mean_length"]
    model = _model(args, device)
    if shards is None:
        shards = [_random_samples(r, model.config.vocab_size, seed=k) for k, r in enumerate(spec)]
    if world != len(shards):
        # One process: rank r of the plan is trained alone (its own timing, no waiting).
        shards, weights = [shards[args.rank_alone]], [weights[args.rank_alone]]
    model.train()
    model.config.use_cache = False
    packed = args.mode in ("b", "c", "d") and can_pack(model, vocab_size=model.config.vocab_size)
    lengths = [[len(s) for s in sh] for sh in shards]
    if packed:
        max_tokens = args.max_tokens or int(round(args.batch * mean_length))
        plans = plan_packed(
            lengths, max_tokens, args.row, args.accumulation, args.epochs, 0, args.max_steps
        )
    else:
        max_tokens = None
        plans = plan_padded(
            [len(x) for x in lengths], args.batch, args.accumulation, args.epochs, 0, args.max_steps
        )
    me = rank if world > 1 else 0
    plan, samples, weight = plans[me], shards[me], weights[me]
    ddp = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    pad = 0

    def sync(last: bool):
        if last or not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
            return nullcontext()
        return ddp.no_sync()

    history = []
    start = clock(device)
    for step in plan:
        t0 = clock(device)
        done = accumulate(ddp, step, samples, pad, packed, weight, device, sync, bf16=args.bf16)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds = clock(device) - t0
        figures = [
            done.loss_sum / max(done.targets, 1),
            done.real_tokens,
            done.padded_tokens,
            done.wait_seconds,
            seconds,
            len(step.samples),
        ]
        row = torch.tensor(figures, dtype=torch.float64)
        if world > 1:
            gathered = [torch.zeros_like(row) for _ in range(world)]
            dist.all_gather(gathered, row)
        else:
            gathered = [row]
        g = [x.tolist() for x in gathered]
        history.append(g)
    wall = clock(device) - start
    if world > 1:
        dist.destroy_process_group()
    if rank != 0:
        return {}
    real = sum(sum(r[1] for r in g) for g in history)
    paid = sum(len(g) * max(r[2] for r in g) for g in history)
    n_params = sum(p.numel() for p in model.parameters())
    ranks = range(len(history[0]))
    out: dict = {
        "mode": args.mode,
        "packed": packed,
        "max_tokens_per_micro_batch": max_tokens,
        "row": args.row if packed else None,
        "steps": len(plan),
        "wall_seconds": round(wall, 2),
        "real_tokens": int(real),
        "tensor_tokens": int(sum(sum(r[2] for r in g) for g in history)),
        "real_tokens_per_second": round(real / wall, 1),
        "useful_compute_fraction": round(real / paid, 4),
        "useful_per_step_min": round(
            min(useful_compute_fraction([r[1] for r in g], [r[2] for r in g]) for g in history), 4
        ),
        "wait_seconds_per_rank": [round(sum(g[k][3] for g in history), 2) for k in ranks],
        "samples_per_rank": [int(sum(g[k][5] for g in history)) for k in ranks],
        "final_loss": round(float(np.mean([r[0] for r in history[-1]])), 4),
        "parameters": n_params,
    }
    if device.type == "cuda":
        out["mfu"] = round(6 * n_params * real / wall / (args.peak_tflops * 1e12), 4)
    return out


# --------------------------------------------------------------------------- driver


def _core_run(work: Path, dataset: str, mode: str, args, row: int, max_steps: int | None) -> dict:
    out = work / f"{dataset}_{mode}_{row}_{max_steps}.json"
    # torchrun_command starts a module; the timing core is this script's own subcommand.
    cmd = [
        *[sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"],
        *[__file__, "core", "--samples", str(work / f"{dataset}.json"), "--mode", mode],
        *["--model", str(args.model_path), "--batch", str(args.batch)],
        *["--accumulation", str(args.accumulation), "--row", str(row), "--out", str(out)],
    ]
    if max_steps:
        cmd += ["--max-steps", str(max_steps)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{dataset} ({mode}) failed:\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def _prepared(path: Path, ratio: float) -> bool:
    """Whether ``prepare`` wrote this pool's shards with every balance the modes read, at
    ``ratio`` (a pool of another ratio, or of an older script that did not record one, is
    prepared again)."""
    if not path.exists():
        return False
    saved = json.loads(path.read_text())
    return "tokens_at_samples" in saved and saved.get("ratio") == ratio


def per_token(run: dict) -> float:
    """Wall seconds per real token of a run."""
    return run["wall_seconds"] / run["real_tokens"]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "core":
        p = argparse.ArgumentParser(prog="training_throughput.py core")
        p.add_argument("core")
        p.add_argument("--samples", help="encoded shards written by prepare")
        p.add_argument("--lengths", help="saved lengths (random token ids)")
        p.add_argument("--dataset", default="python_stdlib")
        p.add_argument("--mode", choices=["a", "b", "c", "d"], required=True)
        p.add_argument("--model", help="a save_pretrained folder")
        p.add_argument("--random-llama", choices=["1b"], help="a randomly initialised Llama")
        p.add_argument("--attention", default="sdpa", help="attn_implementation")
        p.add_argument("--batch", type=positive_int, default=4)
        p.add_argument("--accumulation", type=positive_int, default=2)
        p.add_argument("--row", type=positive_int, default=512)
        p.add_argument("--max-tokens", type=positive_int, default=None)
        p.add_argument("--epochs", type=positive_int, default=1)
        p.add_argument("--max-steps", type=positive_int, default=None)
        p.add_argument("--bf16", action="store_true")
        p.add_argument("--peak-tflops", type=float, default=989.0, help="H100/H200 dense bf16")
        p.add_argument(
            "--rank-alone", type=positive_int, default=0, help="one process: which shard"
        )
        p.add_argument("--out", required=True)
        args = p.parse_args()
        result = core(args)
        if result:
            Path(args.out).write_text(json.dumps(result))
            print(json.dumps(result), flush=True)
        return

    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--datasets", nargs="+", default=list(POOLS), choices=list(POOLS))
    p.add_argument("--ratio", type=fraction, default=0.5)
    p.add_argument("--batch", type=positive_int, default=4, help="(a): samples per micro-batch")
    p.add_argument("--accumulation", type=positive_int, default=2)
    p.add_argument(
        "--row", type=positive_int, default=512, help="(b), (c), (d): tokens per packed row"
    )
    p.add_argument("--sweep", action="store_true", help="also time (c) at several row bounds")
    p.add_argument("--sweep-only", action="store_true", help="time the row sweep, not the modes")
    p.add_argument(
        "--repeat",
        type=positive_int,
        default=2,
        help="runs of each mode, interleaved; the fastest counts",
    )
    p.add_argument(
        "--modes",
        nargs="+",
        default=["a", "b", "c", "d"],
        choices=["a", "b", "c", "d"],
        help="the runs to time ((a) is the baseline of every ratio and always runs)",
    )
    p.add_argument("--prepare-only", action="store_true", help="select and save, time nothing")
    p.add_argument("--work", type=Path, default=Path("/tmp/training_throughput"))
    args = p.parse_args()
    if args.sweep_only and args.row != 512:
        p.error(
            "--row is not used by --sweep-only: the sweep times rows of 256, 512, 1,024 and 2,048"
        )
    shared = SHARED_TRAIN / "alpaca_cherry_5pct.json"
    if "alpaca_cherry_5pct" in args.datasets and not shared.exists():
        sys.exit(
            f"{shared} not found: the shared datasets lie beside the project's folder "
            "(../shared/datasets); without them run --datasets python_stdlib"
        )
    from cluster_pipeline.models.loading import BUILTIN_MODEL, resolve_model

    args.model_path = resolve_model(BUILTIN_MODEL, ROOT / "data" / "models")
    args.work.mkdir(parents=True, exist_ok=True)
    args.modes = ["a", *[m for m in args.modes if m != "a"]]
    todo = [d for d in args.datasets if not _prepared(args.work / f"{d}.json", args.ratio)]
    if todo:
        prepare(todo, args.work, args.ratio)
    if args.prepare_only:
        return
    results = {}
    for name in args.datasets:
        results[name] = {} if args.sweep_only else _time_modes(args, name)
        if args.sweep or args.sweep_only:
            results[name]["sweep"] = _sweep(args, name)
    (args.work / "results.json").write_text(json.dumps(results, indent=1))
    print(f"\nresults: {args.work / 'results.json'}")


def _time_modes(args, name: str) -> dict:
    """Each of ``args.modes`` timed ``args.repeat`` times, interleaved; printed with the ratios
    to (a). Returns {mode: fastest run, "all": every run}."""
    # Interleaved repeats (a b c a b c): the machine's other load shifts all three alike;
    # the fastest run of each mode counts, every run is kept in results.json.
    tries: dict[str, list[dict]] = {m: [] for m in args.modes}
    for _ in range(args.repeat):
        for m in tries:
            tries[m].append(_core_run(args.work, name, m, args, args.row, None))
    runs = {m: min(t, key=lambda r: r["wall_seconds"]) for m, t in tries.items()}
    a = runs["a"]
    print(f"\n== {name} (K = 2 ranks, batch {args.batch} x {args.accumulation}, rows {args.row})")
    print(
        f"{'run':>22} {'steps':>5} {'wall s':>8} {'real tok/s':>10} {'useful':>7} "
        f"{'wait s/rank':>14} {'samples/rank':>13} {'final loss':>10} {'time / (a)':>10}"
    )
    labels = {
        "a": "(a) padded, samples",
        "b": "(b) packed, samples",
        "c": "(c) packed, tokens",
        "d": "(d) tokens at (a)'s",
    }
    for m, r in runs.items():
        print(
            f"{labels[m]:>22} {r['steps']:>5} {r['wall_seconds']:>8.1f} "
            f"{r['real_tokens_per_second']:>10.1f} {r['useful_compute_fraction']:>7.3f} "
            f"{str(r['wait_seconds_per_rank']):>14} {str(r['samples_per_rank']):>13} "
            f"{r['final_loss']:>10.4f} {r['wall_seconds'] / a['wall_seconds']:>10.3f}"
        )
    target = 0.75 if name == "python_stdlib" else 0.65
    for m in ("c", "d"):
        if m not in runs:
            continue
        r = runs[m]
        print(
            f"   {labels[m]}: useful compute {r['useful_compute_fraction']:.3f} (>= 0.95); "
            f"time / (a) {r['wall_seconds'] / a['wall_seconds']:.3f} (<= {target}); real "
            f"tokens / (a) {r['real_tokens'] / a['real_tokens']:.3f}; seconds per real "
            f"token / (a) {per_token(r) / per_token(a):.3f}"
        )
    if "b" in runs:
        print(f"   (b): seconds per real token / (a) {per_token(runs['b']) / per_token(a):.3f}")
    return {**runs, "all": tries}


def _sweep(args, name: str) -> dict:
    """(c) timed for its first 6 optimizer steps at each row bound (256, 512, 1,024, 2,048
    tokens; a sample longer than the bound has a row to itself); printed as ms per real token
    and as a ratio to rows of 512 (the default). Returns {row bound: run}."""
    sweep = {row: _core_run(args.work, name, "c", args, row, 6) for row in (256, 512, 1024, 2048)}
    best = min(sweep, key=lambda k: per_token(sweep[k]))
    base = per_token(sweep[512])
    print(f"\n== {name}: (c) at each row bound, 6 steps each")
    for row, r in sweep.items():
        print(
            f"   rows <= {row:>4} tokens: {1e3 * per_token(r):.3f} ms per real token over "
            f"{r['steps']} steps ({r['real_tokens_per_second']:.1f} tok/s, "
            f"{r['tensor_tokens']} tensor tokens), "
            f"{per_token(r) / base:.3f} of rows <= 512" + ("  <- fastest" if row == best else "")
        )
    return sweep


if __name__ == "__main__":
    main()

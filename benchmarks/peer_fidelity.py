"""What each departure from the peers' released code changes (issue 41; docs/design.md, "The
peers: departures from the authors' released code"), measured on one pool with the real model.

    python benchmarks/peer_fidelity.py                    # 48 gpteacher_codegen samples
    python benchmarks/peer_fidelity.py --pool 96 --max-length 256
    python benchmarks/peer_fidelity.py --parts rds less --pool 24 --targets 16   # a busy machine

On the first --pool training samples of the shared ``gpteacher_codegen`` (the harness's split:
held-out half set aside first, seed 0) and SmolLM2-135M-Instruct in float32, each peer's score
or selection under its released rule (the default) and under the knob that gives this
project's earlier variant, at a budget of --ratio x pool samples (K = 1):

- ifd: IFD over the answer text (the end-of-turn marker left out, Cherry) against IFD with the
  marker scored: mean and largest |difference|, and the Jaccard of the selected sets; the
  truncated samples Cherry drops are counted (none at a window that holds every sample);
- rds: RDS+'s position-weighted whole-sequence pooling against the response mean (the target
  set: the first --targets HumanEval problems with their reference solutions), and the three
  selection rules (released round-robin, top_max, round_robin_untaken) on RDS+'s pooling:
  Jaccard of the selected sets;
- less: at one checkpoint of a short LoRA warm-up (--warmup-steps AdamW steps on the first 8
  samples, rank 8, learning rate 1e-4), each sample's Adam-preconditioned LoRA gradient under
  the released update m' / sqrt(v' + eps) against the paper's m_hat / (sqrt(v_hat) + eps):
  the per-sample cosine of the two (full gradients, no projection), the share of coordinates
  with sqrt(v') < 1e-4 (where eps under the root dominates), and the Spearman correlation and
  top-k overlap of the influence on the targets (their plain gradients, max over targets).

Prints the figures and writes them to --out (JSON). No training run, no Dagster: the product's
own functions (``training/embedding_pass.embed_frame``, the selectors' functions,
``selection/gradient_features``) called directly.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from arguments import fraction, positive_int

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "datasets"


def jaccard(a, b) -> float:
    a, b = set(a), set(b)
    return len(a & b) / max(1, len(a | b))


def spearman(a, b) -> float:
    """Spearman's rank correlation of two score vectors without ties."""
    import numpy as np

    ranks = [np.argsort(np.argsort(x)).astype(float) for x in (a, b)]
    return float(np.corrcoef(ranks[0], ranks[1])[0, 1])


def selected(result) -> list[int]:
    import numpy as np

    return np.flatnonzero(result.selected).tolist()


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--pool", type=positive_int, default=48)
    p.add_argument("--max-length", type=positive_int, default=256)
    p.add_argument("--ratio", type=fraction, default=0.25)
    p.add_argument("--targets", type=positive_int, default=64, help="HumanEval target problems")
    p.add_argument("--warmup-steps", type=positive_int, default=4)
    p.add_argument(
        "--parts",
        nargs="+",
        choices=["ifd", "rds", "less"],
        default=["ifd", "rds", "less"],
        help="which peers to measure (each part's passes are its own)",
    )
    p.add_argument(
        "--model", default=None, help="a local model folder (default: the built-in SmolLM2)"
    )
    p.add_argument(
        "--shared", type=Path, default=SHARED, help="the shared datasets folder (train/, eval/)"
    )
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "peer_fidelity.json")
    args = p.parse_args()
    pool_file = args.shared / "train" / "gpteacher_codegen.json"
    if not pool_file.exists():
        sys.exit(f"{pool_file} not found: give the shared datasets folder with --shared")

    import numpy as np
    import polars as pl

    from cluster_pipeline.data.datasets import build_instruction_table
    from cluster_pipeline.data.formats import iter_file_records, normalise_record
    from cluster_pipeline.evaluation.targets import target_samples
    from cluster_pipeline.models.loading import (
        BUILTIN_MODEL,
        load_model_and_tokenizer,
        resolve_model,
    )
    from cluster_pipeline.training.config import EmbedSettings
    from cluster_pipeline.training.embedding_pass import embed_frame

    start = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - start:6.0f} s] {message}", flush=True)

    samples = [
        normalise_record(r, str(pool_file), line) for line, r in iter_file_records(pool_file)
    ]
    frame, _ = build_instruction_table(samples, 0.5, 160, args.pool, seed=0)
    train = frame.filter(pl.col("split") == "train")
    model_path = args.model or resolve_model(BUILTIN_MODEL, ROOT / "data" / "models")
    model, tokenizer = load_model_and_tokenizer(model_path)
    settings = EmbedSettings(max_length=args.max_length)
    columns = ["sample_id", "system", "prompt", "response", "messages"]
    pool = train.select([c for c in columns if c in train.columns])
    n = pool.height
    budget = max(1, int(args.ratio * n))
    out: dict = {"pool": n, "max_length": args.max_length, "budget": budget}

    def embed(rows, **kw) -> pl.DataFrame:
        return embed_frame(model, tokenizer, rows, settings, **kw)

    folders = [ROOT / "data" / "eval", args.shared / "eval"]
    targets = target_samples("humaneval", args.targets, folders)
    target_rows = targets.select([c for c in columns if c in targets.columns])
    zeros = np.zeros(n, dtype=np.int64)
    if "ifd" in args.parts:
        measure_ifd(embed, pool, n, budget, zeros, out, log)
    if "rds" in args.parts:
        measure_rds(embed, pool, target_rows, n, budget, zeros, out, log)
    if "less" in args.parts:
        measure_less(model, tokenizer, pool, target_rows, settings, args, out, log)
    out["seconds"] = round(time.perf_counter() - start, 1)
    args.out.write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


def measure_ifd(embed, pool, n, budget, zeros, out, log) -> None:
    """IFD released (no end-of-turn marker, truncated samples unscored) against the earlier
    rule (module docstring)."""
    import numpy as np
    import polars as pl

    from cluster_pipeline.selection.selectors import SelectionInputs, SelectionParams, run_selector

    with_marker = embed(pool)
    cond = embed(pool, end_of_turn=False)
    alone = embed(pool, response_only=True, end_of_turn=False)
    alone_marker = embed(pool, response_only=True)
    log("ifd: four passes done")
    ok = with_marker["skip_reason"].is_null().to_numpy()
    truncated = with_marker["truncated"].to_numpy()

    def losses(f):
        return f["mean_loss"].cast(pl.Float64).fill_null(float("nan")).to_numpy()

    released = losses(cond) / losses(alone)
    earlier = losses(with_marker) / losses(alone_marker)
    both = ok & np.isfinite(released) & np.isfinite(earlier)
    diff = np.abs(released - earlier)[both]
    ifd_params = SelectionParams(r=budget / n)

    def ifd_select(conditioned, unconditioned, excluded):
        inputs = SelectionInputs(
            zeros,
            1,
            mean_loss=conditioned,
            unconditioned_loss=unconditioned,
            extra={"ifd_excluded": excluded},
        )
        return selected(run_selector("ifd", inputs, ifd_params))

    rel_set = ifd_select(losses(cond), losses(alone), truncated)
    old_set = ifd_select(losses(with_marker), losses(alone_marker), np.zeros(n, dtype=bool))
    out["ifd"] = {
        "scored": int(both.sum()),
        "mean_abs_difference": float(diff.mean()),
        "max_abs_difference": float(diff.max()),
        "truncated": int(truncated.sum()),
        "selected_jaccard": jaccard(rel_set, old_set),
        "selected_shared": len(set(rel_set) & set(old_set)),
    }
    log(f"ifd: {out['ifd']}")


def measure_rds(embed, pool, target_rows, n, budget, zeros, out, log) -> None:
    """RDS+'s pooling and its three rules (module docstring)."""
    import numpy as np

    from cluster_pipeline.selection.embedding_table import l2_normalise
    from cluster_pipeline.selection.selectors import SelectionInputs, SelectionParams, run_selector

    with_marker = embed(pool)
    weighted_pool = embed(pool, pooling="position_weighted")
    weighted_targets = embed(target_rows, pooling="position_weighted")
    mean_targets = embed(target_rows)
    log("rds: pool and target passes done")

    def vectors(f):
        keep = f["skip_reason"].is_null().to_numpy()
        m = np.zeros((f.height, len(f["hidden_mean"].drop_nulls()[0])), dtype=np.float32)
        m[keep] = np.array(f["hidden_mean"].drop_nulls().to_list(), dtype=np.float32)
        return l2_normalise(m), keep

    pool_w, _ = vectors(weighted_pool)
    pool_m, _ = vectors(with_marker)
    tw, keep_t = vectors(weighted_targets)
    tm, _ = vectors(mean_targets)

    def rds_select(pool_vectors, target_vectors, rule):
        inputs = SelectionInputs(zeros, 1, hidden_mean=pool_vectors, targets=target_vectors)
        params = SelectionParams(r=budget / n, knobs={"rds_selection": rule})
        return selected(run_selector("rds", inputs, params))

    rules = ("round_robin", "top_max", "round_robin_untaken")
    by_rule = {rule: rds_select(pool_w, tw[keep_t], rule) for rule in rules}
    response_mean = rds_select(pool_m, tm[keep_t], "round_robin")
    out["rds"] = {
        "targets": int(keep_t.sum()),
        "pooling_jaccard": jaccard(by_rule["round_robin"], response_mean),
        "pooling_shared": len(set(by_rule["round_robin"]) & set(response_mean)),
        "rule_jaccard": {
            f"{a} vs {b}": jaccard(by_rule[a], by_rule[b])
            for i, a in enumerate(rules)
            for b in rules[i + 1 :]
        },
        "earlier_rule_and_pooling_jaccard": jaccard(
            by_rule["round_robin"], rds_select(pool_m, tm[keep_t], "round_robin_untaken")
        ),
    }
    log(f"rds: {out['rds']}")


def measure_less(model, tokenizer, pool, target_rows, settings, args, out, log) -> None:
    """LESS's released Adam update against the paper's (module docstring)."""
    import numpy as np
    import torch

    from cluster_pipeline.data.packing import collate_rows
    from cluster_pipeline.data.tokenization import encode_rows
    from cluster_pipeline.selection.gradient_features import (
        AdamState,
        adam_precondition,
        per_sample_gradients,
    )
    from cluster_pipeline.training.config import TrainSettings
    from cluster_pipeline.training.parallel import apply_lora

    lora = TrainSettings(lora_r=8, max_length=args.max_length)
    peft = apply_lora(model, lora)
    trainable = [q for q in peft.parameters() if q.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    encoded = encode_rows(tokenizer, pool, settings)
    usable = [i for i, e in enumerate(encoded) if e.skip_reason is None]
    warm = usable[:8]
    peft.train()
    for _ in range(args.warmup_steps):
        batch = collate_rows(encoded, [[i] for i in warm], tokenizer.pad_token_id, packed=False)
        grads, loss = per_sample_gradients(peft, batch)
        optimizer.zero_grad()
        offset = 0
        mean_grad = grads.mean(0)
        for q in trainable:
            q.grad = mean_grad[offset : offset + q.numel()].view_as(q).clone()
            offset += q.numel()
        optimizer.step()
    peft.eval()
    state = AdamState.from_optimizer_state(optimizer.state_dict())
    log(f"less: {args.warmup_steps} warm-up steps done (P = {len(state.exp_avg)})")
    rows = usable
    gs = []
    for i in range(0, len(rows), 8):
        part = rows[i : i + 8]
        batch = collate_rows(encoded, [[j] for j in part], tokenizer.pad_token_id, packed=False)
        gs.append(per_sample_gradients(peft, batch)[0])
    g = torch.cat(gs)
    released_gamma = adam_precondition(g, state)
    paper_gamma = adam_precondition(g, state, released=False)
    cos = torch.nn.functional.cosine_similarity(released_gamma, paper_gamma, dim=1)
    b1, b2 = state.betas
    v_next = b2 * state.exp_avg_sq + (1 - b2) * g * g
    small = (v_next.sqrt() < 1e-4).float().mean().item()
    target_encoded = encode_rows(tokenizer, target_rows, settings)
    target_usable = [e for e in target_encoded if e.skip_reason is None][:16]
    tb = collate_rows(
        target_usable, [[j] for j in range(len(target_usable))], tokenizer.pad_token_id, False
    )
    tg = torch.nn.functional.normalize(per_sample_gradients(peft, tb)[0], dim=1)

    def influence(gamma):
        return (torch.nn.functional.normalize(gamma, dim=1) @ tg.T).max(dim=1).values.numpy()

    inf_released, inf_paper = influence(released_gamma), influence(paper_gamma)
    k = min(8, len(rows))
    top_r = set(np.argsort(-inf_released)[:k].tolist())
    top_p = set(np.argsort(-inf_paper)[:k].tolist())
    out["less"] = {
        "samples": len(rows),
        "target_samples": len(target_usable),
        "direction_cosine_min": float(cos.min()),
        "direction_cosine_mean": float(cos.mean()),
        "direction_cosine_max": float(cos.max()),
        "share_sqrt_v_below_1e-4": small,
        "influence_spearman": spearman(inf_released, inf_paper),
        f"top_{k}_shared": len(top_r & top_p),
    }
    log(f"less: {out['less']}")


if __name__ == "__main__":
    main()

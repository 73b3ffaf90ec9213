"""eval_report compares selectors and seeds, with every benchmark format, and writes plots."""

import json
import math
from pathlib import Path

import dagster as dg
import numpy as np
import polars as pl
import pytest

from cluster_pipeline.defs.partitions import DATASETS
from cluster_pipeline.evaluation.render import summary_table
from cluster_pipeline.evaluation.report import ModelResult, aggregate, compare_groups, render_report
from cluster_pipeline.evaluation.sandbox import sandbox_problem
from cluster_pipeline.evaluation.suites import ItemScores, dataset_benchmarks
from cluster_pipeline_tests.helpers import (
    RUN_CONFIG,
    materialize_partition,
    meta,
    pipeline_assets,
    resources,
    seed_embeddings,
)

ASSETS = pipeline_assets()


def test_aggregate_gives_mean_and_sample_std_per_group():
    rs = [
        ModelResult("b", "base", "p", {"m": 1.0}),
        ModelResult(
            "x0", "random_global r=0.5", "p", {"m": 2.0}, train_seconds=10.0, data_fraction=0.5
        ),
        ModelResult(
            "x1",
            "random_global r=0.5",
            "p",
            {"m": 4.0},
            train_seconds=20.0,
            data_fraction=0.5,
            current=True,
        ),
    ]
    rows = aggregate(rs, ["m"])
    assert [r["group"] for r in rows] == ["base", "random_global r=0.5"]
    assert (
        rows[1]["n"] == 2
        and rows[1]["m"] == 3.0
        and rows[1]["m_std"] == pytest.approx(math.sqrt(2))
    )
    assert rows[1]["train_seconds"] == 15.0 and rows[1]["current"]
    table = summary_table(rows, ["m"])
    assert "| **random_global r=0.5** | 2 | 0.500 ± 0.000 | 15.0 ± 7.1 | 3.0000 ± 1.4142 |" in table
    assert "| base | 1 | - | - | 1.0000 |" in table


def _result(name, group, selector, ratio, losses, current=False):
    ids = [f"s{i}" for i in range(len(losses))]
    items = {"heldout_loss": ItemScores(ids, [10.0] * len(ids), list(losses))}
    return ModelResult(
        name,
        group,
        "p",
        {"heldout_loss": float(np.mean(losses))},
        items,
        selector,
        ratio,
        100.0,
        20.0,
        ratio,
        0.5,
        0.1,
        current,
    )


def test_each_group_is_compared_with_random_global_full_and_base_with_verdicts():
    rng = np.random.default_rng(0)
    base = 1.5 + rng.normal(0, 0.2, 200)
    results = [_result("base", "base", None, None, base)]
    for seed in (0, 1):
        noise = rng.normal(0, 0.01, 200)
        results += [
            _result(
                f"p{seed}",
                "peripheral r=0.5",
                "peripheral",
                0.5,
                base - 0.3 + noise,
                current=seed == 0,
            ),
            _result(
                f"g{seed}",
                "random_global r=0.5",
                "random_global",
                0.5,
                base - 0.3 + rng.normal(0, 0.01, 200),
            ),
            _result(f"f{seed}", "full r=1.0", "full", 1.0, base - 0.35 + noise),
        ]
    rows = aggregate(results, ["heldout_loss"])
    comparisons = compare_groups(results, rows, n_resamples=500)
    pairs = {(c.candidate, c.reference): c for c in comparisons}
    assert set(pairs) == {
        ("peripheral r=0.5", "random_global r=0.5"),
        ("peripheral r=0.5", "full r=1.0"),
        ("peripheral r=0.5", "base"),
        ("random_global r=0.5", "full r=1.0"),
        ("random_global r=0.5", "base"),
        ("full r=1.0", "base"),
    }
    assert pairs[("peripheral r=0.5", "base")].verdict == "better"
    assert pairs[("peripheral r=0.5", "full r=1.0")].verdict == "worse"
    assert pairs[("peripheral r=0.5", "full r=1.0")].difference == pytest.approx(0.05, abs=0.005)
    assert pairs[("peripheral r=0.5", "random_global r=0.5")].verdict == "no detectable difference"
    assert pairs[("peripheral r=0.5", "base")].candidate_seeds == 2
    report = render_report("d", results, 200, 2000, {}, {}, 12.0, n_resamples=500)
    assert report.full_training_measured and report.full_training_seconds == 100.0
    assert "against **full r=1.0** on heldout_loss (lower is better): **worse**" in report.summary
    assert "| net time saved (full - selection - training) | -12.0 s |" in report.summary
    # The first lines say it (selection 12 s + the current run's training against the measured
    # full-data mean of 100 s).
    first = report.summary.split("\n\n")[1]
    assert first.startswith("**Net time saved: -12.0 s** (-12 % of full-data training): ")
    assert first.endswith("against full-data training 100.0 s (measured).")
    unsafe = render_report(
        "d", results, 200, 2000, {}, {}, 12.0, n_resamples=50, unsafe_sandbox="no bwrap"
    )
    assert unsafe.summary.split("\n\n")[1].startswith(
        "**Generated code ran without isolation** (`unsafe_sandbox: true`; no bwrap)"
    )
    assert "decision.png" in report.pngs


def test_the_detectable_difference_is_one_number_or_a_range():
    """One held-out comparison states its minimum detectable difference alone (not "x-x");
    several state the range of theirs."""
    rng = np.random.default_rng(1)
    base = rng.normal(1.5, 0.1, 50)
    one = [
        _result("base", "base", "base", 0.0, base),
        _result(
            "p0", "peripheral r=0.5", "peripheral", 0.5, base - 0.1 + rng.normal(0, 0.01, 50), True
        ),
    ]
    report = render_report("d", one, 50, 500, {}, {}, 1.0, n_resamples=200)
    (c,) = [c for c in report.comparisons if c.metric == "heldout_loss"]
    assert (
        "The smallest held-out loss difference this comparison detects reliably (80 % power, "
        f"5 % level) is {c.min_detectable:.4f} nats/token."
    ) in report.summary
    noisier = base - 0.05 + rng.normal(0, 0.05, 50)
    two = [*one, _result("r0", "random_global r=0.5", "random_global", 0.5, noisier)]
    report = render_report("d", two, 50, 500, {}, {}, 1.0, n_resamples=200)
    mdds = [c.min_detectable for c in report.comparisons if c.metric == "heldout_loss"]
    assert len(mdds) == 3 and min(mdds) < max(mdds)
    assert (
        f"these comparisons detect reliably (80 % power, 5 % level) is {min(mdds):.4f}-"
        f"{max(mdds):.4f} nats/token."
    ) in report.summary


def test_benchmarks_are_configured_per_dataset(tmp_path):
    (tmp_path / "med").mkdir()
    (tmp_path / "med" / "eval.json").write_text(json.dumps({"benchmarks": ["mmlu_medical"]}))
    assert dataset_benchmarks("med", tmp_path) == ("mmlu_medical",)
    assert dataset_benchmarks("python_stdlib", tmp_path) == ("humaneval", "mbpp")
    assert dataset_benchmarks("other", tmp_path) == ()
    (tmp_path / "med" / "eval.json").write_text(json.dumps({"benchmarks": ["gsm8k"]}))
    with pytest.raises(ValueError, match="unknown benchmarks"):
        dataset_benchmarks("med", tmp_path)


@pytest.mark.slow
def test_report_compares_selectors_and_seeds(
    tiny_data_dir, tiny_model_dir, tiny_embedding_cache, tmp_path
):
    seed_embeddings(tiny_embedding_cache, tiny_data_dir)
    eval_dir = tmp_path / "eval"
    eval_dir.mkdir()
    (eval_dir / "mbpp_reworded.json").write_text(
        json.dumps(
            [
                {
                    "name": "mbpp_1_double",
                    "prompt": 'def double(x: int) -> int:\n    """Double x."""\n',
                    "tests": (
                        "def check(candidate):\n    assert candidate(2) == 4\n\ncheck(double)\n"
                    ),
                    "stop_tokens": ["\ndef"],
                }
            ]
        )
    )
    (eval_dir / "mmlu.jsonl").write_text(
        "".join(
            json.dumps(
                {
                    "question": f"Q{i}?",
                    "answer_a": "yes",
                    "answer_b": "no",
                    "answer_c": "maybe",
                    "answer_d": "never",
                    "correct_answer": "ABCD"[i % 4],
                    "topic": "anatomy",
                }
            )
            + "\n"
            for i in range(4)
        )
    )
    res = resources(tiny_data_dir, tiny_model_dir)
    eval_cfg = {
        "ops": {
            "eval_report": {
                "config": {
                    "max_length": 64,
                    "benchmarks": ["humaneval", "mbpp", "mmlu_medical"],
                    "humaneval_problems": 3,
                    "max_new_tokens": 8,
                    "eval_data_dir": str(eval_dir),
                    "unsafe_sandbox": sandbox_problem() is not None,
                }
            }
        }
    }
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(DATASETS, ["tiny"])
        train_chain = {"ops": {k: v for k, v in RUN_CONFIG["ops"].items() if k != "eval_report"}}
        for _ in range(2):
            assert materialize_partition(ASSETS[:6], instance, res, run_config=train_chain).success
        # The second run wrote a new raw_instructions version holding the same samples: the
        # finished checkpoint is reused (its key is the samples' content, not the version).
        assert meta(instance, "raw_instructions")["table_version"] == 1
        assert meta(instance, "trained_checkpoint")["reused_checkpoint"] is True
        train_cfg = RUN_CONFIG["ops"]["trained_checkpoint"]["config"]
        # make compare: 2 selectors x 2 seeds (peripheral seed 0 was trained above).
        for selector, seed in (("peripheral", 1), ("random_global", 0), ("random_global", 1)):
            cfg = {
                "ops": {
                    "peripheral_subsets": {
                        "config": {"selector": selector, "ratio": 0.5, "seed": seed}
                    },
                    "trained_checkpoint": {"config": {**train_cfg, "seed": seed}},
                }
            }
            assert materialize_partition(ASSETS[3:6], instance, res, run_config=cfg).success
            assert meta(instance, "trained_checkpoint")["reused_checkpoint"] is False
        # The same inputs and settings again: the finished checkpoint is reused, not retrained.
        assert materialize_partition(ASSETS[3:6], instance, res, run_config=cfg).success
        assert meta(instance, "trained_checkpoint")["reused_checkpoint"] is True
        assert materialize_partition([ASSETS[6]], instance, res, run_config=eval_cfg).success
        m = meta(instance, "eval_report")
        assert m["models_compared"] == 5
        report = Path(str(m["report_path"]))
        text = report.read_text()
        assert "| peripheral r=0.5 | 2 |" in text
        # The training seed sets the data order, so the two peripheral runs differ.
        peripheral = next(
            line for line in text.splitlines() if line.startswith("| peripheral r=0.5 | 2 |")
        )
        heldout_cell = peripheral.split(" | ")[4]  # held-out loss, mean ± std over seeds
        assert "±" in heldout_cell and not heldout_cell.endswith("± 0.0000")
        assert "| **random_global r=0.5** | 2 |" in text and "±" in text
        for png in ("metrics.png", "loss_curves.png", "time_vs_fraction.png", "decision.png"):
            assert (report.parent / png).stat().st_size > 1000 and f"![{png}]({png})" in text
        assert {
            "base/mbpp_pass@1",
            "tuned/mmlu_medical_accuracy",
            "tuned/humaneval_solution_nll",
        } <= set(m)
        # Intervals and verdicts: peripheral (2 seeds) against random_global (2 seeds) and base,
        # on held-out loss (per sample), solution NLL, pass@1 and accuracy (per item).
        rows = [
            line
            for line in text.splitlines()
            if line.startswith("| peripheral r=0.5 | random_global r=0.5 |")
        ]
        # Not pass@1 (every model scores 0) nor MBPP (1 problem: no interval).
        assert {line.split(" | ")[2] for line in rows} == {
            "heldout_loss",
            "humaneval_solution_nll",
            "mmlu_medical_accuracy",
        }
        for line in rows:
            assert (
                " [" in line
                and "2 vs 2" in line
                and any(
                    v in line for v in ("**better**", "**worse**", "**no detectable difference**")
                )
            )
        assert "every model scores 0 on humaneval_pass@1" in text
        assert "### Was the subset worth it? `random_global r=0.5`" in text
        assert {v["reference"] for v in m["verdicts"]} == {"base"}
        # Per-item scores are a Delta table: one held-out loss per sample and model.
        scores = pl.read_delta(str(m["item_scores_uri"]), version=int(m["item_scores_version"]))
        heldout = scores.filter(pl.col("metric") == "heldout_loss")
        assert heldout.group_by("model").len()["len"].to_list() == [6] * 5
        assert (heldout["weight"] > 0).all()
        # The inter-rank gradient cosine was logged during training (every 5 steps).
        assert "| peripheral r=0.5 |" in text and "inter-rank grad cosine" in text
        # Evaluations are cached: a second report evaluates nothing again.
        assert materialize_partition([ASSETS[6]], instance, res, run_config=eval_cfg).success
        assert len(list((report.parent / "evals").glob("*.json"))) == 5


def test_checkpoints_of_other_training_setups_are_groups_of_their_own():
    """Seeds of one setup share a group; a run with other training settings (LoRA here) is a
    group of its own, named by the settings that vary, and compared with references of its
    setup only."""
    from cluster_pipeline.evaluation.report import model_entries, references_of
    from cluster_pipeline.training.checkpointing import Checkpoint

    def ckpt(name, selector, seed, **settings):
        info = {
            "config": {
                "settings": {"seed": seed, "lora_r": 0, "epochs": 1, **settings},
                "provenance": {"selector": selector, "ratio": 0.5, "selection_seed": seed},
            }
        }
        return Checkpoint(Path(name), info)

    entries = model_entries(
        "base_model",
        [
            ckpt("a", "peripheral", 0),
            ckpt("b", "peripheral", 1, save_every_steps=2),  # a run-only setting: same setup
            ckpt("c", "peripheral", 0, lora_r=8),
            ckpt("d", "random_global", 0),
            ckpt("e", "random_global", 0, lora_r=8),
        ],
    )
    assert [(e.name, e.group) for e in entries] == [
        ("base", "base"),
        (
            "peripheral r=0.5 (lora_r=0), training seed 0, selection seed 0",
            "peripheral r=0.5 (lora_r=0)",
        ),
        (
            "peripheral r=0.5 (lora_r=0), training seed 1, selection seed 1",
            "peripheral r=0.5 (lora_r=0)",
        ),
        (
            "peripheral r=0.5 (lora_r=8), training seed 0, selection seed 0",
            "peripheral r=0.5 (lora_r=8)",
        ),
        (
            "random_global r=0.5 (lora_r=0), training seed 0, selection seed 0",
            "random_global r=0.5 (lora_r=0)",
        ),
        (
            "random_global r=0.5 (lora_r=8), training seed 0, selection seed 0",
            "random_global r=0.5 (lora_r=8)",
        ),
    ]
    rows = [
        {"group": e.group, "selector": s, "ratio": 0.5 if s else None, "setup": e.setup}
        for e, s in zip(
            entries,
            [None, "peripheral", "peripheral", "peripheral", "random_global", "random_global"],
            strict=True,
        )
    ]
    assert references_of("peripheral r=0.5 (lora_r=8)", rows) == [
        "random_global r=0.5 (lora_r=8)",
        "base",
    ]
    # One setup only: the names are as before, without a suffix.
    same = model_entries("base_model", [ckpt("a", "peripheral", 0), ckpt("b", "peripheral", 1)])
    assert [e.group for e in same] == ["base", "peripheral r=0.5", "peripheral r=0.5"]


def test_runs_of_one_selector_under_other_knobs_are_groups_of_their_own():
    """A selector's own knobs are part of its setup (a helper's trial of issue 41: ifd and ifd
    with ifd_end_of_turn were one group "ifd r=0.9, runs 2", shown as seeds): the provenance
    records them (``selector_knobs``: the selector's knobs class's fields, target aside) and
    the groups are named by the one that varies."""
    from cluster_pipeline.defs.configs import PeripheralSubsetsConfig
    from cluster_pipeline.defs.records import selector_knobs
    from cluster_pipeline.evaluation.report import model_entries
    from cluster_pipeline.training.checkpointing import Checkpoint

    config = PeripheralSubsetsConfig(selector="ifd", ifd_end_of_turn=True).model_dump(mode="json")
    assert selector_knobs("ifd", config) == {"ifd_end_of_turn": True, "ifd_truncated": False}
    assert selector_knobs("peripheral", config) == {}
    assert selector_knobs("balanced_random", config) == {}

    def ckpt(name, seed, **knobs):
        prov = {
            "selector": "ifd",
            "ratio": 0.9,
            "selection_seed": seed,
            "selector_knobs": {"ifd_end_of_turn": False, "ifd_truncated": False, **knobs},
        }
        return Checkpoint(Path(name), {"config": {"settings": {"seed": seed}, "provenance": prov}})

    entries = model_entries(
        "base_model", [ckpt("a", 0), ckpt("b", 1), ckpt("c", 0, ifd_end_of_turn=True)]
    )
    assert [e.group for e in entries] == [
        "base",
        "ifd r=0.9 (ifd_end_of_turn=False)",
        "ifd r=0.9 (ifd_end_of_turn=False)",
        "ifd r=0.9 (ifd_end_of_turn=True)",
    ]
    # Seeds of one setting stay one group, named as before.
    same = model_entries("base_model", [ckpt("a", 0), ckpt("b", 1)])
    assert [e.group for e in same] == ["base", "ifd r=0.9", "ifd r=0.9"]


def test_a_targeted_selector_is_named_with_its_target_set():
    from cluster_pipeline.evaluation.report import model_entries
    from cluster_pipeline.training.checkpointing import Checkpoint

    def ckpt(name, selector, **provenance):
        prov = {"selector": selector, "ratio": 0.5, "selection_seed": 0, **provenance}
        return Checkpoint(Path(name), {"config": {"settings": {"seed": 0}, "provenance": prov}})

    entries = model_entries(
        "base_model",
        [
            ckpt("a", "rds", selection_target="humaneval"),
            ckpt("b", "rds", selection_target="mmlu_medical"),
            ckpt("c", "peripheral"),
        ],
    )
    assert [e.group for e in entries] == [
        "base",
        "rds r=0.5 target=humaneval",
        "rds r=0.5 target=mmlu_medical",
        "peripheral r=0.5",
    ]


def test_models_finished_before_an_evaluation_fails_are_cached_and_not_evaluated_again(tmp_path):
    """One evaluation process runs every model without a cached outcome; when it dies on a later
    model, the ones it finished are cached, and the rerun evaluates only the rest."""
    from cluster_pipeline.evaluation.report import ModelEntry, evaluate_entries
    from cluster_pipeline.storage.cache import JsonCache
    from cluster_pipeline.training.checkpointing import TRAINING_INFO, Checkpoint

    entries = []
    for name in ("a", "b", "c"):
        folder = tmp_path / name
        folder.mkdir()
        (folder / TRAINING_INFO).write_text("{}")
        entries.append(ModelEntry(name, "g", str(folder), Checkpoint(folder, {})))
    paths = [e.path for e in entries]

    def outcome(path: str) -> dict:
        loss = float(paths.index(path) + 1)
        items = {"heldout_loss": {"ids": ["s"], "weights": [1.0], "values": [loss]}}
        return {"metrics": {"heldout_loss": loss}, "items": items, "heldout_tokens": 7}

    calls: list[list[str]] = []

    def dies_on_the_second(asked: list[str], done) -> None:
        calls.append(asked)
        done(asked[0], outcome(asked[0]))
        raise RuntimeError("killed by signal SIGKILL")

    def evaluates_all(asked: list[str], done) -> None:
        calls.append(asked)
        for path in asked:
            done(path, outcome(path))

    cache = JsonCache(tmp_path / "evals")
    with pytest.raises(RuntimeError, match="SIGKILL"):
        evaluate_entries(entries, dies_on_the_second, cache, "k", current=paths[2], log=print)
    assert calls == [paths] and len(list(cache.folder.glob("*.json"))) == 1
    results, heldout = evaluate_entries(
        entries, evaluates_all, cache, "k", current=paths[2], log=print
    )
    assert calls == [paths, paths[1:]]  # "a" came from the cache
    assert [r.metrics["heldout_loss"] for r in results] == [1.0, 2.0, 3.0]
    assert [r.current for r in results] == [False, False, True] and heldout["tokens"] == 7
    evaluate_entries(entries, evaluates_all, cache, "k", current=paths[2], log=print)
    assert len(calls) == 2  # everything cached: no process at all

"""benchmarks/gpu_step.py: its ``--smoke`` mode runs every configuration on the CPU and prints
the lines a GPU run prints, with figures that agree with each other; a failing configuration
prints its error and the run goes on."""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_step.py"
# The smoke run (about a minute on 2 cores) is slow; its three tests share one run on one
# worker.


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("gpu_step") / "smoke.jsonl"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    printed = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert printed == [json.loads(line) for line in out.read_text().splitlines()]
    return printed


@pytest.mark.slow
@pytest.mark.xdist_group("gpu_step_smoke")
def test_the_smoke_run_prints_every_configuration_in_order(smoke):
    assert [r["config"] for r in smoke] == [
        "environment",
        "packing gate",
        "padded",
        "packed sdpa",
        "packed varlen",
        "+ fused CE",
        "+ fused AdamW",
        "plain forward",
        "embedding pass",
        "+ compile",
        "done",
    ]
    assert smoke[-1]["failed"] == 0 and not any("error" in r for r in smoke)
    assert "skipped" in smoke[-2]  # compile: not under --smoke
    env = smoke[0]
    # A bare GPU machine has none of these: the script and the modules it drives need none.
    assert env["heavy_modules"] == [] and env["device"] == "cpu" and env["smoke"] is True


@pytest.mark.slow
@pytest.mark.xdist_group("gpu_step_smoke")
def test_the_smoke_run_drives_each_kernel_it_names(smoke):
    by = {r["config"]: r for r in smoke}
    assert by["packing gate"]["ok"] is True and by["packing gate"]["crossing"] == 0.0
    assert by["padded"]["attention"].startswith("sdpa")
    assert by["packed sdpa"]["attention"] == "sdpa"
    # On the CPU the variable-length configurations run the reference kernel.
    assert by["packed varlen"]["attention"] == "reference (sdpa per sample)"
    assert by["+ fused CE"]["loss"] == "chunked" and by["packed varlen"]["loss"] == "logits"
    assert by["+ fused AdamW"]["optimizer"] == "AdamW fused"
    assert by["+ fused CE"]["optimizer"] == "AdamW for-each"
    # The packed configurations start from the same weights on the same first step: the same
    # loss whichever attention and loss kernel computed it (float32 on the CPU).
    first = [by[c]["first_loss"] for c in ("packed sdpa", "packed varlen", "+ fused CE")]
    assert max(first) - min(first) <= 2e-4, first
    assert by["embedding pass"]["packed"] is True


@pytest.mark.slow
@pytest.mark.xdist_group("gpu_step_smoke")
def test_the_smoke_run_figures_agree_with_each_other(smoke):
    by = {r["config"]: r for r in smoke}
    padded = by["padded"]["tokens_per_s"]
    for name in ("padded", "packed sdpa", "packed varlen", "+ fused CE", "+ fused AdamW"):
        r = by[name]
        assert r["steps"] >= 1 and r["real_tokens"] > 0
        # "seconds" is written to the millisecond: on a fast CPU a 3-step run of the tiny model
        # takes a few hundredths of a second, where that rounding alone exceeds 1 %.
        rounding = 5e-4 / r["seconds"]
        assert r["tokens_per_s"] == pytest.approx(
            r["real_tokens"] / r["seconds"], rel=1e-2 + rounding
        )
        assert r["vs_padded"] == pytest.approx(r["tokens_per_s"] / padded, abs=2e-3)
        # 6 N x tokens / (seconds x 989 TFLOP/s): a few 1e-9 on a CPU, 0 at 4 decimals.
        assert r["mfu"] == round(
            6 * smoke[0]["parameters"] * r["real_tokens"] / (r["seconds"] * 989e12), 4
        )
    assert by["+ fused AdamW"]["target"] == "mfu >= 0.45"
    assert by["+ fused AdamW"]["meets_target"] is False
    embed, forward = by["embedding pass"], by["plain forward"]
    assert embed["real_tokens"] == forward["real_tokens"]
    assert embed["vs_plain_forward"] == pytest.approx(
        forward["seconds"] / embed["seconds"], rel=2e-2
    )
    assert embed["target"] == "embedding / forward >= 1.1"


def test_a_failing_configuration_prints_its_error_and_the_run_goes_on(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_step  # pyright: ignore[reportMissingImports]  (benchmarks/ is not a package)

    lines: list[dict] = []
    run = SimpleNamespace(
        emit=lines.append,
        start=__import__("time").perf_counter(),
        args=SimpleNamespace(smoke=False, budget_s=3600),
        baseline=None,
    )

    def broken():
        raise RuntimeError("out of memory, say")

    configs = [
        ("padded", lambda: [{"tokens_per_s": 100.0, "mfu": 0.1}]),
        ("packed varlen", broken),
        ("+ fused AdamW", lambda: [{"tokens_per_s": 250.0, "mfu": 0.5}]),
    ]
    assert gpu_step.run_configs(run, configs) == 1
    assert [r["config"] for r in lines] == ["padded", "packed varlen", "+ fused AdamW"]
    assert lines[1]["error"] == "RuntimeError: out of memory, say"
    assert lines[2]["vs_padded"] == 2.5 and lines[2]["meets_target"] is True
    run.args.budget_s = 0  # spent: the rest is skipped, each with a line
    lines.clear()
    assert gpu_step.run_configs(run, configs[:1]) == 0
    assert lines == [{"config": "padded", "skipped": "past the time budget of 0 s"}]

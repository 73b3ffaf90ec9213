"""Cost of the bubblewrap sandbox per generated program.

    python benchmarks/sandbox_overhead.py [--runs 30]

Medians over ``--runs`` of: a bare ``python -I -c pass`` subprocess (the baseline, measured in
the same run), ``run_python("pass")`` without isolation (``unsafe=True``: rlimits only, the
pre-bubblewrap sandbox) and with it; then all 164 HumanEval reference solutions with their tests,
run as ``code_pass_at_1`` runs them (two at a time), unsafe vs isolated, as total seconds. Prints
the per-program overhead against the baseline (ms and ratio) and the growth of HumanEval's
program-running time. About one minute on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from arguments import positive_int


def _median_seconds(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    from cluster_pipeline.evaluation.sandbox import _python, run_python, sandbox_problem
    from cluster_pipeline.evaluation.suites import load_humaneval

    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--runs", type=positive_int, default=30)
    args = p.parse_args()
    problem = sandbox_problem()
    if problem:
        sys.exit(f"no isolation on this machine: {problem}")
    python = str(_python())
    bare = _median_seconds(lambda: subprocess.run([python, "-I", "-c", "pass"]), args.runs)
    unsafe = _median_seconds(lambda: run_python("pass\n", unsafe=True), args.runs)
    isolated = _median_seconds(lambda: run_python("pass\n"), args.runs)
    print(f"bare python -I -c pass        {bare * 1e3:7.1f} ms (baseline)")
    print(f"run_python, rlimits only      {unsafe * 1e3:7.1f} ms ({unsafe / bare:.2f}x)")
    print(f"run_python, bubblewrap        {isolated * 1e3:7.1f} ms ({isolated / bare:.2f}x)")
    print(f"bubblewrap overhead per program: {(isolated - unsafe) * 1e3:.1f} ms")
    programs = [f"{q.prompt}{q.solution}\n{q.test}" for q in load_humaneval()]
    totals = {}
    for name, unsafe in (("rlimits only", True), ("bubblewrap", False)):
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=2) as pool:
            results = list(pool.map(partial(run_python, timeout_s=5.0, unsafe=unsafe), programs))
        totals[name] = time.perf_counter() - start
        passed = sum(r.passed for r in results)
        print(f"HumanEval references, {name:12s}: {totals[name]:6.1f} s, {passed}/164 pass")
    growth = totals["bubblewrap"] / totals["rlimits only"]
    print(f"HumanEval program time, bubblewrap / rlimits only: {growth:.2f}x")


if __name__ == "__main__":
    main()

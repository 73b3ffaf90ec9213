"""The main job's memory as a machine sees it: every process of the run, sampled, summed.

    python benchmarks/run_memory.py [--profile cpu_quick] [--dataset python_stdlib]
        [--work /tmp/run_memory] [--model DIR] [--interval 0.5]
    python benchmarks/run_memory.py --attach PID [--dagster-home DIR] [--dataset python_stdlib]

``--attach`` samples a run already going (the ``dagster job execute`` process ``make run``
starts, or ``make`` itself) until it ends, the same way, without starting one: a ``make run``
in a fresh clone measured as it is. Its output is not this script's to read, so an attached
run's figures are memory only (no longest line or silence: time-stamp the run's own output for
those); run it with a Python that has psutil (the project's ``.venv`` once ``make setup`` has
installed the packages).

What ``make run`` does after its setup (``cluster-pipeline datasets sync``, ``cluster-pipeline
run-config``, ``dagster job execute -j main_job``), in a fresh data folder and Dagster instance
under ``--work``; without ``--model`` the built-in model is converted inside the run, as on a
first ``make run``. Every ``--interval`` seconds it reads each process of the run's tree (the
``dagster`` command, its run worker, step processes, torchrun agents, ranks): the sum of their
PSS (``/proc/<pid>/smaps_rollup``: shared pages counted once, split between their users) and of
their RSS (shared pages counted in each), and each process's own high-water mark (``VmHWM``,
monotone, so its last sample is the process's peak). Printed: the run's peak of both sums with
the steps running at that moment, every rank's peak by recipe (embed, train, evaluate), the
longest line of the run's output and its longest silence (seconds between two lines), and the
stages' estimate-vs-measured metadata where the run recorded it. ``--json`` writes it all.

Memory does not depend on what else runs on the machine; seconds do (the silences are upper
bounds on a busy machine).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9
RECIPES = {
    "cluster_pipeline.recipes.embed": "embed",
    "cluster_pipeline.recipes.train": "train",
    "cluster_pipeline.recipes.evaluate": "evaluate",
}


def _bin(name: str) -> str:
    return str(Path(sys.executable).parent / name)


def role(cmdline: list[str]) -> str:
    """What a process of the run is, from its command line: a rank of a recipe, a torchrun
    agent, or another process (the dagster command, run worker, step processes)."""
    text = " ".join(cmdline)
    if "cluster_pipeline.launch.launcher" in text or "torch.distributed.run" in text:
        return "torchrun agent"  # its command line names the recipe too
    for module, name in RECIPES.items():
        if module in text:
            return f"{name} rank"
    return "dagster"


def pss_bytes(proc: psutil.Process) -> int:
    """PSS of ``proc`` in bytes (``smaps_rollup``), its RSS where that is unreadable."""
    try:
        return int(proc.memory_full_info().pss)
    except (psutil.AccessDenied, AttributeError):
        return int(proc.memory_info().rss)


def hwm_bytes(pid: int) -> int:
    """``VmHWM`` of ``pid`` in bytes (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Sampler(threading.Thread):
    """Samples the process tree under ``root_pid`` every ``interval`` seconds until stopped."""

    def __init__(self, root_pid: int, interval: float, running_steps: set[str]) -> None:
        super().__init__(daemon=True)
        self.root, self.interval, self.steps = root_pid, interval, running_steps
        self.stop = threading.Event()
        self.peak_pss = self.peak_rss = 0
        self.at_peak: dict = {}
        self.processes: dict[int, dict] = {}

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                root = psutil.Process(self.root)
                tree = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            pss = rss = 0
            rows = []
            for proc in tree:
                try:
                    p, r = pss_bytes(proc), int(proc.memory_info().rss)
                    entry = self.processes.setdefault(
                        proc.pid, {"role": role(proc.cmdline()), "hwm": 0, "pss": 0}
                    )
                except (psutil.NoSuchProcess, psutil.ZombieProcess):
                    continue
                entry["hwm"] = max(entry["hwm"], hwm_bytes(proc.pid))
                entry["pss"] = max(entry["pss"], p)
                pss, rss = pss + p, rss + r
                rows.append((entry["role"], p))
            if pss > self.peak_pss:
                self.peak_pss = pss
                self.at_peak = {"steps": sorted(self.steps), "processes": sorted(rows)}
            self.peak_rss = max(self.peak_rss, rss)
            self.stop.wait(self.interval)


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--profile", default="cpu_quick")
    p.add_argument("--dataset", default="python_stdlib")
    p.add_argument("--work", type=Path, default=Path("/tmp/run_memory"))
    p.add_argument("--model", help="a converted base model folder (default: convert in the run)")
    p.add_argument("--interval", type=float, default=0.5)
    p.add_argument("--json", type=Path, help="write the figures here")
    p.add_argument("--attach", type=int, help="sample this running process's tree instead")
    p.add_argument("--dagster-home", type=Path, help="with --attach: the run's DAGSTER_HOME")
    args = p.parse_args()
    if args.attach:
        attach(args)
        return

    if args.work.exists():
        shutil.rmtree(args.work)
    data, home = args.work / "data", args.work / "dagster_home"
    (data / "raw").mkdir(parents=True)
    home.mkdir()
    shutil.copy(ROOT / "cluster_pipeline" / "defs" / "instance" / "dagster.yaml", home)
    env = {**os.environ, "DAGSTER_HOME": str(home), "CLUSTER_PIPELINE_DATA_DIR": str(data)}
    if args.model:
        env["CLUSTER_PIPELINE_BASE_MODEL"] = args.model
    # The benchmark files a run on the project's machines finds beside the project (MBPP).
    for folder in (
        ROOT.parent / "shared" / "datasets" / "eval",
        ROOT.parents[1] / "shared" / "datasets" / "eval",
    ):
        if (folder / "mbpp_reworded.json").is_file():
            (data / "eval").mkdir(exist_ok=True)
            shutil.copy(folder / "mbpp_reworded.json", data / "eval")
            break
    run = lambda *a: subprocess.run(a, env=env, check=True, capture_output=True, text=True)  # noqa: E731
    run(_bin("cluster-pipeline"), "datasets", "sync", "--require", args.dataset)
    config = args.work / "run_config.yaml"
    config.write_text(run(_bin("cluster-pipeline"), "run-config", args.profile).stdout)
    job = "main_job" if args.profile == "cpu_quick" else f"main_job_{args.profile}"
    command = [
        *[_bin("dagster"), "job", "execute", "-m", "cluster_pipeline.definitions", "-j", job],
        *["-c", str(config), "--tags", json.dumps({"dagster/partition": args.dataset})],
    ]
    start = time.monotonic()
    # Bytes, split at newlines only: a progress bar's carriage returns stay inside its line, as
    # a terminal or a log file keeps them.
    proc = subprocess.Popen(
        command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    steps: set[str] = set()
    sampler = Sampler(proc.pid, args.interval, steps)
    sampler.start()
    log = (args.work / "run.log").open("w")
    last, longest_silence, silence_before = start, 0.0, ""
    longest_line = ""
    assert proc.stdout is not None
    for raw in proc.stdout:
        line = raw.decode(errors="replace")
        now = time.monotonic()
        if now - last > longest_silence:
            longest_silence, silence_before = now - last, line.strip()[:200]
        last = now
        log.write(f"{now - start:8.1f} {line}")
        log.flush()
        if len(line.rstrip("\n")) > len(longest_line):
            longest_line = line.rstrip("\n")
        for event, change in (("STEP_START", steps.add), ("STEP_SUCCESS", steps.discard)):
            if f" - {event} - " in line:
                change(_step_of(line))
    rc = proc.wait()
    sampler.stop.set()
    sampler.join()
    wall = time.monotonic() - start

    ranks: dict[str, list[float]] = {}
    for entry in sampler.processes.values():
        if entry["role"].endswith("rank"):
            ranks.setdefault(entry["role"], []).append(round(entry["hwm"] / GB, 2))
    out = {
        "profile": args.profile,
        "dataset": args.dataset,
        "returncode": rc,
        "wall_seconds": round(wall, 1),
        "peak_pss_gb": round(sampler.peak_pss / GB, 2),
        "peak_rss_sum_gb": round(sampler.peak_rss / GB, 2),
        "steps_at_peak": sampler.at_peak.get("steps", []),
        "processes_at_peak": [
            (r, round(b / GB, 2)) for r, b in sampler.at_peak.get("processes", [])
        ],
        "rank_peaks_gb": ranks,
        "longest_line_chars": len(longest_line),
        "longest_line_start": longest_line[:160],
        "longest_silence_seconds": round(longest_silence, 1),
        "line_after_longest_silence": silence_before,
        "log": str(args.work / "run.log"),
        "memory_metadata": _memory_metadata(home, args.dataset),
    }
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    if rc:
        sys.exit(f"the run failed (rc {rc}); its output: {args.work / 'run.log'}")


def attach(args: argparse.Namespace) -> None:
    """Sample the tree of the running process ``args.attach`` until it ends; print (and
    ``--json``: write) the run's peak PSS and RSS sums, the processes at the peak and each
    rank's peak, and with ``--dagster-home`` each stage's memory metadata."""
    steps: set[str] = set()
    sampler = Sampler(args.attach, args.interval, steps)
    start = time.monotonic()
    sampler.start()
    sampler.join()  # returns when the root process is gone
    ranks: dict[str, list[float]] = {}
    for entry in sampler.processes.values():
        if entry["role"].endswith("rank"):
            ranks.setdefault(entry["role"], []).append(round(entry["hwm"] / GB, 2))
    out = {
        "attached_to": args.attach,
        "sampled_seconds": round(time.monotonic() - start, 1),
        "peak_pss_gb": round(sampler.peak_pss / GB, 2),
        "peak_rss_sum_gb": round(sampler.peak_rss / GB, 2),
        "processes_at_peak": [
            (r, round(b / GB, 2)) for r, b in sampler.at_peak.get("processes", [])
        ],
        "rank_peaks_gb": ranks,
        "memory_metadata": (
            _memory_metadata(args.dagster_home, args.dataset) if args.dagster_home else {}
        ),
    }
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


def _memory_metadata(home: Path, dataset: str) -> dict[str, str]:
    """Each stage's ``memory_per_rank`` metadata (estimate and measured peak) in the run's
    instance."""
    import dagster as dg

    out = {}
    with dg.DagsterInstance.from_config(str(home)) as instance:
        for asset in ("proxy_embeddings", "trained_checkpoint", "eval_report"):
            records = instance.fetch_materializations(
                dg.AssetRecordsFilter(asset_key=dg.AssetKey(asset), asset_partitions=[dataset]),
                limit=1,
            ).records
            event = records[0].asset_materialization if records else None
            if event is not None and "memory_per_rank" in event.metadata:
                out[asset] = str(event.metadata["memory_per_rank"].value)
    return out


def _step_of(line: str) -> str:
    """The step a Dagster event line names (``... - STEP_START - Started execution of step
    "proxy_embeddings".``), else the line's start."""
    if 'step "' in line:
        return line.split('step "', 1)[1].split('"', 1)[0]
    return line[:60]


if __name__ == "__main__":
    main()

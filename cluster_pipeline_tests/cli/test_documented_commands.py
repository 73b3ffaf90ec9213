"""Every `cluster-pipeline` command the README and the guides show works after the main job, as
written (issue 44, item 3), so that the documentation and the product cannot drift apart: the
tiny end-to-end project (cluster_pipeline_tests/runs.py) runs `main_job` from a shell as `make
run` does (`dagster job execute -j main_job` with the dataset partition's tag), then each
documented command line runs against it. The documents' example dataset names become the
project's dataset `tiny`, `<sample_id>` the first id `lineage --selected` prints (where the
trace guide says to find one), and a folder placeholder a fresh folder; a line that still holds
a placeholder (`<selector>`, `OLD`, `...`), a command named in prose without the arguments
it requires (`cluster-pipeline export`), and the commands that start a server (`dev`,
`mlflow`), run with `--help` instead. The same run's log is read for the progress lines of item
4: one `<stage> done in N s` line per stage, no line over 300 characters, no Markdown, labelled
metrics."""

import json
import re
import shlex
from collections import Counter
from pathlib import Path

import pytest
import yaml

from cluster_pipeline.cli.main import COMMANDS
from cluster_pipeline.defs.stages import STAGES
from cluster_pipeline_tests.helpers import RUN_CONFIG
from cluster_pipeline_tests.runs import ROOT, Project
from cluster_pipeline_tests.test_docs import README, _code, _command_lines

pytestmark = pytest.mark.slow

DOCUMENTS = [README, *sorted((ROOT / "docs").rglob("*.md"))]
MAIN_JOB_ASSETS = [*STAGES, "sample_lineage"]
EXAMPLE_DATASETS = {"python_stdlib", "mydata", "<dataset>", "<name>"}
FOLDERS = {"DIR", "<folder>", "<out>"}
# A run config a run logged (tracking.md: an MLflow run's artifact): the main job's own.
RUN_CONFIGS = {"run_config.yaml", "<run_config.yaml>"}
SERVERS = {"dev", "mlflow"}
# A word that stands for something the reader fills in.
PLACEHOLDER = re.compile(r"<[^>]*>|\.\.\.|^[A-Z]{1,5}$|^\[|^\(|^\|$")


def documented_commands() -> list[tuple[str, list[str]]]:
    """(``file:line``, the words after ``cluster-pipeline``) of every command in the code of
    README.md and docs/ (test_docs.py reads them the same way), each distinct line once."""
    found, seen = [], set()
    for path in DOCUMENTS:
        for line, code in _code(path):
            for words in _command_lines(code, "cluster-pipeline"):
                key = tuple(words)
                if key not in seen:
                    seen.add(key)
                    found.append((f"{path.relative_to(ROOT)}:{line}", words))
    return found


def as_run(words: list[str], sample_id: str, out_dir: Path, run_config: Path) -> list[str]:
    """The command line run for a documented one: example datasets -> ``tiny``, the sample id,
    a folder, the run config the main job ran; ``--help`` of its command where a placeholder is
    left, or a server would start; ``rerun`` with ``--dry-run`` (it checks the file and prints
    the job it would run; running it again is tracking/test_pipeline_runs.py's test)."""
    filled = []
    for word in words:
        if word in EXAMPLE_DATASETS:
            word = "tiny"
        elif word == "<sample_id>":
            word = sample_id
        elif word in FOLDERS:
            word = str(out_dir)
        elif word in RUN_CONFIGS:
            word = str(run_config)
        filled.append(word)
    if not filled:
        return ["--help"]
    if filled[0] in SERVERS or any(PLACEHOLDER.search(w) for w in filled[1:]):
        return [filled[0], "--help"]
    if len(filled) == 1 and _needs_arguments(filled[0]):  # named in prose, not a line to run
        return [filled[0], "--help"]
    if filled[0] == "rerun" and "--dry-run" not in filled:
        filled.append("--dry-run")
    return filled


def _needs_arguments(command: str) -> bool:
    """Whether ``cluster-pipeline <command>`` requires an argument (as its parser says)."""
    import argparse

    parser = argparse.ArgumentParser()
    if command not in COMMANDS:
        return False
    COMMANDS[command].add_arguments(parser)
    return any(
        a.required or (not a.option_strings and a.nargs not in ("?", "*"))
        for a in parser._actions  # noqa: SLF001 - argparse keeps no public list
    )


def test_the_documents_show_each_cluster_pipeline_command():
    """The check below reads something: the commands a newcomer is shown are all found."""
    shown = {words[0] for _, words in documented_commands() if words}
    assert {"lineage", "export", "run-config", "compare-config", "datasets", "report"} <= shown
    assert shown <= set(COMMANDS)


def _main_job(project: Project) -> tuple[str, Path]:
    """The main job's log, run as `make run` runs it, and its run config file."""
    config = project.config("main", list(RUN_CONFIG["ops"]))
    body = yaml.safe_load(config.read_text())
    body["loggers"] = {"console": {"config": {"log_level": "INFO"}}}  # as run-config prints
    config.write_text(yaml.safe_dump(body))
    out = project.cli(
        *["dagster", "job", "execute", "-m", "cluster_pipeline.definitions", "-j", "main_job"],
        *["-c", str(config), "--tags", json.dumps({"dagster/partition": "tiny"})],
        timeout=1800,
        PYTHONWARNINGS="ignore:Function `job_execute_command` is superseded",
    )
    assert out.returncode == 0, out.stdout[-6000:]
    return out.stdout, config


def test_every_documented_command_works_after_the_main_job(tmp_path, tiny_model_dir):
    with Project.create(tmp_path, tiny_model_dir) as project:
        log, run_config = _main_job(project)
        _check_the_log(log)

        _check_the_metadata(project)

        # make run's closing line: the report where this project's data folder has it.
        closing = project.cli("cluster-pipeline", "report", "tiny", check=True).stdout.strip()
        report = project.data / "reports" / "tiny" / "eval_report.md"
        assert closing == f"report: {report}" and report.is_file()

        selected = project.cli("cluster-pipeline", "lineage", "tiny", "--selected", check=True)
        ids = re.findall(r"^\s*sample_id: (\S+)$", selected.stdout, re.M)
        assert ids, selected.stdout
        failures, ran = [], []
        for where, words in documented_commands():
            args = as_run(words, ids[0], tmp_path / "export_out", run_config)
            out = project.cli("cluster-pipeline", *args)
            ran.append(" ".join(args))
            if out.returncode != 0:
                failures.append(
                    f"{where}: cluster-pipeline {' '.join(words)} (run as: "
                    f"{' '.join(map(shlex.quote, args))}) exited {out.returncode}:\n"
                    f"{out.stdout[-1500:]}"
                )
        print("\n".join(ran))
        assert not failures, "Documented commands that fail after the main job:\n" + "\n".join(
            failures
        )
        # The ones a newcomer runs first were run as written, not as --help.
        assert "lineage tiny --selected" in ran and f"lineage tiny {ids[0]}" in ran
        assert "export tiny" in ran and "run-config" in ran
        assert f"rerun {run_config} --dataset tiny --dry-run" in ran
        assert any(r.startswith("lineage tiny --diff 0") for r in ran)


STAGE_LINE = re.compile(r" - (\w+) - (\w+) done in \d+ s$")


def _check_the_log(log: str) -> None:
    """The run's log reads cleanly (issue 44, item 4)."""
    lines = log.splitlines()
    done = [m.groups() for m in map(STAGE_LINE.search, lines) if m]
    assert Counter(step for step, _ in done) == Counter(MAIN_JOB_ASSETS), [
        line for line in lines if " done in " in line
    ]
    assert all(step == asset for step, asset in done)
    longest = max(lines, key=len)
    assert len(longest) <= 300, longest
    assert not [line for line in lines if "**" in line]
    assert re.search(r" - humaneval pass@1: \d\.\d{4} \(\d+/2 problems solved\)$", log, re.M)
    assert re.search(
        r" - held-out loss: \d+\.\d{4} nats/token over \d+ response tokens$", log, re.M
    )


LONG_FLOAT = re.compile(r"\d\.\d{7,}")


def _check_the_metadata(project: Project) -> None:
    """Every asset's metadata reads cleanly (issue 44, item 5): numbers at most 6 decimals
    (``mean_loss``, ``w_c``), also inside the Markdown previews and tables."""
    import dagster as dg

    problems = []
    with project.instance() as instance:
        for asset in MAIN_JOB_ASSETS:
            event = instance.get_latest_materialization_event(dg.AssetKey(asset))
            assert event is not None and event.asset_materialization is not None, asset
            for key, entry in event.asset_materialization.metadata.items():
                value = entry.value
                values = value if isinstance(value, list) else [value]
                for v in values:
                    if isinstance(v, float) and v == v and abs(v - round(v, 6)) > 1e-12:
                        problems.append(f"{asset}.{key} = {v!r}")
                if isinstance(entry, dg.MarkdownMetadataValue) and "data:image" not in str(value):
                    problems += [f"{asset}.{key}: {m}" for m in LONG_FLOAT.findall(str(value))]
    assert not problems, problems

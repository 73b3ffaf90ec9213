"""A dataset name reaches every command whole: ``make run DATASET="my data"`` (issue 43:
``unrecognized arguments: data``) and every hint the code prints with a user's value in a
shell command (the export's and lineage's "make run" hint, the integrations' "export it again",
the "run it again" of a run's kept run config and of the dataset card, the card's export line).

The kind, "a name a shell or make would split or change": a space, a single quote, a double
quote, a ``$``, a ``;``, an accent, and a plain name. Each hint is run as printed, through the
real Makefile, with stand-ins for ``cluster-pipeline`` and ``dagster`` that record the
arguments they get (and the project's own Python for the one-liners)."""

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import cast

import dagster as dg
import pytest

from cluster_pipeline.cli import UserError, export, make_run, rerun
from cluster_pipeline.cli.export import _materialize_first
from cluster_pipeline.defs.metadata import run_config_text
from cluster_pipeline.integrations.dataset_card import build_card
from cluster_pipeline.storage.layout import DataLayout
from cluster_pipeline_tests.integrations.test_dataset_card import _facts

ROOT = Path(__file__).resolve().parents[2]
NAMES = ["my data", "it's", 'say "hi"', "a$b", "semi;colon", "café", "python_stdlib"]

RECORDER = """#!{python}
import json, os, sys
with open(os.environ["RECORD"], "a") as f:
    f.write(json.dumps([os.path.basename(sys.argv[0]), *sys.argv[1:]]) + "\\n")
if sys.argv[1:2] == ["run-config"]:
    print("ops: {{}}")
"""


def _fake_bin(folder: Path) -> Path:
    """``cluster-pipeline`` and ``dagster`` that record their arguments; the real Python."""
    folder.mkdir()
    for name in ("cluster-pipeline", "dagster"):
        path = folder / name
        path.write_text(RECORDER.format(python=sys.executable))
        path.chmod(0o755)
    (folder / "python").symlink_to(sys.executable)
    return folder


def _run_make(command: str, tmp_path: Path) -> tuple[list[list[str]], str]:
    """``command`` (a ``make run ...`` line, as printed) run by a shell in a folder of its own
    against the project's Makefile, setup and its prerequisites (the Python environment,
    bubblewrap) taken as made; the commands' arguments and make's output."""
    work = tmp_path / "work"
    (work / "cluster_pipeline" / "defs" / "instance").mkdir(parents=True)
    shutil.copy(
        ROOT / "cluster_pipeline" / "defs" / "instance" / "dagster.yaml",
        work / "cluster_pipeline" / "defs" / "instance" / "dagster.yaml",
    )
    record = tmp_path / "record.jsonl"
    env = {
        **os.environ,
        "RECORD": str(record),
        "PYTHONPATH": str(ROOT),
        "CLUSTER_PIPELINE_DATA_DIR": str(tmp_path / "data"),
    }
    env.pop("DATASET", None)
    env.pop("MAKEFLAGS", None)
    extra = [
        "-f",
        str(ROOT / "Makefile"),
        "-o",
        "setup",
        "-o",
        ".venv/.installed",  # run and compare need the environment, not all of setup
        "-o",
        "/usr/bin/bwrap",  # and the sandbox (installed if missing)
        f"BIN={_fake_bin(tmp_path / 'bin')}",
        f"DAGSTER_HOME={tmp_path / 'home'}",
    ]
    done = subprocess.run(
        ["bash", "-c", f"{command} {shlex.join(extra)}"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    return calls, done.stdout


@pytest.mark.parametrize("name", NAMES)
def test_the_printed_make_run_line_runs_the_named_dataset(name, tmp_path):
    # The hint as the export prints it, and as lineage prints it (the same helper).
    with pytest.raises(UserError) as e:
        raise _materialize_first(name, "no run yet")
    message = str(e.value)
    assert f"`{make_run(name)}`" in message
    calls, _ = _run_make(make_run(name), tmp_path)
    assert calls[0] == ["cluster-pipeline", "datasets", "sync", "--require", name]
    assert calls[1] == ["cluster-pipeline", "run-config", "cpu_quick"]
    dagster = calls[2]
    assert dagster[:2] == ["dagster", "job"]
    assert json.loads(dagster[dagster.index("--tags") + 1]) == {"dagster/partition": name}
    # It ends by naming the report of that dataset (cli/report.py prints its path).
    assert calls[3] == ["cluster-pipeline", "report", name]
    assert len(calls) == 4


@pytest.mark.parametrize("name", NAMES)
def test_the_report_line_names_that_datasets_report(name, tmp_path, capsys):
    """``cluster-pipeline report <name>``, the last line of make run: the report's own folder."""
    from cluster_pipeline.cli import report as report_cli

    args = argparse.Namespace(dataset=name, data_dir=str(tmp_path / "data"))
    layout = DataLayout.at(tmp_path / "data")
    if name != "python_stdlib":  # the built-in dataset is always there
        # No such dataset: no `make run` hint, which could not make a report (a new user's
        # trial, 2026-12-05); the datasets there are listed.
        with pytest.raises(UserError) as e:
            report_cli.run(args, argparse.ArgumentParser())
        assert str(e.value) == (
            f"no dataset {name!r}: no report at {layout.reports_dir(name) / 'eval_report.md'}, "
            f"and no folder of its data under {layout.raw_dir}. Datasets found: python_stdlib."
        )
        (layout.raw_dir / name).mkdir(parents=True)
        (layout.raw_dir / name / "train.jsonl").write_text('{"instruction": "I", "output": "O"}\n')
    with pytest.raises(UserError) as e:
        report_cli.run(args, argparse.ArgumentParser())
    assert f"`{make_run(name)}`" in str(e.value)  # none yet: how to make one
    report = DataLayout.at(tmp_path / "data").reports_dir(name) / "eval_report.md"
    report.parent.mkdir(parents=True)
    report.write_text("# report\n")
    report_cli.run(args, argparse.ArgumentParser())
    assert capsys.readouterr().out == f"report: {report}\n"


def test_the_hint_is_plain_for_a_plain_name():
    assert make_run("python_stdlib") == "make run DATASET=python_stdlib"
    assert make_run("my data") == "make run 'DATASET=my data'"
    assert make_run("a$b") == "make run 'DATASET=a$$b'"


def test_make_run_with_a_quoted_name_as_the_readme_writes_it(tmp_path):
    calls, _ = _run_make('make run DATASET="my data"', tmp_path)
    assert calls[0] == ["cluster-pipeline", "datasets", "sync", "--require", "my data"]


@pytest.mark.parametrize("name", NAMES)
def test_the_export_it_again_hints_quote_their_values(name, tmp_path):
    """The integrations' hints split back (shlex, as a shell does) into the exact words."""
    from cluster_pipeline.integrations.hf_datasets import ExportError, verify_export
    from cluster_pipeline.integrations.hf_trainer import ClusterShards

    folder = tmp_path / name / "export"
    with pytest.raises(ValueError) as e:
        ClusterShards.from_data_dir(name, tmp_path / name)
    hint = str(e.value).split("`")[1]
    assert shlex.split(hint) == ["cluster-pipeline", "export", name]
    # verify_export's hint names the dataset and the folder (any characters) as one word each.
    folder.mkdir(parents=True)
    record = {
        "exporter": "cluster-pipeline export",
        "format": 2,
        "dataset": name,
        "manifest_set_sha256": "0" * 64,
        "manifest_sha256": ["0" * 64],
        "splits": {"train": 1},
        "files": {"data/train-00000-of-00001.parquet": "0" * 64},
    }
    (folder / "export.json").write_text(json.dumps(record))
    with pytest.raises(ExportError) as e:
        verify_export(folder)
    redo = str(e.value).split("`")[1]
    assert shlex.split(redo) == [
        "cluster-pipeline",
        "export",
        name,
        "--out",
        str(folder),
        "--overwrite",
    ]


def _parsed(command: str, module: ModuleType) -> argparse.Namespace:
    """``command`` (``cluster-pipeline <sub> ...``) run by bash, with a ``cluster-pipeline``
    that prints the words it gets, then those words parsed by the real subcommand's arguments."""
    shown = f"{shlex.quote(sys.executable)} -c 'import json, sys; print(json.dumps(sys.argv[1:]))'"
    done = subprocess.run(
        ["bash", "-c", f'cluster-pipeline() {{ {shown} "$@"; }}\n{command}'],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and done.stderr == "", (command, done.stderr)
    (line,) = done.stdout.splitlines()
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(json.loads(line)[1:])


@pytest.mark.parametrize("name", NAMES)
def test_the_run_it_again_lines_of_the_run_config_and_the_card_quote_the_name(name):
    """The run config kept with a run (MLflow's run_config.yaml) and the dataset card print
    ``cluster-pipeline rerun ... --dataset NAME`` and ``cluster-pipeline export NAME``: each,
    as a shell reads it, gives the subcommand exactly the name."""
    context = cast(
        dg.AssetExecutionContext,
        SimpleNamespace(partition_key=name, run=SimpleNamespace(run_id="0123abcd")),
    )
    text = run_config_text({"ops": {}}, context)
    line = next(x for x in text.splitlines() if x.startswith("# Run it again: "))
    args = _parsed(line.removeprefix("# Run it again: "), rerun)
    assert (args.run_config, args.dataset) == (Path("run_config.yaml"), name)
    facts = _facts(None)
    facts = replace(facts, source=replace(facts.source, dataset=name))
    card = build_card(facts)
    again = card.split("run_config.yaml` and run `", 1)[1].split("`", 1)[0]
    assert _parsed(again, rerun).dataset == name
    exported = card.split("exported by `", 1)[1].split("`", 1)[0]
    assert _parsed(exported, export).dataset == name


@pytest.mark.parametrize("name", NAMES)
def test_rerun_dry_run_prints_a_line_a_shell_splits_back_into_the_command(name, tmp_path, capsys):
    # A new user's trial (2026-12-05): the printed --tags {"dagster/partition": ...} was split
    # by the shell into three words.
    config = tmp_path / "run config.yaml"
    config.write_text("ops:\n  raw_instructions:\n    config: {}\n")
    args = argparse.Namespace(run_config=config, dataset=name, dry_run=True)
    rerun.run(args, argparse.ArgumentParser())
    printed = capsys.readouterr().out
    expected = rerun.dagster_command(rerun.read_run_config(config), config.absolute(), name)
    assert shlex.split(printed) == expected
    assert expected[expected.index("--partition") + 1] == name  # one stage: asset materialize


def test_each_commands_help_line_is_a_whole_sentence():
    out = subprocess.run(
        [sys.executable, "-m", "cluster_pipeline.cli.main", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "``" not in out
    assert 'an MLflow run\'s `run_config.yaml`, or the "Repeat it" block of' in " ".join(
        out.split()
    )

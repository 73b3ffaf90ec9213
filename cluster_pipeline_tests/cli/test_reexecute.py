"""``cluster-pipeline reexecute``: which run it finds from an id or its first characters, what
it refuses, and what ``--dry-run`` says; on a Dagster instance of its own with runs of a
one-asset job (no pipeline stage runs here; the re-execution of a killed training run from a
shell, resumed, is test_settings_kept_e2e's step 6)."""

import dagster as dg
import pytest

from cluster_pipeline.cli.main import main

PARTITIONS = dg.StaticPartitionsDefinition(["tiny"])


@dg.asset(partitions_def=PARTITIONS)
def upstream() -> int:
    return 1


@dg.asset(partitions_def=PARTITIONS)
def fails(upstream: int) -> int:
    raise RuntimeError("killed")


@pytest.fixture
def instance(tmp_path, monkeypatch):
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path))
    (tmp_path / "dagster.yaml").write_text("")
    with dg.DagsterInstance.get() as instance:
        yield instance


JOB = dg.Definitions(assets=[upstream, fails], jobs=[dg.define_asset_job("both")]).resolve_job_def(
    "both"
)


def _failed_run(instance, run_id: str | None = None) -> str:
    result = JOB.execute_in_process(
        instance=instance, partition_key="tiny", raise_on_error=False, run_id=run_id
    )
    assert not result.success
    return result.run_id


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    try:
        main(["reexecute", *args])
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    out = capsys.readouterr()
    # stderr's last line: the error (Dagster's own event log lines come before it).
    return code, out.out, (out.err.splitlines() or [""])[-1] + "\n"


def test_a_failed_run_is_found_by_its_first_8_characters_and_its_failed_step_named(
    instance, capsys
):
    run_id = _failed_run(instance)
    code, out, _ = _cli(capsys, run_id[:8], "--dry-run")
    assert code == 0
    assert out == (f"would re-execute run {run_id} (both, dataset partition tiny): steps fails\n")


def test_a_run_that_succeeded_is_not_reexecuted(instance, capsys):
    result = dg.materialize([upstream], instance=instance, partition_key="tiny")
    code, _, err = _cli(capsys, result.run_id)
    assert code == 2
    assert err == (
        f"cluster-pipeline reexecute: error: run {result.run_id} succeeded: only a failed or "
        "canceled run is re-executed from its failure\n"
    )


def test_an_unknown_short_or_ambiguous_id_is_refused_naming_what_to_give(
    instance, capsys, tmp_path
):
    code, _, err = _cli(capsys, "0123abcd")
    assert code == 2
    assert err == (
        f"cluster-pipeline reexecute: error: no run '0123abcd' in the Dagster instance at "
        f"{tmp_path} ($DAGSTER_HOME): the runs page of the web UI, or `dagster run list`, "
        "shows the ids\n"
    )
    code, _, err = _cli(capsys, "abc")
    assert err == (
        "cluster-pipeline reexecute: error: no run 'abc': give at least 4 characters of the "
        "run id\n"
    )
    # Two runs whose ids share their first 8 characters.
    one = _failed_run(instance, "aaaa1111-0000-4000-8000-000000000001")
    _failed_run(instance, "aaaa1111-1111-4000-8000-000000000002")
    code, _, err = _cli(capsys, "aaaa1111")
    assert code == 2
    assert err == (
        "cluster-pipeline reexecute: error: 'aaaa1111' starts 2 run ids "
        "(aaaa1111-1111-4000-8000-000000000002, aaaa1111-0000-4000-8000-000000000001): give "
        "more characters\n"
    )
    code, out, _ = _cli(capsys, "aaaa1111-0", "--dry-run")  # unique once longer
    assert code == 0
    assert out == f"would re-execute run {one} (both, dataset partition tiny): steps fails\n"

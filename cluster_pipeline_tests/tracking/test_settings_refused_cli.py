"""Tracking settings refused at the run's start, from a shell as a user runs it (``dagster
asset materialize``): one error line, no traceback, no step started, nothing tracked (the
fresh-user trial's run went on with a truncated MLflow blurb)."""

import dagster as dg
import pytest

from cluster_pipeline_tests.runs import ROOT, Project

pytestmark = pytest.mark.slow


def _errors(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if " - ERROR - " in line]


def test_bad_tracking_settings_are_refused_before_any_step(tmp_path, tiny_model_dir):
    with Project.create(tmp_path, tiny_model_dir) as project:
        out = project.materialize(
            "peripheral_subsets",
            MLFLOW_TRACKING_URI="not-a-uri",
            CLUSTER_PIPELINE_TRACKING="bogus",
        )
        assert out.returncode == 1
        (line,) = _errors(out.stdout)
        assert line.endswith(
            " - $CLUSTER_PIPELINE_TRACKING = 'bogus': not a value it accepts, so whether to track "
            "is unknown. Set it to one of on, 1, true, yes (track) or off, 0, false, no (track "
            "nothing), or unset it (track).; The MLflow tracking URI 'not-a-uri' (from the "
            "environment variable MLFLOW_TRACKING_URI) is not a URI: MLflow would take it as a "
            f"local folder path, its file store in {ROOT / 'not-a-uri'}, which MLflow 3.17 "
            "refuses unless MLFLOW_ALLOW_FILE_STORE=true is set. Give a URI in "
            "$MLFLOW_TRACKING_URI: http://host:5000 for a server, "
            "sqlite:////absolute/path/mlflow.db for a database, or leave it empty for the data "
            "folder's own store."
        ), line
        assert "Traceback" not in out.stdout
        with project.instance() as instance:
            assert not instance.all_logs(
                instance.get_runs()[0].run_id, of_type=dg.DagsterEventType.STEP_START
            )
        assert not (project.data / "mlflow").exists()

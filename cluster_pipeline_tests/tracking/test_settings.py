"""The tracking settings checked before any MLflow call (tracking/settings.py): each bad setting
of the fresh-user trial (defect 8) and its kind, with the exact words a user reads: refused at
the run's start (run_checks.tracking_problems) or one warning and the run goes on untracked
(TrackingResource.tracker)."""

import logging

import pytest

from cluster_pipeline.defs.resources import TrackingResource
from cluster_pipeline.defs.run_checks import tracking_problems
from cluster_pipeline.storage.layout import DataLayout
from cluster_pipeline.tracking.settings import (
    SCHEMES,
    UriSource,
    settings_problems,
    store_notice,
    switch_value,
    uri_source,
)
from cluster_pipeline.tracking.tracker import whole_sentences

ON = {"CLUSTER_PIPELINE_TRACKING": "on"}
CONFIG_SOURCE = "from the tracking resource's config: resources: tracking: config: tracking_uri"
ENV_SOURCE = "from the environment variable MLFLOW_TRACKING_URI"
FIX = (
    "http://host:5000 for a server, sqlite:////absolute/path/mlflow.db for a database, or "
    "leave it empty for the data folder's own store."
)


def _tracking_config(**config) -> dict:
    return {"resources": {"tracking": {"config": config}}}


@pytest.fixture
def tracking_env(monkeypatch, tmp_path):
    """Tracking on, no URI in the environment, the working folder tmp_path."""
    monkeypatch.setenv("CLUSTER_PIPELINE_TRACKING", "on")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.chdir(tmp_path)
    return monkeypatch


# --- refused at the run's start -----------------------------------------------------------


def test_a_uri_that_is_not_a_uri_from_the_environment_is_refused(tracking_env, tmp_path):
    tracking_env.setenv("MLFLOW_TRACKING_URI", "not-a-uri")
    (problem,) = tracking_problems({}, ["peripheral_subsets"])
    assert problem == (
        f"The MLflow tracking URI 'not-a-uri' ({ENV_SOURCE}) is not a URI: MLflow would take "
        f"it as a local folder path, its file store in {tmp_path / 'not-a-uri'}, which MLflow "
        "3.17 refuses unless MLFLOW_ALLOW_FILE_STORE=true is set. Give a URI in "
        f"$MLFLOW_TRACKING_URI: {FIX}"
    )


def test_a_uri_that_is_not_a_uri_from_the_resource_config_is_refused(tracking_env):
    (problem,) = tracking_problems(_tracking_config(tracking_uri="not-a-uri"), ["eval_report"])
    assert problem.startswith(
        f"The MLflow tracking URI 'not-a-uri' ({CONFIG_SOURCE}) is not a URI: MLflow would "
        "take it as a local folder path"
    )
    assert problem.endswith(f"Give a URI in the tracking resource's tracking_uri: {FIX}")


def test_the_resource_config_wins_over_the_environment(tracking_env, tmp_path):
    tracking_env.setenv("MLFLOW_TRACKING_URI", "not-a-uri")
    given = f"sqlite:///{tmp_path}/runs.db"
    assert uri_source(given) == UriSource(given, "config")
    assert tracking_problems(_tracking_config(tracking_uri=given), ["trained_checkpoint"]) == []


def test_an_unsupported_scheme_is_refused(tracking_env):
    (problem,) = tracking_problems(_tracking_config(tracking_uri="ftp://x"), ["eval_report"])
    assert problem == (
        f"The MLflow tracking URI 'ftp://x' ({CONFIG_SOURCE}) has the scheme 'ftp', which "
        "MLflow cannot track to (it tracks to http, https, sqlite, postgresql, mysql, mssql, "
        f"databricks). Give a URI in the tracking resource's tracking_uri: {FIX}"
    )


def test_an_http_uri_without_a_host_is_refused(tracking_env):
    tracking_env.setenv("MLFLOW_TRACKING_URI", "http://")
    (problem,) = tracking_problems({}, ["peripheral_subsets"])
    assert problem.startswith(f"The MLflow tracking URI 'http://' ({ENV_SOURCE}) names no host.")


def test_a_file_uri_is_refused_unless_mlflow_allows_its_file_store(tracking_env, tmp_path):
    uri = (tmp_path / "mlruns").as_uri()
    tracking_env.setenv("MLFLOW_TRACKING_URI", uri)
    (problem,) = tracking_problems({}, ["trained_checkpoint"])
    assert problem == (
        f"The MLflow tracking URI {uri!r} ({ENV_SOURCE}) names MLflow's file store, which "
        "MLflow 3.17 refuses unless MLFLOW_ALLOW_FILE_STORE=true is set. Give a URI in "
        f"$MLFLOW_TRACKING_URI: {FIX}"
    )
    tracking_env.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    assert tracking_problems({}, ["trained_checkpoint"]) == []


def test_an_empty_experiment_name_is_refused_naming_the_knob(tracking_env):
    for name in ("", "  "):
        (problem,) = tracking_problems(_tracking_config(experiment_name=name), ["eval_report"])
        assert problem == (
            f"resources.tracking.experiment_name = {name!r}: an MLflow experiment needs a "
            "name. Give one (default 'cluster_pipeline'), or leave the knob out."
        )
        assert "URI" not in problem


def test_an_unknown_tracking_switch_is_refused_listing_the_accepted_values(tracking_env):
    tracking_env.setenv("CLUSTER_PIPELINE_TRACKING", "bogus")
    expected = (
        "$CLUSTER_PIPELINE_TRACKING = 'bogus': not a value it accepts, so whether to track is "
        "unknown. Set it to one of on, 1, true, yes (track) or off, 0, false, no (track "
        "nothing), or unset it (track)."
    )
    assert tracking_problems({}, ["peripheral_subsets"]) == [expected]
    # Given in the run config, enabled does not read the variable: nothing to refuse.
    assert tracking_problems(_tracking_config(enabled=False), ["peripheral_subsets"]) == []
    assert tracking_problems(_tracking_config(enabled=True), ["peripheral_subsets"]) == []


@pytest.mark.parametrize(
    ("value", "on"),
    [
        (None, True),
        ("", True),
        ("on", True),
        (" TRUE ", True),
        ("1", True),
        ("yes", True),
        ("off", False),
        ("0", False),
        ("False", False),
        ("no", False),
        ("bogus", None),
        ("enabled", None),
    ],
)
def test_the_tracking_switch_values(value, on):
    env = {} if value is None else {"CLUSTER_PIPELINE_TRACKING": value}
    assert switch_value(env) is on


def test_a_bogus_switch_does_not_silently_mean_on_in_a_step(tracking_env, tmp_path):
    """A step reached without the project's executor (dagster.materialize) warns once and
    tracks nothing: the refusal belongs to the run's start, a step never fails for tracking."""
    tracking_env.setenv("CLUSTER_PIPELINE_TRACKING", "bogus")
    warnings: list[str] = []
    tracker = TrackingResource().tracker(DataLayout.at(tmp_path / "data"), warnings.append)
    assert not tracker.enabled
    assert warnings == [
        "MLflow tracking is off for this step: its settings are refused. "
        "$CLUSTER_PIPELINE_TRACKING = 'bogus': not a value it accepts, so whether to track is "
        "unknown. Set it to one of on, 1, true, yes (track) or off, 0, false, no (track "
        "nothing), or unset it (track)."
    ]
    assert not (tmp_path / "data" / "mlflow").exists()


def test_a_run_without_a_tracked_stage_or_with_tracking_off_is_not_refused(tracking_env):
    tracking_env.setenv("MLFLOW_TRACKING_URI", "not-a-uri")
    assert tracking_problems({}, ["raw_instructions", "proxy_embeddings"]) == []
    assert tracking_problems(_tracking_config(enabled=False), ["eval_report"]) == []
    tracking_env.setenv("CLUSTER_PIPELINE_TRACKING", "off")
    assert tracking_problems({}, ["eval_report"]) == []


@pytest.mark.parametrize(
    "uri",
    [
        "",
        "http://127.0.0.1:5000",
        "https://mlflow.example.org",
        "sqlite:////tmp/mlflow.db",
        "postgresql+psycopg2://u@h/db",
        "mysql://u@h/db",
        "databricks",
        "databricks://profile",
    ],
)
def test_uris_mlflow_tracks_to_are_accepted(uri):
    source = uri_source(uri, env={})
    assert settings_problems(True, source, "cluster_pipeline", env=ON) == []


def test_the_schemes_are_mlflows():
    """SCHEMES are the tracking stores MLflow registers, less its file store (a rule of its
    own) and Unity Catalog (a model registry, not a tracking store)."""
    from mlflow.tracking._tracking_service.utils import _tracking_store_registry

    registered = set(_tracking_store_registry._registry)
    assert registered - {"", "file", "databricks-uc", "uc"} == set(SCHEMES)


# --- one warning, the run goes on ---------------------------------------------------------


def test_a_sqlite_folder_that_does_not_exist_warns_and_tracks_nothing(tracking_env, tmp_path):
    tracking_env.setenv("MLFLOW_TRACKING_URI", "sqlite:///nofolder/runs.db")
    assert tracking_problems({}, ["peripheral_subsets"]) == []
    warnings: list[str] = []
    tracker = TrackingResource().tracker(DataLayout.at(tmp_path / "data"), warnings.append)
    assert not tracker.enabled
    assert tracker.start_run("r", tags={}) is None
    assert warnings == [
        f"MLflow tracking is off for this step: the folder {tmp_path / 'nofolder'} of the "
        f"SQLite database in the tracking URI 'sqlite:///nofolder/runs.db' ({ENV_SOURCE}) "
        "does not exist. The run goes on untracked. Create that folder, or fix "
        "$MLFLOW_TRACKING_URI. sqlite:/// followed by a relative path is relative to the "
        f"working folder {tmp_path}; an absolute path takes four slashes: "
        f"sqlite:///{tmp_path / 'nofolder' / 'runs.db'}."
    ]
    assert not (tmp_path / "nofolder").exists()  # not made behind the user's back


def test_an_absolute_sqlite_folder_that_does_not_exist_has_no_slash_hint(tracking_env, tmp_path):
    uri = f"sqlite:///{tmp_path}/missing/runs.db"
    notice, usable = store_notice(UriSource(uri, "config"), env={})
    assert not usable
    assert notice == (
        f"MLflow tracking is off for this step: the folder {tmp_path / 'missing'} of the "
        f"SQLite database in the tracking URI {uri!r} ({CONFIG_SOURCE}) does not exist. The "
        "run goes on untracked. Create that folder, or fix the tracking resource's "
        "tracking_uri."
    )


def test_a_relative_sqlite_path_is_made_absolute_for_rank_zero(tracking_env, tmp_path):
    (tmp_path / "runs").mkdir()
    tracking_env.setenv("MLFLOW_TRACKING_URI", "sqlite:///runs/mlflow.db")
    tracker = TrackingResource().tracker(DataLayout.at(tmp_path / "data"), lambda m: None)
    assert tracker.enabled and tracker.uri == f"sqlite:///{tmp_path}/runs/mlflow.db"
    assert tracker.artifact_location == (tmp_path / "runs" / "artifacts").as_uri()


def test_the_file_store_when_mlflow_allows_it_is_used_with_one_sentence(tracking_env, tmp_path):
    uri = (tmp_path / "mlruns").as_uri()
    tracking_env.setenv("MLFLOW_TRACKING_URI", uri)
    tracking_env.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    warnings: list[str] = []
    tracker = TrackingResource().tracker(DataLayout.at(tmp_path / "data"), warnings.append)
    assert warnings == [
        f"MLflow tracking goes to MLflow's file store {uri!r} ({ENV_SOURCE}), accepted because "
        "MLFLOW_ALLOW_FILE_STORE=true, though MLflow 3.17 keeps that store in maintenance mode "
        "and suggests a database such as sqlite:////absolute/path/mlflow.db."
    ]
    run_id = tracker.start_run("r", tags={})
    assert run_id is not None and tracker.enabled and len(warnings) == 1
    tracker.end_run(run_id)
    assert (tmp_path / "mlruns").is_dir()


def test_the_data_folders_own_store_is_created_without_a_word(tracking_env, tmp_path, caplog):
    layout = DataLayout.at(tmp_path / "data")
    with caplog.at_level(logging.WARNING):
        tracker = TrackingResource().tracker(layout)
    assert tracker.enabled and caplog.records == []
    assert tracker.uri == f"sqlite:///{layout.mlflow_dir / 'mlflow.db'}"


# --- whole sentences -----------------------------------------------------------------------


def test_an_errors_reason_is_cut_after_a_whole_sentence():
    blurb = (
        "The filesystem tracking backend (e.g., './mlruns') is in maintenance mode and will "
        "not receive further updates. Please migrate to a database backend (e.g., "
        "'sqlite:///mlflow.db') to access the latest MLflow features. The `mlflow "
        "migrate-filestore` tool migrates your existing data losslessly. See "
        "https://mlflow.org/docs for migration guidance. If the filesystem backend is required "
        "for your workflow, set `MLFLOW_ALLOW_FILE_STORE=true` to opt out of this exception."
    )
    kept = whole_sentences(blurb)
    assert kept == (
        "The filesystem tracking backend (e.g., './mlruns') is in maintenance mode and will "
        "not receive further updates. Please migrate to a database backend (e.g., "
        "'sqlite:///mlflow.db') to access the latest MLflow features. The `mlflow "
        "migrate-filestore` tool migrates your existing data losslessly. See "
        "https://mlflow.org/docs for migration guidance."
    )
    assert len(kept) <= 400
    long_one = "word " * 200 + "end."
    assert whole_sentences(long_one) == long_one.strip()  # one sentence: whole, even if long
    assert whole_sentences("first line.\nsecond line.") == "first line."


def test_a_failed_call_warns_in_whole_sentences(tmp_path):
    """A store that fails at its first call (a file where the database's folder should be):
    the warning's every sentence ends, and it still names the URI and what to do."""
    from cluster_pipeline.tracking.tracker import Tracker

    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    warnings: list[str] = []
    tracker = Tracker(f"sqlite:///{blocker}/mlflow/mlflow.db", warn=warnings.append)
    assert tracker.start_run("r", tags={}) is None
    (message,) = warnings
    assert message.startswith(
        f"MLflow tracking is off for the rest of this process: opening run 'r' of experiment "
        f"'cluster_pipeline' at sqlite:///{blocker}/mlflow/mlflow.db failed. "
    )
    assert message.endswith(
        "The run goes on untracked. To track, start that server or fix the URI (the tracking "
        "resource's tracking_uri, else $MLFLOW_TRACKING_URI; empty = the data folder's own "
        "store), or set the tracking resource's enabled: false to track nothing."
    )
    reason = message.split(" failed. ", 1)[1].split(" The run goes on untracked.")[0]
    assert reason.endswith((".", "!", "?")), reason

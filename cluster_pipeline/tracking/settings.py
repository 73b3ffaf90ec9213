"""The tracking settings checked before any MLflow call (docs/guide/tracking.md, "Settings").

::

    source = uri_source(config_uri)                  # the resource's tracking_uri, else the env
    problems = settings_problems(switch, source, experiment)   # refusals at the run's start
    notice = store_notice(resolve_uri(source.uri))   # a warning; tracking off when it says so

Two kinds of finding:

- **Refusals** (:func:`settings_problems`): a setting that cannot mean anything the pipeline
  could track to: ``$CLUSTER_PIPELINE_TRACKING`` other than one of :data:`ON_VALUES` /
  :data:`OFF_VALUES`; an empty ``experiment_name``; a tracking URI that is not a URI (MLflow
  would take ``not-a-uri`` as the folder ``./not-a-uri`` of its file store), whose scheme MLflow
  does not track to (``ftp://x``), an ``http(s)`` URI without a host, or a ``file:`` URI
  (MLflow 3.17 refuses its file store unless ``MLFLOW_ALLOW_FILE_STORE=true``). The run checks
  (``defs/run_checks.py``) refuse the run before its first step.
- **Notices** (:func:`store_notice`): the store can be named but not opened as it is, like a
  server that is down: a ``sqlite:///`` database whose folder does not exist (tracking off for
  the step, the run goes on), or MLflow's file store accepted under
  ``MLFLOW_ALLOW_FILE_STORE=true`` (tracked, with one sentence saying MLflow keeps that store in
  maintenance mode).

Every message is whole sentences that name the setting, where its value came from (the
tracking resource's config or ``$MLFLOW_TRACKING_URI``) and what to do. Dagster-free; no MLflow
import (the checks run for every run, importing MLflow takes seconds).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
TRACKING_ENV = "CLUSTER_PIPELINE_TRACKING"
ALLOW_FILE_STORE_ENV = "MLFLOW_ALLOW_FILE_STORE"
ON_VALUES = ("on", "1", "true", "yes")
OFF_VALUES = ("off", "0", "false", "no")

# The schemes of MLflow 3.17's tracking stores (mlflow.tracking._tracking_service.utils
# ._tracking_store_registry; a test keeps the two alike), less "" and "file": the file store,
# which has a rule of its own, and Unity Catalog's "databricks-uc" and "uc" (a model registry,
# not a tracking store). A database scheme may name its driver: postgresql+psycopg2.
SCHEMES = ("http", "https", "sqlite", "postgresql", "mysql", "mssql", "databricks")
# The scheme and slashes before a SQLite database path (three: relative, four: absolute).
SQLITE_PREFIX = "sqlite:///"
_LOCAL_EXAMPLE = "sqlite:////absolute/path/mlflow.db"


@dataclass(frozen=True)
class UriSource:
    """A tracking URI and where it came from: ``config`` (the tracking resource's
    ``tracking_uri``), ``env`` (``$MLFLOW_TRACKING_URI``) or ``default`` (neither: the data
    folder's own store)."""

    uri: str
    origin: str

    def describe(self) -> str:
        """Where the value came from, in words."""
        if self.origin == "config":
            return "from the tracking resource's config: resources: tracking: config: tracking_uri"
        if self.origin == "env":
            return f"from the environment variable {TRACKING_URI_ENV}"
        return "the data folder's own store"

    def setting(self) -> str:
        """The setting to change, in words."""
        if self.origin == "env":
            return f"${TRACKING_URI_ENV}"
        return "the tracking resource's tracking_uri"


def uri_source(config_uri: str, env: Mapping[str, str] | None = None) -> UriSource:
    """The tracking URI in force: the resource's ``config_uri`` if given, else
    ``$MLFLOW_TRACKING_URI`` (of ``env``, default ``os.environ``), else empty (``default``)."""
    env = os.environ if env is None else env
    if config_uri:
        return UriSource(config_uri, "config")
    if env.get(TRACKING_URI_ENV, ""):
        return UriSource(env[TRACKING_URI_ENV], "env")
    return UriSource("", "default")


def switch_value(env: Mapping[str, str] | None = None) -> bool | None:
    """``$CLUSTER_PIPELINE_TRACKING``: True when unset, empty or one of :data:`ON_VALUES`,
    False for one of :data:`OFF_VALUES` (case and spaces ignored), None for anything else."""
    env = os.environ if env is None else env
    value = env.get(TRACKING_ENV, "").strip().lower()
    if value in ("", *ON_VALUES):
        return True
    return False if value in OFF_VALUES else None


def switch_problem(env: Mapping[str, str] | None = None) -> str | None:
    """Why ``$CLUSTER_PIPELINE_TRACKING`` is refused (None: it is unset or accepted)."""
    env = os.environ if env is None else env
    if switch_value(env) is not None:
        return None
    return (
        f"${TRACKING_ENV} = {env[TRACKING_ENV]!r}: not a value it accepts, so whether to "
        f"track is unknown. Set it to one of {', '.join(ON_VALUES)} (track) or "
        f"{', '.join(OFF_VALUES)} (track nothing), or unset it (track)."
    )


def experiment_problem(name: str) -> str | None:
    """Why the experiment name is refused (None: accepted)."""
    if name.strip():
        return None
    return (
        f"resources.tracking.experiment_name = {name!r}: an MLflow experiment needs a name. "
        "Give one (default 'cluster_pipeline'), or leave the knob out."
    )


def uri_problem(source: UriSource, env: Mapping[str, str] | None = None) -> str | None:
    """Why the tracking URI of ``source`` is refused (None: accepted; the default store
    always is). Module docstring, "Refusals"."""
    env = os.environ if env is None else env
    uri = source.uri
    if source.origin == "default":
        return None
    head = f"The MLflow tracking URI {uri!r} ({source.describe()})"
    fix = (
        f"Give a URI in {source.setting()}: http://host:5000 for a server, {_LOCAL_EXAMPLE} "
        f"for a database, or leave it empty for the data folder's own store."
    )
    if uri.strip().lower() == "databricks":  # MLflow's one URI without "://"
        return None
    scheme = urlsplit(uri).scheme.lower() if "://" in uri or uri.startswith("file:") else ""
    if not scheme:
        return (
            f"{head} is not a URI: MLflow would take it as a local folder path, its file "
            f"store in {Path(uri).absolute()}, which MLflow 3.17 refuses unless "
            f"{ALLOW_FILE_STORE_ENV}=true is set. {fix}"
        )
    if scheme == "file":
        if file_store_allowed(env):
            return None
        return (
            f"{head} names MLflow's file store, which MLflow 3.17 refuses unless "
            f"{ALLOW_FILE_STORE_ENV}=true is set. {fix}"
        )
    if scheme.split("+")[0] not in SCHEMES:
        return (
            f"{head} has the scheme {scheme!r}, which MLflow cannot track to (it tracks to "
            f"{', '.join(SCHEMES)}). {fix}"
        )
    if scheme in ("http", "https") and not urlsplit(uri).hostname:
        return f"{head} names no host. {fix}"
    return None


def file_store_allowed(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``$MLFLOW_ALLOW_FILE_STORE`` lets MLflow open its file store (as MLflow reads
    it: ``true`` or ``1``)."""
    env = os.environ if env is None else env
    return env.get(ALLOW_FILE_STORE_ENV, "").strip().lower() in ("true", "1")


def settings_problems(
    enabled: bool,
    source: UriSource,
    experiment: str,
    env: Mapping[str, str] | None = None,
    check_switch: bool = True,
) -> list[str]:
    """Every refusal of the tracking settings (module docstring), one message each.

    Args:
        enabled: the tracking resource's ``enabled`` (its default reads
            ``$CLUSTER_PIPELINE_TRACKING``; an unknown value defaults to on).
        source: the tracking URI in force (:func:`uri_source`).
        experiment: the resource's ``experiment_name``.
        env: the environment (default ``os.environ``).
        check_switch: whether ``$CLUSTER_PIPELINE_TRACKING`` counts (False when the run
            config gives ``enabled`` itself, which the variable only defaults).

    Returns:
        The refusals; empty when there are none, and (but for the switch) when tracking is off.
    """
    problems = [p for p in [switch_problem(env) if check_switch else None] if p]
    if enabled:
        problems += [p for p in (experiment_problem(experiment), uri_problem(source, env)) if p]
    return problems


def sqlite_database(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI, absolute (a relative path is relative to the
    working folder, as SQLAlchemy reads it); None for other URIs or an in-memory database."""
    if not uri.startswith(SQLITE_PREFIX):
        return None
    path = uri.removeprefix(SQLITE_PREFIX).split("?")[0]
    return Path(path).absolute() if path and path != ":memory:" else None


def store_notice(source: UriSource, env: Mapping[str, str] | None = None) -> tuple[str, bool]:
    """The one warning a store that passes :func:`uri_problem` still needs (module docstring,
    "Notices"), and whether tracking can go on.

    Returns:
        (the warning, empty when none; False when tracking must be off for the step).
    """
    env = os.environ if env is None else env
    database = sqlite_database(source.uri)
    if source.origin != "default" and database is not None and not database.parent.is_dir():
        relative = not source.uri.removeprefix(SQLITE_PREFIX).startswith("/")
        hint = (
            f" sqlite:/// followed by a relative path is relative to the working folder "
            f"{Path.cwd()}; an absolute path takes four slashes: sqlite:///{database}."
            if relative
            else ""
        )
        return (
            f"MLflow tracking is off for this step: the folder {database.parent} of the SQLite "
            f"database in the tracking URI {source.uri!r} ({source.describe()}) does not "
            f"exist. The run goes on untracked. Create that folder, or fix "
            f"{source.setting()}.{hint}",
            False,
        )
    if urlsplit(source.uri).scheme.lower() == "file" and file_store_allowed(env):
        return (
            f"MLflow tracking goes to MLflow's file store {source.uri!r} ({source.describe()}), "
            f"accepted because {ALLOW_FILE_STORE_ENV}=true, though MLflow 3.17 keeps that store "
            f"in maintenance mode and suggests a database such as {_LOCAL_EXAMPLE}.",
            True,
        )
    return "", True

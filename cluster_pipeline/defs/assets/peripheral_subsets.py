"""Stage 3: balanced down-sampling, keeping the peripheral samples of every cluster."""

import time

import dagster as dg
import numpy as np
import polars as pl
from pydantic import Field

from cluster_pipeline.defs.metadata import table_display
from cluster_pipeline.defs.records import (
    BalancedClustersRecord,
    PeripheralSubsetsRecord,
    read_record,
)
from cluster_pipeline.defs.resources import (
    StorageResource,
    TorchrunResource,
    TrackingResource,
    run_tags,
)
from cluster_pipeline.defs.selection_inputs import GatheredInputs, gather_inputs
from cluster_pipeline.defs.stages import stage_asset
from cluster_pipeline.evaluation import plots
from cluster_pipeline.evaluation.statistics import subset_and_pool_diversity
from cluster_pipeline.selection.embedding_table import REPRESENTATIONS, l2_normalise
from cluster_pipeline.selection.selectors import (
    Balance,
    SelectionParams,
    SelectionResult,
    Selector,
    describe,
    needs_targets,
    per_cluster_summary,
    run_selector,
    trains_a_proxy,
    warms_up_lora,
)
from cluster_pipeline.selection.selectors.base import PASS_EMBEDDING, S2L_CLUSTERS, round_mib
from cluster_pipeline.storage.names import BALANCED_CLUSTERS, PERIPHERAL_SUBSETS, PROXY_EMBEDDINGS
from cluster_pipeline.storage.tables import TableRef, markdown_preview, write_table
from cluster_pipeline.tracking.tracker import TAG_SELECTOR, Tracker
from cluster_pipeline.training.proxy import LessWarmup, ProxyRun

# The s2l knobs and the less knobs (refused for the other selectors: defs/run_checks.py);
# TARGET_KNOBS, the targeted selectors' (rds, less), are run_checks' own.
S2L_KNOBS = ("s2l_steps", "s2l_checkpoints", "s2l_clusters", "s2l_learning_rate")
LESS_KNOBS = (
    "less_warmup_fraction",
    "less_warmup_steps",
    "less_checkpoints",
    "less_lora_r",
    "less_learning_rate",
    "less_projection_dim",
)


class PeripheralSubsetsConfig(dg.Config):
    """The selection knobs of a run: selector, ratio r, balance and seed; a targeted selector's
    target set (rds, less), s2l's proxy run and trajectory clusters, and less's warm-up and
    projection."""

    selector: Selector = Field(default="peripheral", description=describe())
    ratio: float = Field(
        default=0.5,
        gt=0.0,
        le=1.0,
        description="Selection ratio r: every "
        "cluster keeps floor(r * m) samples, m = smallest cluster size.",
    )
    seed: int = Field(default=0, ge=0, description="Seed of the random selectors.")
    balance: Balance = Field(
        default="tokens",
        description="tokens = every cluster keeps its selector's samples up to the same token "
        "budget, floor(r x the smallest cluster's tokens), so every rank does the same work; "
        "rank c's weight is K R_c / R (R_c the cluster's response tokens). samples = the "
        "published rule: floor(r x the smallest cluster's size) samples each, w_c = n_c K / N.",
    )
    target: str | None = Field(
        default=None,
        description="rds and less only: the target set to select towards: a benchmark of "
        "evaluation/suites.py (humaneval, mbpp, mmlu, mmlu_medical; its prompts with reference "
        "solutions, read from data/eval/ like eval_report's) or the absolute path of a folder "
        "of samples in any input form.",
    )
    target_size: int = Field(
        default=64,
        ge=1,
        description="rds and less only: at most this many target samples (a benchmark's first "
        "N items, a folder's first N distinct samples).",
    )
    s2l_steps: int = Field(
        default=8,
        ge=1,
        description="s2l only: optimizer steps of the proxy run (the base model trained on the "
        "whole clustered pool, under torchrun with proxy_embeddings' world size, the project's "
        "training batch sizes); a multiple of s2l_checkpoints. Sized for a CPU: the paper "
        "trains its proxy for 3 epochs.",
    )
    s2l_checkpoints: int = Field(
        default=4,
        ge=2,
        description="s2l only: T, the proxy checkpoints (every s2l_steps / T steps) whose "
        "per-sample losses make each sample's loss trajectory; one loss pass over the pool "
        "each.",
    )
    s2l_clusters: int = Field(
        default=S2L_CLUSTERS,
        ge=1,
        description="s2l only: k-means clusters of the loss trajectories (the paper's 100), at "
        "most the pool size; the budget is drawn evenly across them, small ones whole.",
    )
    s2l_learning_rate: float = Field(
        default=1e-4,
        gt=0.0,
        description="s2l only: peak AdamW learning rate of the proxy run (the project's "
        "training default; the paper's 2e-5 moves a short run's losses little).",
    )

    less_warmup_fraction: float = Field(
        default=0.05,
        gt=0.0,
        le=1.0,
        description="less only: the seeded random share of the clustered pool its LoRA warm-up "
        "trains on (the paper's 5 %), at least one sample per rank of proxy_embeddings' world "
        "size.",
    )
    less_warmup_steps: int = Field(
        default=8,
        ge=1,
        description="less only: optimizer steps of the LoRA warm-up (under torchrun with "
        "proxy_embeddings' world size, the project's training batch sizes); a multiple of "
        "less_checkpoints. Sized for a CPU: the paper warms up for 4 epochs.",
    )
    less_checkpoints: int = Field(
        default=4,
        ge=1,
        description="less only: C, the warm-up checkpoints (every less_warmup_steps / C steps, "
        "the paper's 4) at which the pool's and the targets' per-sample gradients are taken: "
        "one forward and one backward pass per sample each.",
    )
    less_lora_r: int = Field(
        default=8,
        ge=1,
        description="less only: LoRA rank of the warm-up (peft's default target modules); the "
        "gradients have the adapters' size. The paper's 128 makes them 16x longer.",
    )
    less_learning_rate: float = Field(
        default=1e-4,
        gt=0.0,
        description="less only: peak AdamW learning rate of the warm-up (the paper's 2e-5 at "
        "rank 128 moves a short run's adapters little).",
    )
    less_projection_dim: int = Field(
        default=8192,
        ge=1024,
        description="less only: d, the dimension of the gradients' seeded Rademacher random "
        "projection (the paper's 8192; a cosine's error is of order 1 / sqrt(d)).",
    )

    def less_warmup(self) -> LessWarmup | None:
        """The warm-up and projection of less (None for the other selectors)."""
        if not warms_up_lora(self.selector):
            return None
        return LessWarmup(
            self.less_warmup_fraction,
            ProxyRun(self.less_warmup_steps, self.less_checkpoints, self.less_learning_rate),
            self.less_lora_r,
            self.less_projection_dim,
        )

    def proxy_run(self) -> ProxyRun | None:
        """s2l's proxy run (None for the other selectors)."""
        if not trains_a_proxy(self.selector):
            return None
        return ProxyRun(self.s2l_steps, self.s2l_checkpoints, self.s2l_learning_rate)


# proxy_embeddings: the PCA map of the selected samples reads the embeddings that were clustered.
@stage_asset("selection", deps=[BALANCED_CLUSTERS, PROXY_EMBEDDINGS], kinds={"polars", "deltalake"})
def peripheral_subsets(
    context: dg.AssetExecutionContext,
    config: PeripheralSubsetsConfig,
    storage: StorageResource,
    torchrun: TorchrunResource,
    pipes_subprocess_client: dg.PipesSubprocessClient,
    tracking: TrackingResource,
) -> dg.MaterializeResult:
    """One row per clustered sample: ``selection_rank`` (0 = first chosen within its cluster by
    a cluster selector, in the whole pool by the others), ``selected``, ``copies`` (times
    trained per epoch; > 1 only for uniform oversampling), ``weight`` w_c of its cluster
    (n_c K / N under sample balance, K R_c / R by response tokens under token balance; 1 for
    selectors without re-weighting) and ``score``, what the selector ranks by
    (null for the random orders). The metadata holds the selector's cost: its seconds and the
    forward/backward passes of the model passes it needed. docs/design.md, steps 3 and 5.
    Tracked as an MLflow run (the tracking resource): the knobs as params, the cost and the
    subset's figures as metrics, the PCA map as an artifact.
    """
    dataset = context.partition_key
    start = time.perf_counter()
    clusters = read_record(context, BalancedClustersRecord)
    embeddings = clusters.inputs[PROXY_EMBEDDINGS]
    frame = clusters.table.read(["sample_id", "cluster", "sq_distance"]).join(
        embeddings.read(["sample_id", "n_tokens", "n_response_tokens"]),
        on="sample_id",
        how="left",
        maintain_order="left",
    )
    if trains_a_proxy(config.selector) and config.s2l_clusters > frame.height:
        raise dg.Failure(
            description=f"{dataset}: peripheral_subsets.s2l_clusters = {config.s2l_clusters}: "
            f"more trajectory clusters than the {frame.height} clustered samples; lower it"
        )
    tracker = tracking.tracker(storage.layout, context.log.warning)
    run_id = tracker.start_run(
        f"{dataset} {config.selector} r={config.ratio} seed={config.seed} selection",
        run_tags(context, **{TAG_SELECTOR: config.selector}),
        {
            **tracked_knobs(config),
            "K": clusters.num_clusters,
            "alpha": clusters.alpha,
            "representation": clusters.representation,
        },
    )
    tracker.log_bytes(run_id, run_config_yaml(config), RUN_CONFIG_ARTIFACT)
    with tracker.ending(run_id):
        gathered = gather_inputs(
            context,
            config.selector,
            config.target,
            config.target_size,
            storage,
            torchrun,
            pipes_subprocess_client,
            clusters,
            frame,
            config.proxy_run(),
            config.less_warmup(),
        )
        params = SelectionParams(config.ratio, config.seed, config.balance, config.s2l_clusters)
        try:
            result = run_selector(config.selector, gathered.inputs, params)
        except ValueError as e:
            raise dg.Failure(description=f"{dataset}: {e}") from e
        assert result.score is not None  # run_selector records it
        frame = frame.with_columns(
            pl.Series("selection_rank", result.selection_rank),
            pl.Series("selected", result.selected),
            pl.Series("copies", result.copies),
            pl.Series("weight", result.weight),
            pl.Series("score", result.score, dtype=pl.Float64).fill_nan(None),
        )
        table = write_table(
            frame,
            storage.layout.table_uri(PERIPHERAL_SUBSETS, dataset),
            guard=storage.guard,
            inputs={**clusters.lineage(), **gathered.tables},
        )
        # The selection's cost, not the tracking's (opening the MLflow run takes seconds).
        seconds = time.perf_counter() - start - tracker.seconds
        # Gradient diversity of the subset as trained and of the pool, streamed from the embeddings.
        diversity = subset_and_pool_diversity(
            embeddings.vector_batches("embedding", keep="skip_reason"),
            frame.select("sample_id", "copies"),
        )
        summary = per_cluster_summary(frame)
        record = _record(config, result, clusters, gathered, table, seconds, summary, diversity)
        context.log.info(_log_line(record))
        map_png = _selection_map(
            frame,
            embeddings,
            clusters.representation,
            result.selected,
            f"{config.selector} r={config.ratio}: selected samples ringed",
        )
        _track(tracker, run_id, record, map_png)
    return dg.MaterializeResult(
        metadata={
            **record.to_metadata(),
            **table_display(frame.filter(pl.col("selected")), PERIPHERAL_SUBSETS),
            "dagster/row_count": frame.height,
            "per_cluster_table": dg.MetadataValue.md(markdown_preview(summary, max_rows=64)),
            "pca_map_selected": dg.MetadataValue.md(plots.markdown_image(map_png, "selected")),
            **({"mlflow_run_id": run_id} if run_id else {}),
        }
    )


RUN_CONFIG_ARTIFACT = "run_config.yaml"


def tracked_knobs(config: PeripheralSubsetsConfig) -> dict[str, object]:
    """The knobs of ``config`` that its selector reads, as the MLflow run's params: the s2l
    knobs for s2l only, the less knobs for less only, ``target``/``target_size`` for the
    targeted selectors only (the others' values are defaults nobody chose, and would make
    runs of one selector look different by knobs it ignores). The whole config is the run's
    ``run_config.yaml`` artifact (:func:`run_config_yaml`)."""
    from cluster_pipeline.defs.run_checks import TARGET_KNOBS

    ignored = {
        *(() if trains_a_proxy(config.selector) else S2L_KNOBS),
        *(() if warms_up_lora(config.selector) else LESS_KNOBS),
        *(() if needs_targets(config.selector) else TARGET_KNOBS),
    }
    return {k: v for k, v in config.model_dump().items() if k not in ignored}


def run_config_yaml(config: PeripheralSubsetsConfig) -> str:
    """Every knob of ``config``, those its selector ignores too, as the YAML of a Dagster run
    config (``ops: peripheral_subsets: config: ...``): the selection's MLflow run keeps it as
    an artifact, so nothing the params leave out is lost and the run can be repeated."""
    import yaml

    run_config = {"ops": {"peripheral_subsets": {"config": config.model_dump(mode="json")}}}
    return yaml.safe_dump(run_config, sort_keys=False)


def _track(
    tracker: Tracker, run_id: str | None, record: PeripheralSubsetsRecord, map_png: bytes
) -> None:
    """Into the selection's MLflow run: its cost (seconds, model passes, peak memory per rank)
    and the subset's figures (size, data fraction, gradient diversity), and the PCA map."""
    metrics = {
        "selection_seconds": record.selection_seconds,
        "stage_seconds": record.seconds,
        "selector_seconds": record.selector_seconds,
        "forward_passes": record.forward_passes,
        "backward_passes": record.backward_passes,
        "peak_rss_mib": record.selection_peak_rss_mib,
        "peak_cuda_mib": record.selection_peak_cuda_mib,
        "pool_size": record.pool_size,
        "selected_samples": record.selected_samples,
        "data_fraction": record.data_fraction,
        "gradient_diversity": record.gradient_diversity,
        "pool_gradient_diversity": record.pool_gradient_diversity,
    }
    tracker.log_metrics(run_id, metrics)
    tracker.log_bytes(run_id, map_png, "pca_map_selected.png", "plots")


def _record(
    config: PeripheralSubsetsConfig,
    result: SelectionResult,
    clusters: BalancedClustersRecord,
    gathered: GatheredInputs,
    table: TableRef,
    seconds: float,
    summary: pl.DataFrame,
    diversity: tuple[float, float],
) -> PeripheralSubsetsRecord:
    """The record of a selection that took ``seconds`` and was written as ``table``;
    ``summary`` is its :func:`per_cluster_summary`, ``diversity`` the subset's and the pool's
    gradient diversity."""
    cost = result.cost
    assert cost is not None  # run_selector records it
    return PeripheralSubsetsRecord(
        table=table,
        inputs={**clusters.lineage(), **gathered.tables},
        seconds=round(seconds, 3),
        # A selector's own passes count at their measured rate, cached or run now.
        selection_seconds=round(
            clusters.selection_seconds
            + seconds
            - gathered.pass_wall_seconds
            + sum(p.seconds for p in cost.passes if p.name != PASS_EMBEDDING),
            2,
        ),
        selector=config.selector,
        ratio=config.ratio,
        seed=config.seed,
        per_cluster=result.per_cluster,
        pool_size=len(result.selected),
        selected_samples=result.n_selected,
        data_fraction=round(result.data_fraction, 4),
        cluster_weights=[round(float(w), 6) for w in result.cluster_weights],
        balance=config.balance,
        token_budget=result.token_budget,
        samples_per_cluster=summary["kept"].to_list(),
        tokens_per_cluster=summary["kept_tokens"].to_list(),
        gradient_diversity=round(diversity[0], 6),
        pool_gradient_diversity=round(diversity[1], 6),
        selector_seconds=round(cost.seconds, 4),
        forward_passes=cost.forward_passes,
        backward_passes=cost.backward_passes,
        selection_passes=[p.to_dict() for p in cost.passes],
        selection_peak_rss_mib=round_mib(cost.peak_rss_mib),
        selection_peak_cuda_mib=round_mib(cost.peak_cuda_mib),
        selection_target=gathered.target,
        selection_target_samples=gathered.target_samples,
        s2l_proxy_checkpoints=list(gathered.proxy_checkpoints),
        s2l_checkpoint_steps=list(gathered.proxy_steps),
        less_learning_rates=[round(r, 10) for r in gathered.less_learning_rates],
    )


def _log_line(record: PeripheralSubsetsRecord) -> str:
    """One line for the run's log: what was kept per cluster, the weights, diversity and cost."""
    r = record
    passes = ", ".join(p["name"] for p in r.selection_passes) or "no model pass"
    return (
        f"{r.selector} r={r.ratio}, balance by {r.balance}: {r.selected_samples} of "
        f"{r.pool_size} samples ({100 * r.data_fraction:.1f}%); per cluster "
        f"{r.samples_per_cluster} samples, {r.tokens_per_cluster} tokens; weights "
        f"{[round(w, 4) for w in r.cluster_weights]}; gradient diversity "
        f"{r.gradient_diversity:.4f} (pool {r.pool_gradient_diversity:.4f}); cost "
        f"{r.selector_seconds:.3f} s and {r.forward_passes} forward / {r.backward_passes} "
        f"backward passes ({passes}), peak memory per rank "
        f"{_memory(r.selection_peak_rss_mib, r.selection_peak_cuda_mib)}"
    )


def _memory(rss_mib: float | None, cuda_mib: float | None) -> str:
    if rss_mib is None:
        return "not recorded"
    return f"{rss_mib:.0f} MiB resident" + (f", {cuda_mib:.0f} MiB CUDA" if cuda_mib else "")


def _selection_map(
    frame: pl.DataFrame,
    embeddings: TableRef,
    representation: str,
    selected: np.ndarray,
    title: str,
) -> bytes:
    """The PCA map (PNG) of a seeded sample of at most 20,000 rows of ``frame``, in the
    representation that was clustered, selected samples marked."""
    shown = frame.with_row_index("row").sample(min(frame.height, 20000), seed=0)
    if representation == "gradient_proxy":
        mapped = l2_normalise(embeddings.vectors_for("embedding", shown["sample_id"]))
    else:
        column = f"{REPRESENTATIONS[representation]}_normalised"
        mapped = embeddings.vectors_for(column, shown["sample_id"])
    rows = shown["row"].to_numpy()
    return plots.png(
        plots.pca_map_figure(
            mapped,
            frame["cluster"].to_numpy()[rows],
            selected[rows],
            title=f"{title} ({representation})",
        )
    )

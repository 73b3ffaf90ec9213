"""Export the selected subset as a Hugging Face ``datasets`` dataset, with a dataset card.

    cluster-pipeline export <dataset>                 # to data/exports/<dataset>/
    cluster-pipeline export <dataset> --out DIR       # elsewhere
    cluster-pipeline export <dataset> --overwrite     # replace an export of other manifests

Exports the dataset's latest shard manifests as the Dagster instance recorded them ($DAGSTER_HOME,
else <project>/.dagster_home, as `make` uses): split `train` (every shard entry) and one split per
rank (`rank_0`, ...), as a `save_to_disk` folder (`<out>/dataset_dict`, for
`datasets.load_from_disk`), Parquet files a folder per split (`<out>/data/<split>/`), with
LLaMA-Factory's `dataset_info.json` beside them, and a dataset card (`<out>/README.md`): the
Hub's header, the selector, ratio, K, weights, and the provenance that repeats the selection
(code commit, source files by SHA-256, every stage's settings, the base model, table versions
by number and content hash, the run config). Every table is read at the version the manifests
were built from.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from cluster_pipeline.cli import UserError, instance_home, make_run
from cluster_pipeline.integrations.export_spec import Provenance, StageSettings
from cluster_pipeline.integrations.hf_datasets import ExportError, ExportSource, export_selection
from cluster_pipeline.storage.layout import DataLayout, default_data_dir
from cluster_pipeline.storage.lineage import LINEAGE_STAGES
from cluster_pipeline.storage.names import (
    BALANCED_CLUSTERS,
    PERIPHERAL_SUBSETS,
    PROXY_EMBEDDINGS,
    RAW_INSTRUCTIONS,
    SHARD_MANIFESTS,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``export`` arguments: the dataset, ``--out``, ``--overwrite``, ``--data-dir``."""
    parser.add_argument("dataset")
    parser.add_argument(
        "--out", type=Path, help="the export folder (default: <data-dir>/exports/<dataset>)"
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an export of other manifests there (never anything the export did not "
        "write: other files there make it refuse)",
    )
    parser.add_argument("--data-dir", type=Path, default=Path(default_data_dir()))


def _materialize_first(dataset: str, why: str) -> UserError:
    return UserError(
        f"dataset {dataset!r} has no shard manifests to export: {why}. Materialize selection_job "
        f"(raw_instructions -> shard_manifests) for partition {dataset!r} first: web UI Jobs -> "
        f"selection_job, or `{make_run(dataset)}` (main_job runs it too)"
    )


def check_registered(instance, dataset: str, layout: DataLayout) -> None:
    """Refuse an empty or unregistered dataset name, listing the registered ones.

    Args:
        instance: the Dagster instance whose dataset partitions are looked up.
        dataset: the name given on the command line.
        layout: the data folder, to say whether the name has a folder or tables there.

    Raises:
        UserError: the name is empty, or no dataset partition of that name is registered.
    """
    from cluster_pipeline.defs.partitions import DATASETS

    known = sorted(instance.get_dynamic_partitions(DATASETS))
    root = instance.root_directory
    listed = f"registered: {', '.join(known)}" if known else "none is registered"
    if not dataset.strip():
        raise UserError(
            f"the dataset name is empty; give a dataset registered in the Dagster instance at "
            f"{root} ({listed})"
        )
    if dataset in known:
        return
    folder = layout.raw_dir / dataset
    table = Path(layout.table_uri(SHARD_MANIFESTS, dataset))
    if table.is_dir():
        hint = f"its table {table} exists: set DAGSTER_HOME to the Dagster instance that made it"
    elif folder.is_dir():
        hint = (
            f"its folder {folder} exists: `cluster-pipeline datasets sync` registers it, then "
            "materialize selection_job for it"
        )
    else:
        hint = (
            "check the name (`cluster-pipeline datasets` lists the datasets found, `cluster-"
            "pipeline datasets sync` registers them)"
        )
    raise UserError(
        f"dataset {dataset!r} is not registered in the Dagster instance at {root} ({listed}); "
        f"{hint}"
    )


def export_source(instance, dataset: str, layout: DataLayout) -> ExportSource:
    """The latest shard manifests of ``dataset`` and the records of the selection that made
    them (each the materialization that wrote the pinned table version), as an
    :class:`~cluster_pipeline.integrations.hf_datasets.ExportSource`.

    Args:
        instance: the Dagster instance that holds the records (``dg.DagsterInstance``).
        dataset: the dataset partition.
        layout: the data folder, to tell "never materialized" from "another instance".

    Raises:
        UserError: no shard manifests recorded, or a record of the chain is missing or older
            than the pipeline.
    """
    from cluster_pipeline.defs.records import (
        BalancedClustersRecord,
        PeripheralSubsetsRecord,
        ProxyEmbeddingsRecord,
        RawInstructionsRecord,
        SampleLineageRecord,
        ShardManifestsRecord,
        UpstreamNotMaterialized,
        latest_record,
        record_that_wrote,
    )

    try:
        shards = latest_record(instance, ShardManifestsRecord, dataset)
        if shards is None:
            table = Path(layout.table_uri(SHARD_MANIFESTS, dataset))
            raise _materialize_first(
                dataset,
                f"the Dagster instance at {instance.root_directory} has no record of them, "
                f"though the table {table} exists (set DAGSTER_HOME to the instance that made "
                "it, or rematerialize)"
                if table.is_dir()
                else f"the Dagster instance at {instance.root_directory} has no record of them",
            )
        subsets = record_that_wrote(
            instance, PeripheralSubsetsRecord, dataset, shards.inputs[PERIPHERAL_SUBSETS]
        )
        clusters = record_that_wrote(
            instance, BalancedClustersRecord, dataset, subsets.inputs[BALANCED_CLUSTERS]
        )
        embeddings = record_that_wrote(
            instance, ProxyEmbeddingsRecord, dataset, clusters.inputs[PROXY_EMBEDDINGS]
        )
        raw = record_that_wrote(
            instance, RawInstructionsRecord, dataset, embeddings.inputs[RAW_INSTRUCTIONS]
        )
        lineage = latest_record(instance, SampleLineageRecord, dataset)
    except UpstreamNotMaterialized as e:
        raise UserError(e.description or str(e)) from None
    versions = shards.lineage()
    built_from_these = (
        lineage is not None and lineage.inputs.get(SHARD_MANIFESTS) == versions[SHARD_MANIFESTS]
    )
    return ExportSource(
        dataset=dataset,
        selector=subsets.selector,
        ratio=subsets.ratio,
        selection_seed=subsets.seed,
        num_clusters=clusters.num_clusters,
        alpha=clusters.alpha,
        cluster_weights=list(subsets.cluster_weights),
        balance=subsets.balance,
        token_budget=subsets.token_budget,
        pool_size=subsets.pool_size,
        selected_samples=subsets.selected_samples,
        base_model=embeddings.base_model,
        manifest_paths=list(shards.manifest_paths),
        manifest_sha256=list(shards.manifest_sha256),
        manifest_set_sha256=shards.manifest_set_sha256,
        dropped_for_equal_shards=shards.dropped_for_equal_shards,
        tables={stage: versions[stage] for stage in LINEAGE_STAGES if stage in versions},
        lineage_table=lineage.table if lineage is not None and built_from_these else None,
        provenance=selection_provenance(raw, embeddings, clusters, subsets, shards),
    )


def _selection_knobs(config: dict[str, Any]) -> dict[str, Any]:
    """The knobs of a recorded ``peripheral_subsets`` config that its selector reads (the
    others are defaults nobody chose; :func:`~cluster_pipeline.defs.configs.tracked_knobs`)."""
    from cluster_pipeline.defs.configs import tracked_knobs

    return tracked_knobs(config) if config.get("selector") else dict(config)


def selection_provenance(raw, embeddings, clusters, subsets, shards) -> Provenance:
    """What repeats the selection, from the records of its five stages
    (:class:`~cluster_pipeline.integrations.export_spec.Provenance`): each stage's settings as
    its config recorded them (for records from before configs were recorded, the settings the
    record kept), what it did, the source files by SHA-256, the pool draw, the base model's
    portable identity and the run config of the five stages (with the base model where its
    setting names no local folder)."""
    from cluster_pipeline.defs.records import chain_run_config

    clusters_settings = clusters.config or {
        "num_clusters": clusters.num_clusters,
        "alpha": clusters.alpha,
        "niter": clusters.kmeans_niter,
        "restarts": clusters.kmeans_restarts,
        "representation": clusters.representation,
    }
    stages = {
        RAW_INSTRUCTIONS: StageSettings(dict(raw.config), code=raw.code),
        PROXY_EMBEDDINGS: StageSettings(
            dict(embeddings.config or embeddings.embed_settings),
            {
                "samples embedded": embeddings.embedded,
                "samples cut by truncation (by where)": embeddings.truncated,
                "samples skipped (no response token left)": embeddings.skipped,
            },
            code=embeddings.code,
        ),
        BALANCED_CLUSTERS: StageSettings(
            dict(clusters_settings),
            {
                "k-means sample": clusters.kmeans_sample_size,
                "k-means inertia (best restart)": clusters.kmeans_inertia,
                "cluster sizes after the capacity step": clusters.cluster_sizes,
                "cap": clusters.cap,
            },
            code=clusters.code,
        ),
        PERIPHERAL_SUBSETS: StageSettings(
            _selection_knobs(dict(subsets.config))
            or {"selector": subsets.selector, "ratio": subsets.ratio, "seed": subsets.seed},
            {
                "samples kept per cluster": subsets.samples_per_cluster,
                "tokens kept per cluster": subsets.tokens_per_cluster,
            },
            code=subsets.code,
        ),
        SHARD_MANIFESTS: StageSettings(
            dict(shards.config),
            {
                "samples per rank": shards.samples_per_rank,
                "tokens per rank": shards.tokens_per_rank,
            },
            code=shards.code,
        ),
    }
    identity = embeddings.base_model_identity
    # A setting that names a local folder is no use elsewhere: the card names its weights.
    portable_model = "hub_id" in identity or "source" in identity
    run_config = chain_run_config(
        {
            RAW_INSTRUCTIONS: raw,
            PROXY_EMBEDDINGS: embeddings,
            BALANCED_CLUSTERS: clusters,
            PERIPHERAL_SUBSETS: subsets,
            SHARD_MANIFESTS: shards,
        },
        embeddings.base_model_setting if portable_model else None,
    )
    return Provenance(
        stages=stages,
        source_files=dict(raw.source_files),
        source=raw.source,
        pool={
            "records_read": raw.records_read,
            "duplicates_dropped": raw.duplicates_dropped,
            "heldout_samples": raw.heldout_samples,
            "train_available": raw.train_available,
            "train_samples": raw.train_samples,
        },
        base_model=dict(identity),
        run_config=run_config if run_config["ops"] else {},
    )


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Export the dataset's latest shard manifests (module docstring) and print what was
    written."""
    import dagster as dg

    if not args.data_dir.is_dir():
        # The tables are found through the instance's records, but the licenses (raw/) and the
        # default --out live in the data folder: a wrong --data-dir would export silently.
        raise UserError(
            f"--data-dir {args.data_dir} is not a folder: give the data folder the pipeline "
            f"wrote (default {default_data_dir()}, or $CLUSTER_PIPELINE_DATA_DIR)"
        )
    layout = DataLayout.at(args.data_dir)
    home = instance_home()
    if not home.is_dir():
        if not args.dataset.strip():
            raise UserError(
                f"the dataset name is empty, and there is no Dagster instance at {home}, so no "
                "dataset is registered: `cluster-pipeline datasets sync` registers the datasets "
                "under data/raw/"
            )
        raise _materialize_first(args.dataset, f"there is no Dagster instance at {home}")
    with dg.DagsterInstance.from_config(str(home)) as instance:
        check_registered(instance, args.dataset, layout)
        source = export_source(instance, args.dataset, layout)
    out = args.out if args.out is not None else layout.exports_dir(args.dataset)
    try:
        summary = export_selection(source, out, layout.raw_dir, overwrite=args.overwrite)
    except ExportError as e:
        raise UserError(str(e)) from None
    rows = ", ".join(f"{name} {n}" for name, n in summary.rows.items())
    license = summary.license.license if summary.license is not None else "none declared"
    print(
        f"{'replaced the export in' if summary.replaced else 'exported to'} {summary.out}: "
        f"{rows} rows; manifest set {source.manifest_set_sha256[:12]}; license: {license}"
    )
    if summary.left_behind is not None:
        print(
            f"note: files that appeared in the earlier export while this one was written are "
            f"in {summary.left_behind}; move them where you want them"
        )
    if source.lineage_table is None:
        print(
            "note: sample_lineage was not built from these manifests; materialize it to trace "
            "each row (the card says so)"
        )

"""Metadata helpers: what each asset records, and how downstream assets read it back.

Every stage records ``table_uri`` and ``table_version`` (and other paths) in its materialization
metadata; downstream stages read exactly that version, never "the newest file".
"""


import dagster as dg
import polars as pl

from cluster_pipeline.core.tables import TableRef

_DAGSTER_TYPES = {
    pl.String: "string",
    pl.Int64: "int64",
    pl.Int32: "int32",
    pl.Float32: "float32",
    pl.Float64: "float64",
    pl.Boolean: "bool",
}


class UpstreamNotMaterialized(dg.Failure):
    pass


def latest_materialization_metadata(instance: dg.DagsterInstance, asset: str,
                                    partition: str) -> dict | None:
    """Metadata values of the latest materialization of ``asset`` for ``partition``, or None."""
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey(asset), asset_partitions=[partition]),
        limit=1,
    ).records
    if not records:
        return None
    return {k: v.value for k, v in records[0].asset_materialization.metadata.items()}


def latest_metadata(context: dg.AssetExecutionContext, asset: str) -> dict:
    """Metadata of the latest materialization of ``asset`` for this run's partition.

    Raises:
        UpstreamNotMaterialized: the upstream partition was never materialized.
    """
    meta = latest_materialization_metadata(context.instance, asset, context.partition_key)
    if meta is None:
        raise UpstreamNotMaterialized(
            description=(
                f"{asset} has no materialization for partition {context.partition_key!r}; "
                f"materialize {asset} first (or the whole chain)."
            )
        )
    return meta


def upstream_table(context: dg.AssetExecutionContext, asset: str, key: str = "table") -> TableRef:
    """The Delta table version that ``asset`` recorded for this partition."""
    meta = latest_metadata(context, asset)
    return TableRef(str(meta[f"{key}_uri"]), int(meta[f"{key}_version"]))


def markdown_table(frame: pl.DataFrame, max_rows: int = 8, max_chars: int = 60) -> str:
    """A small GitHub-Markdown table of the first rows (long cells shortened)."""

    def cell(v) -> str:
        text = "" if v is None else str(v)
        text = text.replace("\n", " ").replace("|", "\\|")
        return text if len(text) <= max_chars else text[: max_chars - 1] + "…"

    head = frame.head(max_rows)
    lines = [
        "| " + " | ".join(head.columns) + " |",
        "|" + "---|" * len(head.columns),
    ]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in head.iter_rows()]
    return "\n".join(lines)


def table_metadata(ref: TableRef, frame: pl.DataFrame, seconds: float, key: str = "table",
                   preview_columns: list[str] | None = None) -> dict:
    """Standard metadata of a stage that wrote one Delta table."""
    schema = dg.TableSchema(
        columns=[
            dg.TableColumn(name, _DAGSTER_TYPES.get(dtype, str(dtype)))
            for name, dtype in frame.schema.items()
        ]
    )
    preview = frame.select(preview_columns) if preview_columns else frame
    return {
        "dagster/row_count": frame.height,
        "dagster/column_schema": schema,
        f"{key}_uri": dg.MetadataValue.path(ref.uri),
        f"{key}_version": ref.version,
        "seconds": round(seconds, 3),
        "preview": dg.MetadataValue.md(markdown_table(preview)),
    }

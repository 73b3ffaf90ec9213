"""Display-only metadata of a stage's table (row count, column schema and a preview), and the
results of its asset checks.

What downstream stages read back lives in :mod:`cluster_pipeline.defs.records`.
"""

import dagster as dg
import polars as pl

from cluster_pipeline.storage.columns import describe
from cluster_pipeline.storage.tables import markdown_preview

_DAGSTER_TYPES = {
    pl.String: "string",
    pl.Int64: "int64",
    pl.Int32: "int32",
    pl.Float32: "float32",
    pl.Float64: "float64",
    pl.Boolean: "bool",
}


def error_checks(checks: dict[str, tuple[bool, str]]) -> list[dg.AssetCheckResult]:
    """One ERROR-severity check result per ``name: (passed, description)`` of ``checks``."""
    return [
        dg.AssetCheckResult(
            check_name=name,
            passed=passed,
            description=text,
            severity=dg.AssetCheckSeverity.ERROR,
        )
        for name, (passed, text) in checks.items()
    ]


def table_display(
    frame: pl.DataFrame, table: str, preview_columns: list[str] | None = None
) -> dict:
    """``dagster/row_count``, ``dagster/column_schema`` (each column's type and its description
    from :mod:`cluster_pipeline.storage.columns`) and a Markdown ``preview`` of ``frame`` (first
    rows, ``preview_columns`` only if given).

    Args:
        frame: the table as written (or the rows shown of it).
        table: the table's name (:mod:`cluster_pipeline.storage.names`).
        preview_columns: the preview's columns; None = all.

    Raises:
        KeyError: a column of ``frame`` has no description (:func:`~cluster_pipeline.storage.
            columns.describe`).
    """
    descriptions = describe(table, frame.columns)
    schema = dg.TableSchema(
        columns=[
            dg.TableColumn(
                name, _DAGSTER_TYPES.get(dtype, str(dtype)), description=descriptions[name]
            )
            for name, dtype in frame.schema.items()
        ]
    )
    preview = frame.select(preview_columns) if preview_columns else frame
    return {
        "dagster/row_count": frame.height,
        "dagster/column_schema": schema,
        "preview": dg.MetadataValue.md(markdown_preview(preview)),
    }

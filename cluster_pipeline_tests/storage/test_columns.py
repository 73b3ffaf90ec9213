"""Every column of every table the stages write has one description, and the Dagster column
schema carries it."""

import polars as pl
import pytest

from cluster_pipeline.data.datasets import INSTRUCTION_SCHEMA
from cluster_pipeline.defs.metadata import table_display
from cluster_pipeline.evaluation.report import ITEM_SCORE_SCHEMA
from cluster_pipeline.selection.sharding import MANIFEST_SCHEMA
from cluster_pipeline.storage import names
from cluster_pipeline.storage.columns import COLUMN_DESCRIPTIONS, describe
from cluster_pipeline.storage.embedding_cache import CHUNK_SCHEMA
from cluster_pipeline.storage.lineage import LINEAGE_COLUMNS

# Every table name but the two stages that write files, not a table.
TABLES = sorted(
    v
    for k, v in vars(names).items()
    if k.isupper() and v not in (names.TRAINED_CHECKPOINT, names.EVAL_REPORT)
)


def test_every_table_has_descriptions_of_its_columns_and_no_others():
    assert sorted(COLUMN_DESCRIPTIONS) == TABLES
    normalised = [f"{c}_normalised" for c in ("embedding", "hidden_mean")]
    written = {
        names.RAW_INSTRUCTIONS: list(INSTRUCTION_SCHEMA),
        names.SELECTION_TARGETS: list(INSTRUCTION_SCHEMA),
        names.PROXY_EMBEDDINGS: [*CHUNK_SCHEMA, *normalised],
        names.SHARD_MANIFESTS: list(MANIFEST_SCHEMA),
        names.EVAL_ITEM_SCORES: list(ITEM_SCORE_SCHEMA),
        names.SAMPLE_LINEAGE: LINEAGE_COLUMNS,
    }
    for table, columns in written.items():
        assert sorted(COLUMN_DESCRIPTIONS[table]) == sorted(columns), table
    for table, columns in COLUMN_DESCRIPTIONS.items():
        for column, text in columns.items():
            assert text.strip() and text.endswith("."), (table, column)


def test_a_column_without_a_description_is_named():
    assert describe(names.BALANCED_CLUSTERS, ["cluster"]) == {
        "cluster": "Cluster c after the capacity step (trained on rank c)."
    }
    with pytest.raises(KeyError, match=r"\['new_column'\] of table 'balanced_clusters'"):
        describe(names.BALANCED_CLUSTERS, ["cluster", "new_column"])
    with pytest.raises(KeyError, match="table 'nowhere' has no column descriptions"):
        describe("nowhere", ["x"])


def test_the_column_schema_shows_each_columns_type_and_description():
    frame = pl.DataFrame(
        {"sample_id": ["a"], "cluster": [0], "kmeans_cluster": [1], "sq_distance": [0.5]},
        schema_overrides={"sq_distance": pl.Float32},
    )
    shown = table_display(frame, names.BALANCED_CLUSTERS)
    columns = shown["dagster/column_schema"].columns
    assert [(c.name, c.type) for c in columns] == [
        ("sample_id", "string"),
        ("cluster", "int64"),
        ("kmeans_cluster", "int64"),
        ("sq_distance", "float32"),
    ]
    assert [c.description for c in columns] == [
        COLUMN_DESCRIPTIONS[names.BALANCED_CLUSTERS][c.name] for c in columns
    ]
    assert shown["dagster/row_count"] == 1

"""A stage whose parent's tables are gone says so and what to do, instead of deltalake's
``TableNotFoundError`` traceback (issue 43: the data folder moved, ``$CLUSTER_PIPELINE_DATA_DIR``
pointing elsewhere).

The kind, "the record names a table that is not there": the data folder moved (another
``$CLUSTER_PIPELINE_DATA_DIR``), the table deleted in place, and a table the record names
among its inputs (the pinned read of a later stage)."""

import shutil

import dagster as dg
import pytest

from cluster_pipeline.defs.partitions import DATASETS
from cluster_pipeline.defs.records import RawInstructionsRecord, check_tables_exist
from cluster_pipeline.storage.layout import DataLayout
from cluster_pipeline.storage.tables import TableRef
from cluster_pipeline_tests.helpers import (
    materialize_partition,
    pipeline_assets,
    resources,
    step_failure,
)

RAW, EMBED = pipeline_assets()[:2]


def test_a_moved_data_folder_is_named_with_what_to_do(
    tiny_data_dir, tiny_model_dir, tmp_path, monkeypatch
):
    moved = tmp_path / "elsewhere" / "data"
    monkeypatch.setenv("CLUSTER_PIPELINE_DATA_DIR", str(moved))
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(DATASETS, ["tiny"])
        assert materialize_partition(
            [RAW], instance, resources(tiny_data_dir, tiny_model_dir)
        ).success
        table = DataLayout.at(tiny_data_dir).table_uri("raw_instructions", "tiny")
        shutil.move(tiny_data_dir, moved)
        result = materialize_partition(
            [EMBED], instance, resources(moved, tiny_model_dir), raise_on_error=False
        )
    description, _ = step_failure(result)
    root = tiny_data_dir.resolve()
    assert description == (
        f"the latest raw_instructions materialization of partition 'tiny' names the table "
        f"{table} (version 0), which does not exist: it was written under the data folder "
        f"{root}, and this run's data folder is {moved.resolve()} ($CLUSTER_PIPELINE_DATA_DIR = "
        f"{moved}). If the data folder moved, run with CLUSTER_PIPELINE_DATA_DIR={root} (where "
        f"`make dev` or dagster runs), or move it back; to start over in {moved.resolve()}, "
        "materialize raw_instructions and the stages before it again."
    )
    assert "TableNotFoundError" not in description


def _record(uri: str, inputs: dict[str, TableRef] | None = None) -> RawInstructionsRecord:
    record = RawInstructionsRecord.__new__(RawInstructionsRecord)
    object.__setattr__(record, "table", TableRef(uri, 3))
    if inputs is not None:
        object.__setattr__(record, "inputs", inputs)
    return record


def test_a_table_deleted_in_place_and_a_missing_input_are_named(tmp_path):
    root = tmp_path.resolve()
    uri = str(root / "tables" / "raw_instructions" / "tiny")
    with pytest.raises(dg.Failure) as e:
        check_tables_exist(_record(uri), "tiny", root)
    assert e.value.description == (
        f"the latest raw_instructions materialization of partition 'tiny' names the table {uri} "
        f"(version 3), which does not exist (deleted from the data folder {root}?); materialize "
        "raw_instructions and the stages before it again."
    )
    # The table exists, one it was computed from does not: that one is named.
    (root / "tables" / "raw_instructions" / "tiny" / "_delta_log").mkdir(parents=True)
    gone = str(root / "tables" / "proxy_embeddings" / "tiny")
    with pytest.raises(dg.Failure) as e:
        check_tables_exist(_record(uri, {"proxy_embeddings": TableRef(gone, 1)}), "tiny", root)
    assert f"names the table {gone} (version 1), which does not exist" in str(e.value.description)
    check_tables_exist(_record(uri), "tiny", root)  # all there: nothing raised

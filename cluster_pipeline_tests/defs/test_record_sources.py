"""A sample's source, as S2L's per-source split and balanced_random read it (issue 41: "source =
the record's file, or a `source` column when the data has one"): its record's ``source`` field
(S2L, schedules/s2l.py:21: ``data['source']``), else its ``dataset`` field (RDS+'s Tulu
mixtures, scripts/construct_downsampled_balanced.py:28: ``d['dataset']``), else its file."""

import json

import numpy as np
import pytest

from cluster_pipeline.data.folders import TARGET_REMEDY, read_dataset_folder, record_field_values
from cluster_pipeline.defs.pass_runner import record_sources


def test_the_record_field_names_the_source_else_the_file(tmp_path):
    a = tmp_path / "a.jsonl"
    a.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"instruction": "q0", "output": "r0", "source": "gsm8k"},
                {"instruction": "q1", "output": "r1"},
                {"instruction": "q2", "output": "r2", "source": "", "dataset": "flan_v2"},
                {"instruction": "q3", "output": "r3", "source": 7},
            ]
        )
        + "\n"
    )
    # One line holding a JSON array: two records on line 1, told apart by source_index.
    b = tmp_path / "b.json"
    b.write_text(
        json.dumps(
            [
                {"instruction": "q4", "output": "r4", "dataset": "oasst1"},
                {"instruction": "q5", "output": "r5", "source": True},
            ]
        )
    )
    samples = list(read_dataset_folder(tmp_path))
    files = [s.source_file for s in samples]
    indices = [s.source_index for s in samples]
    assert indices == [0, 1, 2, 3, 0, 1]
    got = record_sources(files, indices)
    assert got.tolist() == ["gsm8k", str(a), "flan_v2", "7", "oasst1", str(b)]
    # Pool order is the caller's: the same samples reversed, and one without an index (a table
    # written before source_index) keeps its file.
    got = record_sources(files[::-1], [*indices[::-1][:5], None])
    assert got.tolist() == [str(b), "oasst1", "7", "flan_v2", str(a), str(a)]
    assert np.asarray(got).dtype.kind == "U"


def test_a_gone_or_shorter_file_is_named(tmp_path):
    a = tmp_path / "a.jsonl"
    a.write_text(json.dumps({"instruction": "q", "output": "r"}) + "\n")
    with pytest.raises(
        ValueError, match=r"a\.jsonl: holds 1 records, but the pool's sources name record 3"
    ):
        record_sources([str(a)], [3])
    gone = str(tmp_path / "gone.jsonl")
    with pytest.raises(
        ValueError, match=r"gone\.jsonl: the file is gone, so the pool's sources .*raw_instructions"
    ):
        record_sources([gone], [0])


def test_the_shards_of_one_sharded_file_are_one_source(tmp_path):
    """A dataset saved in shards (the Hub's ``train-00000-of-00002.parquet``, save_to_disk's
    ``data-00000-of-00001.arrow``) is one source, not one per shard (a helper's trial: two
    parquet shards took two thirds of balanced_random's budget beside one JSONL file); the
    same for a target folder's tasks."""
    import polars as pl

    from cluster_pipeline.data.folders import file_group
    from cluster_pipeline.evaluation.targets import target_samples, target_tasks

    assert file_group("d/code/train-00001-of-00002.parquet") == "d/code/train.parquet"
    assert file_group("d/data-00000-of-00001.arrow") == "d/data.arrow"
    assert file_group("d/train-0001-of-0002.parquet") == "d/train-0001-of-0002.parquet"
    assert file_group("d/v-00001-of-00002/x.json") == "d/v-00001-of-00002/x.json"
    code = tmp_path / "code"
    code.mkdir()
    rows = [{"instruction": f"q{i}", "output": f"r{i}"} for i in range(4)]
    pl.DataFrame(rows[:2]).write_parquet(code / "train-00000-of-00002.parquet")
    pl.DataFrame(rows[2:]).write_parquet(code / "train-00001-of-00002.parquet")
    (tmp_path / "words.jsonl").write_text(json.dumps(rows[0] | {"instruction": "w"}) + "\n")
    samples = list(read_dataset_folder(tmp_path))
    got = record_sources([s.source_file for s in samples], [s.source_index for s in samples])
    whole = str(code / "train.parquet")
    assert got.tolist() == [whole, whole, whole, whole, str(tmp_path / "words.jsonl")]
    # A target folder of one sharded file names no task; beside another file, one task each.
    frame = target_samples(str(code), 10, [])
    assert target_tasks(frame, str(code)) == ["", "", "", ""]
    frame = target_samples(str(tmp_path), 10, [])
    assert sorted(set(target_tasks(frame, str(tmp_path)))) == [
        whole,
        str(tmp_path / "words.jsonl"),
    ]


def test_a_file_rewritten_in_another_order_is_named_not_read_by_position(tmp_path):
    """The sources are read again from the files by each sample's place; a file rewritten with
    as many records in another order would give each sample another record's ``source`` (a
    helper's trial: 72 of 72 samples): each record read is turned into its sample again, under
    the folder's field renaming, and must be the sample read there."""
    rows = [{"question": f"q{i}", "output": f"r{i}", "source": f"s{i}"} for i in range(3)]
    a = tmp_path / "a.jsonl"
    a.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "fields.json").write_text(json.dumps({"question": "instruction"}))
    samples = list(read_dataset_folder(tmp_path))
    files = [s.source_file for s in samples]
    indices = [s.source_index for s in samples]
    ids = [s.sample_id for s in samples]
    assert record_sources(files, indices, (tmp_path, ids)).tolist() == ["s0", "s1", "s2"]
    a.write_text("".join(json.dumps(r) + "\n" for r in [rows[1], rows[0], rows[2]]))
    with pytest.raises(ValueError) as e:
        record_sources(files, indices, (tmp_path, ids))
    assert str(e.value) == (
        f"{a}:1: record 0 is not the sample read there (sample {ids[0]}), so the pool's sources "
        "cannot be read from it: the file changed since it was read; materialize "
        "raw_instructions, proxy_embeddings, balanced_clusters and peripheral_subsets again (the "
        "pool is the raw_instructions version it was clustered from)"
    )
    # A target folder's tasks name the step that reads the target set anew (a helper's
    # re-trial: materializing raw_instructions alone did not help a pool pinned to its version).
    with pytest.raises(ValueError, match=r"run peripheral_subsets again \(it reads the target"):
        record_field_values(files, indices, ("task",), "the tasks", (tmp_path, ids), TARGET_REMEDY)
    # Without the identity (a caller that has none), by position, as before.
    assert record_sources(files, indices).tolist() == ["s1", "s0", "s2"]


def test_the_lines_on_sources_say_what_they_make_of_the_draw():
    """A source field missing from some records mixes files into the sources; one source makes
    balanced_random random_global's draw: each is said (a helper's trial)."""
    from cluster_pipeline.defs.pass_runner import fallback_line
    from cluster_pipeline.selection.selectors.balanced_random import sources_line

    files = ["d/a.jsonl", "d/a.jsonl", "d/b-00000-of-00002.parquet"]
    assert fallback_line(files, np.array(["gsm8k", "d/a.jsonl", "d/b.parquet"])) == (
        "2 of the pool's 3 samples have no usable `source` or `dataset` field (missing, empty, or "
        "not a string or number): their file is their source, beside the field's values"
    )
    assert fallback_line(files, np.array(["x", "y", "z"])) is None
    assert fallback_line(files, np.array(["d/a.jsonl", "d/a.jsonl", "d/b.parquet"])) is None
    assert sources_line(np.array(["a", "b", "a"])) == "balanced_random: 2 sources in the pool"
    assert sources_line(np.array(["a", "a"])) == (
        "balanced_random: 1 source in the pool, so the draw is random_global's; records whose "
        "`source` or `dataset` field takes several values, or one file per source, stratify it"
    )

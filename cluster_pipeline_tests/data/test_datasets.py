"""Dataset discovery, dedup, the held-out split and the built-in stdlib dataset."""

import ast
import json
import sys
from pathlib import Path

import dagster as dg
import polars as pl
import pytest

from cluster_pipeline.data.datasets import (
    build_instruction_table,
    discover_datasets,
    load_samples,
    refused_datasets,
)
from cluster_pipeline.data.formats import Sample
from cluster_pipeline.data.stdlib_dataset import iter_stdlib_samples
from cluster_pipeline.storage.layout import storage_name

# One xdist worker runs this module: its module-scoped fixture starts once.
pytestmark = pytest.mark.xdist_group("datasets")


def _samples(n, dup=0):
    out = [Sample(f"p{i}", f"r{i}", "", "alpaca", "f.jsonl", i + 1) for i in range(n)]
    return out + [Sample("p0", "r0", "", "alpaca", "g.jsonl", 99)] * dup


def test_discover_lists_builtin_first_then_folders_with_data(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x.jsonl").write_text("{}\n")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.parquet").write_bytes(b"")  # 0 bytes: no records ...
    (tmp_path / "a" / "y.jsonl").write_text('{"problem": "p", "solution": "s"}\n')  # ... these
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("no data")
    assert discover_datasets(tmp_path) == ["python_stdlib", "a", "b"]
    assert discover_datasets(tmp_path / "missing") == ["python_stdlib"]


def test_split_is_exact_deterministic_and_disjoint():
    frame, stats = build_instruction_table(_samples(100, dup=3), 0.1, None, None, seed=0)
    assert stats.records == 103 and stats.duplicates == 3
    assert frame.height == 100 and frame["sample_id"].n_unique() == 100
    assert (frame["split"] == "heldout").sum() == 10 and stats.train == 90
    # First occurrence wins for duplicates.
    assert frame.filter(frame["prompt"] == "p0")["source_file"].item() == "f.jsonl"
    again, _ = build_instruction_table(list(reversed(_samples(100))), 0.1, None, None, seed=0)
    assert set(again.filter(again["split"] == "heldout")["sample_id"]) == set(
        frame.filter(frame["split"] == "heldout")["sample_id"]
    )
    other, _ = build_instruction_table(_samples(100), 0.1, None, None, seed=1)
    assert set(other.filter(other["split"] == "heldout")["sample_id"]) != set(
        frame.filter(frame["split"] == "heldout")["sample_id"]
    )


def test_caps_limit_both_splits():
    frame, stats = build_instruction_table(_samples(100), 0.5, 7, 20, seed=0)
    assert (stats.heldout, stats.train, stats.train_available) == (7, 20, 93)
    assert frame.height == 27


def test_bad_fraction_and_empty_input_are_errors():
    with pytest.raises(ValueError, match="heldout_fraction"):
        build_instruction_table(_samples(3), 1.0, None, None, 0)
    with pytest.raises(ValueError, match="no samples"):
        build_instruction_table([], 0.1, None, None, 0)


@pytest.fixture(scope="module")
def stdlib_samples():
    return list(iter_stdlib_samples())


def test_stdlib_dataset_size_and_determinism(stdlib_samples):
    assert 3000 < len(stdlib_samples) < 9000
    ids = [s.sample_id for s in stdlib_samples]
    assert len(set(ids)) > 0.95 * len(ids)
    assert ids[:50] == [s.sample_id for s in list(iter_stdlib_samples())[:50]]


def test_stdlib_sample_points_at_its_function(stdlib_samples):
    s = next(
        x
        for x in stdlib_samples
        if x.source_file.endswith("/json/__init__.py") and "`dumps(" in x.prompt
    )
    line = Path(s.source_file).read_text().splitlines()[s.source_line - 1]
    assert line.startswith("def dumps(")
    assert s.response.startswith("def dumps(") and "separators" in s.prompt
    ast.parse(s.response)  # the response is the function's real source
    assert all(
        "/test" not in x.source_file and "idlelib" not in x.source_file for x in stdlib_samples
    )
    assert all(
        x.source_file.startswith(sys.base_prefix) or "lib" in x.source_file
        for x in stdlib_samples[:10]
    )


def test_source_fingerprint_follows_content_not_timestamps(tmp_path):
    import os

    from cluster_pipeline.data.datasets import source_fingerprint

    f = tmp_path / "d" / "a.jsonl"
    f.parent.mkdir()
    f.write_text('{"problem": "p", "solution": "s"}\n')
    first = source_fingerprint("d", tmp_path)
    os.utime(f, (1, 1))
    assert source_fingerprint("d", tmp_path) == first
    f.write_text('{"problem": "p", "solution": "t"}\n')
    assert source_fingerprint("d", tmp_path) != first


def test_eval_json_is_settings_not_data(tmp_path):
    import json

    from cluster_pipeline.data.formats import read_dataset_folder

    folder = tmp_path / "med"
    folder.mkdir()
    (folder / "eval.json").write_text(json.dumps({"benchmarks": ["mmlu_medical"]}))
    assert discover_datasets(tmp_path) == ["python_stdlib"]  # settings alone are no dataset
    (folder / "a.jsonl").write_text('{"instruction": "i", "output": "o"}\n')
    (folder / "sub").mkdir()
    (folder / "sub" / "eval.json").write_text('[{"problem": "p", "solution": "s"}]')
    assert discover_datasets(tmp_path) == ["python_stdlib", "med"]
    assert [s.prompt for s in read_dataset_folder(folder)] == ["i", "p"]


def test_every_partition_key_dagster_accepts_is_a_dataset(tmp_path):
    raw = tmp_path / "raw"
    for name in ["my data", "données", ".hidden", "python_stdlib", "a...b"]:
        (raw / name).mkdir(parents=True)
        (raw / name / "d.jsonl").write_text('{"problem": "a", "solution": "b"}\n')
    assert discover_datasets(raw) == ["python_stdlib", "données", "my data"]
    (raw / "empty").mkdir()
    (raw / "notes_only").mkdir()
    (raw / "notes_only" / "notes.txt").write_text("not data")
    (raw / ".cache").mkdir()  # hidden and empty: not a dataset, and no reason to say so
    no_data = (
        "holds no .json, .jsonl, .parquet, .arrow file (eval.json and fields.json are "
        "settings, not data); put the dataset's files there"
    )
    assert refused_datasets(raw) == {
        ".hidden": "hidden folders (name starting with '.') are not datasets",
        "a...b": "Dagster partition keys cannot contain '...'; rename the folder",
        "empty": f"{raw / 'empty'} {no_data}",
        "notes_only": f"{raw / 'notes_only'} {no_data}",
        "python_stdlib": "'python_stdlib' is the built-in dataset's name; rename the folder",
    }
    # The same rule as Dagster's own check (data/ does not import dagster, so it keeps a copy).
    from dagster._core.definitions.partitions.utils.base import (
        raise_error_on_invalid_partition_key_substring,
    )

    raise_error_on_invalid_partition_key_substring(discover_datasets(raw))
    with pytest.raises(dg.DagsterInvalidDefinitionError):
        raise_error_on_invalid_partition_key_substring(["a...b"])


def test_storage_names_are_plain_ascii_and_distinct():
    assert storage_name("med_v2.1") == "med_v2.1"
    assert storage_name("my data") == "my_data-b2167b0a"
    assert storage_name("données") == "donnees-a0831764"
    assert storage_name("my_data") != storage_name("my data")


def test_records_per_file_counts_each_source():
    samples = [
        Sample(f"p{i}", "r", "", "alpaca", "a.json" if i < 2 else "b.json", i) for i in range(5)
    ]
    _, stats = build_instruction_table(samples, 0.0, None, None, 0)
    assert stats.records_per_file == {"a.json": 2, "b.json": 3}


def test_folders_whose_data_files_hold_no_records_are_refused(tmp_path):
    raw = tmp_path / "raw"
    (raw / "blank").mkdir(parents=True)
    (raw / "blank" / "a.jsonl").write_bytes(b"")
    (raw / "blank" / "b.json").write_text("  \n\n")
    (raw / "blank" / "sub").mkdir()
    (raw / "blank" / "sub" / "c.json").write_bytes(b"\xef\xbb\xbf[]\n")
    (raw / "blank" / "sub" / "d.jsonl").write_text("\n")
    pl.DataFrame(schema={"text": pl.String}).write_parquet(raw / "blank" / "e.parquet")
    (raw / "one").mkdir()
    (raw / "one" / "a.jsonl").write_bytes(b"")
    (raw / "mixed").mkdir()
    (raw / "mixed" / "a.jsonl").write_bytes(b"")
    (raw / "mixed" / "b.jsonl").write_text('{"problem": "p", "solution": "s"}\n')
    (raw / ".hidden_blank").mkdir()
    (raw / ".hidden_blank" / "a.jsonl").write_bytes(b"")
    # A folder with one file that has records is a dataset (raw_instructions then names the
    # empty file); hidden folders without records say nothing.
    assert discover_datasets(raw) == ["python_stdlib", "mixed"]
    assert refused_datasets(raw) == {
        "blank": f"every data file in {raw / 'blank'} holds no records: a.jsonl (0 bytes), "
        "b.json (only whitespace), e.parquet (no rows) and 2 more; put the dataset's records "
        "there",
        "one": f"every data file in {raw / 'one'} holds no records: a.jsonl (0 bytes); put the "
        "dataset's records there",
    }


def test_dropped_turns_and_fields_are_summed_over_every_record_read():
    from cluster_pipeline.data.formats import normalise_record

    chat = {
        "id": 1,
        "conversations": [
            {"from": "human", "value": "Q"},
            {"from": "gpt", "value": "A"},
            {"from": "human", "value": "thanks"},
        ],
    }
    more = {
        "id": 2,
        "messages": [
            {"role": "user", "content": "Q2"},
            {"role": "assistant", "content": "A2"},
            {"role": "tool", "content": "t"},
            {"role": "user", "content": "u"},
        ],
    }
    samples = [
        normalise_record(r, "c.json", i)
        for i, r in enumerate([chat, chat, more, {"instruction": "I", "output": "O"}])
    ]
    frame, stats = build_instruction_table(samples, 0.0, None, None, 0)
    assert (stats.records, stats.duplicates, frame.height) == (4, 1, 3)
    assert stats.dropped_turns == {"after_last_assistant": 1 + 1 + 2}
    assert stats.dropped_fields == {"id": 3}
    assert frame["messages"].null_count() == 1  # only the Alpaca record was one exchange
    assert frame["tools"].null_count() == 3


def test_tools_are_a_column_and_keep_tool_only_differences_apart(tmp_path):
    from cluster_pipeline.data.datasets import read_instructions, samples_fingerprint
    from cluster_pipeline.data.formats import normalise_record
    from cluster_pipeline.storage.tables import write_table

    exchange = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    tools = [[{"name": f"f{i}", "parameters": {}}] for i in range(3)]
    samples = [
        normalise_record({"messages": exchange, "tools": t}, "t.jsonl", i + 1)
        for i, t in enumerate(tools)
    ] + [normalise_record({"messages": exchange}, "t.jsonl", 4)]
    frame, stats = build_instruction_table(samples, 0.0, None, None, 0)
    assert (frame.height, stats.duplicates) == (4, 0)
    assert frame["tools"].to_list() == [
        json.dumps([{"type": "function", "function": t[0]}]) for t in tools
    ] + [None]
    table = write_table(frame, str(tmp_path / "t"))
    got = read_instructions(table.uri, table.version, ["sample_id", "tools"])
    assert got["tools"].to_list() == frame["tools"].to_list()
    # A version written before the column existed reads it as null; the fingerprint of
    # samples without tools is what it was before the column existed.
    old = write_table(frame.drop("tools").tail(1), str(tmp_path / "old"))
    assert read_instructions(old.uri, old.version, ["tools"])["tools"].to_list() == [None]
    plain = {samples[3].sample_id}
    assert samples_fingerprint(old.uri, old.version, plain) == samples_fingerprint(
        table.uri, table.version, plain
    )


def test_tables_without_a_tools_column_read_it_as_null_and_keep_their_fingerprint(tmp_path):
    from cluster_pipeline.data.datasets import (
        TRAINING_COLUMNS,
        read_instructions,
        samples_fingerprint,
    )
    from cluster_pipeline.storage.cache import stable_hash
    from cluster_pipeline.storage.tables import write_table

    frame, _ = build_instruction_table(_samples(4), 0.0, None, None, 0)
    old = write_table(frame.drop("tools", strict=False), str(tmp_path / "old"))
    got = read_instructions(old.uri, old.version, ["sample_id", "tools"])
    assert got["tools"].to_list() == [None] * 4 and got.height == 4
    assert read_instructions(old.uri, old.version, ["tools"]).height == 4
    # The hash the checkpoint cache was keyed by before tools existed: the rows without it.
    before = frame.select([c for c in TRAINING_COLUMNS if c != "tools"]).sort("sample_id").rows()
    ids = set(frame["sample_id"])
    assert samples_fingerprint(old.uri, old.version, ids) == stable_hash(before)


@pytest.mark.parametrize(("n", "fraction", "held"), [(1, 0.1, 1), (3, 0.9, 3), (2, 0.5, 1)])
def test_a_pool_too_small_for_its_held_out_split_says_what_to_do(n, fraction, held):
    if n - held > 0:  # (2, 0.5): one sample left to train on; not an error
        frame, stats = build_instruction_table(_samples(n), fraction, None, None, seed=0)
        assert (stats.train, stats.heldout) == (n - held, held)
        return
    with pytest.raises(ValueError) as e:
        build_instruction_table(_samples(n), fraction, None, None, seed=0)
    assert str(e.value) == (
        f"no training samples left: {n} distinct sample(s), all {held} held out "
        f"(heldout_fraction {fraction} of {n}, rounded up); add samples, or set "
        "raw_instructions.heldout_fraction: 0 (or a smaller max_heldout)"
    )


# --- The license a source declares (source_license) ----------------------------------------


def _folder(tmp_path: Path, files: dict[str, str]) -> Path:
    folder = tmp_path / "raw" / "my set"
    folder.mkdir(parents=True)
    (folder / "a.jsonl").write_text('{"instruction": "q", "output": "a"}\n')
    for name, text in files.items():
        (folder / name).write_text(text)
    return tmp_path / "raw"


@pytest.mark.parametrize(
    "files, expected",
    [
        # The card's front matter: its license as written, nothing to ship.
        (
            {"README.md": "---\nlicense: cc-by-4.0\n---\n# My set\n"},
            ("cc-by-4.0", None, None, None),
        ),
        # A list of ids, and a custom license whose link names a file of the folder: shipped.
        (
            {
                "README.md": "---\nlicense: other\nlicense_name: acme-1.0\nlicense_link: "
                "TERMS.md\npretty_name: x\n---\n",
                "TERMS.md": "terms",
            },
            ("other", "acme-1.0", "TERMS.md", "TERMS.md"),
        ),
        (
            {"README.md": "---\nlicense: [mit, apache-2.0]\n---\n"},
            (["mit", "apache-2.0"], None, None, None),
        ),
        # The front matter wins; the license file still travels with the data.
        (
            {"README.md": "---\nlicense: mit\n---\n", "LICENSE": "MIT License\n"},
            ("mit", None, None, "LICENSE"),
        ),
        # A license file alone: `other`, named after the dataset, linked and shipped.
        (
            {"LICENSE.txt": "Terms"},
            ("other", "my-set-35db3f19-license", "LICENSE.txt", "LICENSE.txt"),
        ),
        # A card without front matter or without a license key declares nothing.
        ({"README.md": "# My set\nlicense: mit\n"}, None),
        ({"README.md": "---\npretty_name: x\n---\n"}, None),
        ({}, None),
    ],
)
def test_source_license_follows_the_documented_rule(tmp_path, files, expected):
    from cluster_pipeline.data.datasets import source_license

    raw = _folder(tmp_path, files)
    found = source_license("my set", raw)
    if expected is None:
        assert found is None
        return
    assert found is not None
    shipped = found.file.relative_to(raw / "my set").as_posix() if found.file else None
    assert (found.license, found.license_name, found.license_link, shipped) == expected
    assert str(raw / "my set") in found.declared_by


def test_the_builtin_dataset_is_under_the_psf_license(tmp_path):
    from cluster_pipeline.data.datasets import source_license

    found = source_license("python_stdlib", tmp_path)
    assert found is not None
    assert (found.license, found.license_name) == ("other", "psf-2.0")


_FORMS = (
    "write a Hub license id (e.g. mit, apache-2.0, cc-by-4.0; the Hub's list is in "
    "cluster_pipeline/data/licenses.py), a list of them, or `license: other` with "
    "`license_name:` (an id of your own, e.g. acme-1.0) and `license_link:` (a URL, or a file of "
    "the dataset folder such as LICENSE)"
)


@pytest.mark.parametrize(
    "card, message",
    [
        ("---\nlicense: mit\n# never closed\n", "is never closed; end it with a line '---'"),
        ("---\n- mit\n---\n", "must be a mapping (key: value lines), got a list"),
        ("---\nlicense: [mit\n---\n", "is not valid YAML"),
        # YAML errors give the file's line: the front matter starts on line 2.
        ("---\nlicense: [mit\n---\n", 'README.md", line 2, column 10:\n    license: [mit'),
        ("---\npretty_name: x\nlicense: mit\n  bad: 1\n---\n", 'README.md", line 4, column 6:'),
        ("---\nlicense: 3\n---\n", f"line 2: 'license' must be a Hub license id, got 3; {_FORMS}"),
        (
            "---\npretty_name: x\nlicense: totally-made-up\n---\n",
            f"line 3: license 'totally-made-up' is not a license id the Hub accepts; {_FORMS}",
        ),
        (
            "---\nlicense: [mit, CC-BY-4.0]\n---\n",
            "line 2: license 'CC-BY-4.0' is not a license id the Hub accepts (did you mean "
            f"'cc-by-4.0'?); {_FORMS}",
        ),
        (
            "---\nlicense: other\n---\n",
            "line 2: `license: other` needs license_name and license_link beside it (the Hub "
            f"refuses it without them); {_FORMS}",
        ),
        (
            "---\nlicense_name: acme\nlicense: other\nlicense_link: ''\n---\n",
            "line 3: `license: other` needs license_link beside it",
        ),
        ("---\nlicense: []\n---\n", "line 2: 'license' must be a Hub license id, got []"),
    ],
)
def test_a_malformed_card_is_refused_naming_it(tmp_path, card, message):
    from cluster_pipeline.data.datasets import source_license

    raw = _folder(tmp_path, {"README.md": card})
    with pytest.raises(ValueError) as e:
        source_license("my set", raw)
    assert str(e.value).startswith(f"{raw / 'my set' / 'README.md'}")
    assert message in str(e.value)


def test_every_hub_license_id_is_accepted(tmp_path):
    from cluster_pipeline.data.datasets import source_license
    from cluster_pipeline.data.licenses import HUB_LICENSES

    # The Hub's table (hub-docs at 242f4a1): 83 ids, lower case, `other` among them.
    assert len(HUB_LICENSES) == len(set(HUB_LICENSES)) == 83
    assert {"mit", "apache-2.0", "cc-by-4.0", "llama3.1", "unknown", "other"} <= set(HUB_LICENSES)
    raw = _folder(tmp_path, {})
    card = raw / "my set" / "README.md"
    for license in HUB_LICENSES:
        extra = "license_name: acme-1.0\nlicense_link: LICENSE\n" if license == "other" else ""
        card.write_text(f"---\nlicense: {license}\n{extra}---\n")
        found = source_license("my set", raw)
        assert found is not None and found.license == license


def test_card_and_license_file_are_not_samples(tmp_path):
    from cluster_pipeline.data.formats import ignored_files

    raw = _folder(tmp_path, {"README.md": "---\nlicense: mit\n---\n", "LICENSE": "MIT"})
    samples = list(load_samples("my set", raw))
    assert [(Path(s.source_file).name, s.response) for s in samples] == [("a.jsonl", "a")]
    assert ignored_files(raw / "my set") == []

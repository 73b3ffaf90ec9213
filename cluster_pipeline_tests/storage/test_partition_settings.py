"""The settings file of a dataset partition: what a launch sets, what it changes, who set each
knob, and a damaged file named with what to do."""

import datetime as dt
import json

import pytest

from cluster_pipeline.storage.layout import DataLayout
from cluster_pipeline.storage.partition_settings import (
    PartitionSettings,
    SettingsUnreadable,
    read_partition_settings,
    write_partition_settings,
)

AT = dt.datetime(2026, 12, 1, 12, 0, 3, tzinfo=dt.UTC)
LATER = dt.datetime(2026, 12, 2, 8, 30, 0, tzinfo=dt.UTC)


def test_an_absent_file_is_empty_settings(tmp_path):
    settings = read_partition_settings(tmp_path / "none.json", "tiny")
    assert settings == PartitionSettings("tiny")
    assert settings.knobs("proxy_embeddings") == {}
    assert settings.origin("proxy_embeddings", "max_length") == ""


def test_a_launch_sets_its_knobs_and_says_what_changed(tmp_path):
    first, changes = PartitionSettings("tiny").with_launch(
        {"proxy_embeddings": {"max_length": 512, "bf16": False}}, "run-aaaaaaaa-1", AT
    )
    assert [c.describe() for c in changes] == [
        "proxy_embeddings.bf16: (default) -> false",
        "proxy_embeddings.max_length: (default) -> 512",
    ]
    # A later launch: one knob again with its value (no change, first origin kept), one new
    # value, one new stage.
    second, changes = first.with_launch(
        {
            "proxy_embeddings": {"max_length": 512, "bf16": True},
            "balanced_clusters": {"num_clusters": 4},
        },
        "run-bbbbbbbb-2",
        LATER,
    )
    assert [c.describe() for c in changes] == [
        "balanced_clusters.num_clusters: (default) -> 4",
        "proxy_embeddings.bf16: false -> true",
    ]
    assert second.knobs("proxy_embeddings") == {"max_length": 512, "bf16": True}
    assert second.origin("proxy_embeddings", "max_length") == "run run-aaaa"
    assert second.origin("proxy_embeddings", "bf16") == "run run-bbbb"
    assert second.origins["proxy_embeddings"]["bf16"]["at"] == "2026-12-02T08:30:00+00:00"
    # The earlier settings are untouched (a value, not a view).
    assert first.knobs("proxy_embeddings") == {"max_length": 512, "bf16": False}

    path = DataLayout.at(tmp_path).partition_settings("my data")
    assert path == tmp_path.resolve() / "settings" / "my_data-b2167b0a.json"
    write_partition_settings(path, second)
    assert read_partition_settings(path, "my data") == PartitionSettings(
        "my data", second.stages, second.origins
    )
    assert json.loads(path.read_text())["stages"] == {
        "balanced_clusters": {"num_clusters": 4},
        "proxy_embeddings": {"bf16": True, "max_length": 512},
    }


def test_an_env_source_is_kept_as_given():
    settings, changes = PartitionSettings("tiny").with_launch(
        {"proxy_embeddings": {"max_length": {"env": "MAX_LEN"}}}, "r", AT
    )
    assert settings.knobs("proxy_embeddings") == {"max_length": {"env": "MAX_LEN"}}
    assert [c.describe() for c in changes] == [
        'proxy_embeddings.max_length: (default) -> {"env": "MAX_LEN"}'
    ]


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        "[1, 2]",
        '{"stages": [], "origins": {}}',
        '{"stages": {"proxy_embeddings": 3}, "origins": {}}',
        '{"stages": {}, "origins": {"x": "y"}}',
    ],
)
def test_a_damaged_file_is_named_with_what_to_do(tmp_path, text):
    path = tmp_path / "tiny.json"
    path.write_text(text)
    with pytest.raises(SettingsUnreadable) as e:
        read_partition_settings(path, "tiny")
    assert str(e.value) == (
        f"{path}: not a settings file of dataset 'tiny' (JSON with 'stages' and 'origins' "
        "mappings); fix it, or delete it to run with the stages' defaults (the next launch "
        "with a run config writes it again)"
    )


def test_a_refused_run_gives_back_what_it_set():
    """A run whose settings a step refused takes back what its launch recorded: a knob it
    changed returns to the value it replaced, with that value's origin; a knob no launch had
    given is unset again; knobs of other runs stay."""
    first, _ = PartitionSettings("tiny").with_launch(
        {"proxy_embeddings": {"max_length": 512}, "balanced_clusters": {"seed": 3}},
        "run-aaaaaaaa-1",
        AT,
    )
    second, _ = first.with_launch(
        {
            "proxy_embeddings": {"max_length": 256},
            "balanced_clusters": {"num_clusters": 100, "seed": 3},  # seed: the same value
        },
        "run-bbbbbbbb-2",
        LATER,
    )
    back, changes = second.without_run("run-bbbbbbbb-2")
    assert [c.describe() for c in changes] == [
        "balanced_clusters.num_clusters: 100 -> (default)",
        "proxy_embeddings.max_length: 256 -> 512",
    ]
    assert back == first
    assert back.origin("proxy_embeddings", "max_length") == "run run-aaaa"
    # The file keeps what each value replaced, and when that was given.
    assert second.origins["proxy_embeddings"]["max_length"]["replaced"] == {
        "value": 512,
        "run_id": "run-aaaaaaaa-1",
        "at": "2026-12-01T12:00:03+00:00",  # AT
    }
    # A run that set nothing gives back nothing; the first launch's own knobs go entirely.
    assert second.without_run("run-cccccccc-3") == (second, [])
    empty, changes = first.without_run("run-aaaaaaaa-1")
    assert empty == PartitionSettings("tiny") and len(changes) == 2

"""Operating the pipeline: partitions that appear, the nightly refresh, lineage, subset versions."""

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import dagster as dg
import polars as pl
import pytest

from cluster_pipeline.defs.assets.sample_lineage import sample_lineage
from cluster_pipeline.defs.partitions import DATASETS
from cluster_pipeline.defs.resources import StorageResource
from cluster_pipeline.defs.schedules import changed_datasets, nightly_selection_refresh
from cluster_pipeline.defs.sensors import dataset_folders_sensor
from cluster_pipeline_tests.helpers import (
    materialize_partition,
    meta,
    pipeline_assets,
    read,
    resources,
    run_config_for,
    seed_embeddings,
    step_failure,
    tiny_records,
    write_jsonl,
)

ASSETS = pipeline_assets()


def lineage_main(args: list[str]) -> None:
    from cluster_pipeline.cli.main import main

    main(["lineage", *args])


def test_sensor_adds_new_dataset_folders_and_deletes_nothing(tmp_path):
    data = tmp_path / "data"
    write_jsonl(data / "raw" / "med" / "a.jsonl", tiny_records(3))
    storage = StorageResource(data_dir=str(data))
    with dg.instance_for_test() as instance:
        ctx = dg.build_sensor_context(instance=instance, resources={"storage": storage})
        result = dataset_folders_sensor(ctx)
        assert isinstance(result, dg.SensorResult) and result.dynamic_partitions_requests
        assert result.dynamic_partitions_requests[0].partition_keys == ["python_stdlib", "med"]
        instance.add_dynamic_partitions("datasets", ["python_stdlib", "med"])
        assert isinstance(dataset_folders_sensor(ctx), dg.SkipReason)
        (data / "raw" / "med" / "a.jsonl").unlink()
        (data / "raw" / "med").rmdir()
        assert isinstance(dataset_folders_sensor(ctx), dg.SkipReason)
        assert set(instance.get_dynamic_partitions("datasets")) == {"python_stdlib", "med"}


def test_datasets_cli_refuses_an_unknown_dataset(tmp_path):
    env = {"DAGSTER_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    (tmp_path / "data" / "raw").mkdir(parents=True)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "cluster_pipeline.cli",
            "datasets",
            "sync",
            "--require",
            "nosuch",
            "--data-dir",
            str(tmp_path / "data"),
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert out.returncode == 2
    assert (
        out.stderr.startswith("cluster-pipeline datasets: error: dataset 'nosuch' not found")
        and "python_stdlib" in out.stderr
    )


def _datasets_cli(home: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cluster_pipeline.cli", "datasets", *args],
        capture_output=True,
        text=True,
        env={"DAGSTER_HOME": str(home), "PATH": "/usr/bin:/bin"},
    )


def test_folder_names_with_spaces_and_accents_are_datasets(tmp_path):
    data = tmp_path / "data"
    write_jsonl(data / "raw" / "my data" / "a.jsonl", tiny_records(3))
    write_jsonl(data / "raw" / "données" / "b.jsonl", tiny_records(4))
    write_jsonl(data / "raw" / ".hidden" / "c.jsonl", tiny_records(2))
    d = ["--data-dir", str(data)]
    out = _datasets_cli(tmp_path, "sync", "--require", "my data", *d)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "registered new dataset partitions: python_stdlib, données, my data\n"
    assert "skipping data/raw/.hidden/: hidden folders" in out.stderr
    refused = _datasets_cli(tmp_path, "sync", "--require", ".hidden", *d)
    assert refused.returncode == 2
    assert "dataset '.hidden' cannot be registered: hidden folders" in refused.stderr
    (data / "raw" / "my data" / "a.jsonl").unlink()
    (data / "raw" / "my data").rmdir()
    listed = _datasets_cli(tmp_path, "list", *d).stdout.splitlines()
    assert listed == [
        "python_stdlib\tregistered",
        "données\tregistered",
        f"my data\tregistered, but its folder {data / 'raw' / 'my data'} is gone (its tables stay)",
        ".hidden\trefused: hidden folders (name starting with '.') are not datasets",
    ]


def test_raw_instructions_of_an_accented_dataset_counts_records_per_file(tmp_path):
    from cluster_pipeline.defs.assets.raw_instructions import raw_instructions

    data = tmp_path / "data"
    write_jsonl(data / "raw" / "données" / "a.jsonl", tiny_records(7)[:3])
    write_jsonl(data / "raw" / "données" / "sub" / "b.jsonl", tiny_records(7)[3:])
    res = {"storage": StorageResource(data_dir=str(data))}
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(DATASETS, ["données"])
        assert materialize_partition([raw_instructions], instance, res, partition="données").success
        assert meta(instance, "raw_instructions", "données")["records_per_file"] == {
            "a.jsonl": 3,
            "sub/b.jsonl": 4,
        }
        table = pl.read_delta(
            StorageResource(data_dir=str(data)).layout.table_uri("raw_instructions", "données")
        )
        assert table.height == 7
        assert (data / "tables" / "raw_instructions" / "donnees-a0831764").is_dir()


def _cli(home: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cluster_pipeline.cli", *args],
        capture_output=True,
        text=True,
        env={"DAGSTER_HOME": str(home), "PATH": "/usr/bin:/bin"},
    )


def test_cli_user_errors_are_one_line_and_status_2(tmp_path):
    from cluster_pipeline.defs.assets.raw_instructions import raw_instructions

    data = tmp_path / "data"
    write_jsonl(data / "raw" / "tiny" / "a.jsonl", tiny_records(10))
    (data / "raw" / "empty").mkdir()
    (data / "raw" / "empty" / "eval.json").write_text('{"benchmarks": []}')
    d = ["--data-dir", str(data)]
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(DATASETS, ["tiny"])
        res = {"storage": StorageResource(data_dir=str(data))}
        assert materialize_partition([raw_instructions], instance, res).success
    cases = {
        ("datasets", "sync", "--require", "empty", *d): (
            "cluster-pipeline datasets: error: dataset 'empty' cannot be registered: "
            f"{data / 'raw' / 'empty'} holds "
            "no .json, .jsonl, .parquet, .arrow file (eval.json and fields.json are settings, "
            "not data); put the dataset's files there.\n"
        ),
        ("lineage", "nosuch", "abc", *d): (
            f"cluster-pipeline lineage: error: dataset 'nosuch' has no tables under "
            f"{data / 'tables'}: it does not exist or was never materialized. Datasets with "
            "tables: tiny\n"
        ),
        ("lineage", "tiny", "0123456789abcdef", *d): (
            "cluster-pipeline lineage: error: sample_id(s) not in dataset 'tiny': "
            "0123456789abcdef\n"
        ),
        ("lineage", "tiny", "--diff", "0", "1", *d): (
            "cluster-pipeline lineage: error: no peripheral_subsets table for dataset 'tiny' at "
            f"{data / 'tables' / 'peripheral_subsets' / 'tiny'}\n"
        ),
    }
    for args, message in cases.items():
        out = _cli(tmp_path, *args)
        assert (out.returncode, out.stderr) == (2, message), args
    for f in (data / "tables" / "raw_instructions" / "tiny").glob("*.parquet"):
        f.unlink()
    gone = _cli(tmp_path, "lineage", "tiny", "0123456789abcdef", *d)
    assert gone.returncode == 2 and "Traceback" not in gone.stderr
    assert gone.stderr.startswith("cluster-pipeline lineage: error: raw_instructions table ")
    assert "lists data files that are gone" in gone.stderr
    assert gone.stderr.endswith("re-materialize raw_instructions for 'tiny'\n")


@pytest.mark.slow
def test_schedule_lineage_and_subset_versions(
    tiny_data_dir, tiny_model_dir, tiny_embedding_cache, capsys
):
    seed_embeddings(tiny_embedding_cache, tiny_data_dir)
    storage = StorageResource(data_dir=str(tiny_data_dir))
    res = resources(tiny_data_dir, tiny_model_dir)
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(DATASETS, ["tiny", "python_stdlib"])
        # Never materialized: both datasets count as changed.
        assert set(changed_datasets(instance, storage)) == {"tiny", "python_stdlib"}
        # Through training (sample_lineage reads the checkpoints; nothing here reads a report).
        trained = [*ASSETS[:6], sample_lineage]
        assert materialize_partition(
            trained, instance, res, run_config=run_config_for(trained)
        ).success
        assert set(changed_datasets(instance, storage)) == {"python_stdlib"}
        requests = nightly_selection_refresh(
            dg.build_schedule_context(instance=instance, resources={"storage": storage})
        )
        assert isinstance(requests, list)
        assert [r.partition_key for r in requests] == ["python_stdlib"]
        write_jsonl(tiny_data_dir / "raw" / "tiny" / "more.jsonl", tiny_records(2))
        assert set(changed_datasets(instance, storage)) == {"tiny", "python_stdlib"}

        # The lineage table: every trained sample traces back to its source line.
        lineage = read(instance, "sample_lineage")
        assert lineage.height == 60
        trained = lineage.filter(pl.col("checkpoints").list.len() > 0)
        shards = read(instance, "shard_manifests")
        assert set(trained["sample_id"]) == set(shards["sample_id"])
        row = trained.row(0, named=True)
        source = Path(row["source_file"]).read_text().splitlines()[row["source_line"] - 1]
        raw = read(instance, "raw_instructions").filter(pl.col("sample_id") == row["sample_id"])
        assert json.loads(source)["output"] == raw["response"].item()
        ckpt = meta(instance, "trained_checkpoint")["checkpoint_path"]
        assert row["checkpoints"] == [str(ckpt)] and row["selected"] and row["weight"] > 0

        lineage_main(["tiny", row["sample_id"], "--data-dir", str(tiny_data_dir), "--json"])
        printed = json.loads(capsys.readouterr().out.strip())
        assert printed["source_line"] == row["source_line"] and printed["rank"] == row["rank"]
        lineage_main(["tiny", "--selected", "--data-dir", str(tiny_data_dir), "--json"])
        assert len(capsys.readouterr().out.strip().splitlines()) == trained.height

        # Re-selecting with other knobs keeps the trained-on subset readable.
        subsets_v0 = int(meta(instance, "peripheral_subsets")["table_version"])
        shard_dir = Path(meta(instance, "shard_manifests")["manifest_paths"][0]).parent
        cfg = {"ops": {"peripheral_subsets": {"config": {"ratio": 0.25}}}}
        assert materialize_partition([ASSETS[3], ASSETS[4]], instance, res, run_config=cfg).success
        subsets_v1 = int(meta(instance, "peripheral_subsets")["table_version"])
        assert subsets_v1 == subsets_v0 + 1
        assert (
            shard_dir.exists()
            and Path(meta(instance, "shard_manifests")["manifest_paths"][0]).parent != shard_dir
        )
        info = json.loads((Path(str(ckpt)) / "training_info.json").read_text())
        from cluster_pipeline.selection.sharding import ShardManifest

        assert [ShardManifest.read(Path(m["path"])).sha256 for m in info["manifests"]] == [
            m["sha256"] for m in info["manifests"]
        ]
        lineage_main(
            [
                "tiny",
                "--diff",
                str(subsets_v0),
                str(subsets_v1),
                "--data-dir",
                str(tiny_data_dir),
                "--json",
            ]
        )
        diff = json.loads(capsys.readouterr().out)
        old = pl.read_delta(
            str(tiny_data_dir / "tables/peripheral_subsets/tiny"), version=subsets_v0
        )
        new = pl.read_delta(
            str(tiny_data_dir / "tables/peripheral_subsets/tiny"), version=subsets_v1
        )
        assert len(diff["left"]) == int(old["selected"].sum()) - int(new["selected"].sum()) > 0
        assert diff["entered"] == []


def test_automation_follows_parents_but_never_trains(tiny_data_dir):
    from cluster_pipeline.definitions import defs
    from cluster_pipeline.defs.assets.raw_instructions import raw_instructions

    definitions = defs()
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(DATASETS, ["tiny"])
        first = dg.evaluate_automation_conditions(defs=definitions, instance=instance)
        assert first.total_requested == 0  # nothing upstream yet
        assert materialize_partition(
            [raw_instructions], instance, {"storage": StorageResource(data_dir=str(tiny_data_dir))}
        ).success
        result = dg.evaluate_automation_conditions(
            defs=definitions, instance=instance, cursor=first.cursor
        )
        requested = {
            k.to_user_string(): result.get_requested_partitions(k)
            for k in (
                dg.AssetKey(a) for a in ("proxy_embeddings", "trained_checkpoint", "eval_report")
            )
        }
        assert requested["proxy_embeddings"] == {"tiny"}
        assert requested["trained_checkpoint"] == set() and requested["eval_report"] == set()


def test_a_bad_eval_json_fails_raw_instructions_and_keeps_earlier_tables(tiny_data_dir):
    from cluster_pipeline.defs.assets.raw_instructions import raw_instructions

    res = {"storage": StorageResource(data_dir=str(tiny_data_dir))}
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(DATASETS, ["tiny"])
        assert materialize_partition([raw_instructions], instance, res).success
        before = read(instance, "raw_instructions")
        (tiny_data_dir / "raw" / "tiny" / "eval.json").write_text('{"benchmarks": ["gsm8k"]}')
        failed = materialize_partition([raw_instructions], instance, res, raise_on_error=False)
        assert not failed.success
        assert "eval.json: unknown benchmarks ['gsm8k']" in step_failure(failed)[0]
        assert read(instance, "raw_instructions").equals(before)
        (tiny_data_dir / "raw" / "tiny" / "eval.json").write_text(
            '{"benchmarks": ["mmlu_medical"]}'
        )
        assert materialize_partition([raw_instructions], instance, res).success
        assert meta(instance, "raw_instructions")["benchmarks"] == ["mmlu_medical"]
        assert read(instance, "raw_instructions").height == 60


def test_instance_settings_queue_one_run_per_partition_and_monitor_runs(tmp_path):
    """The settings `make` and the datasets CLI install: Dagster's own run-queue rule, fed
    the project's limits, holds a second run of a partition while the first is in progress and
    lets another partition's run through; run monitoring is on."""
    from dagster._core.run_coordinator import QueuedRunCoordinator
    from dagster._utils.tags import TagConcurrencyLimitsCounter

    out = _cli(tmp_path / "home", "datasets", "list", "--data-dir", str(tmp_path / "data"))
    assert out.returncode == 0, out.stderr
    with dg.DagsterInstance.from_config(str(tmp_path / "home")) as instance:
        assert instance.run_monitoring_enabled
        coordinator = instance.run_coordinator
        assert isinstance(coordinator, QueuedRunCoordinator)
        limits = coordinator.get_run_queue_config().tag_concurrency_limits
        running = dg.DagsterRun(job_name="g", tags={"dagster/partition": "med"})
        same = dg.DagsterRun(job_name="g", tags={"dagster/partition": "med"})
        other = dg.DagsterRun(job_name="g", tags={"dagster/partition": "code"})
        counter = TagConcurrencyLimitsCounter(limits, [running])
        assert counter.is_blocked(same) and not counter.is_blocked(other)


@contextlib.contextmanager
def _materialized_raw(data: Path, name: str):
    """(instance, result) of materializing raw_instructions for ``name`` (failures kept)."""
    from cluster_pipeline.defs.assets.raw_instructions import raw_instructions

    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(DATASETS, [name])
        yield (
            instance,
            materialize_partition(
                [raw_instructions],
                instance,
                {"storage": StorageResource(data_dir=str(data))},
                partition=name,
                raise_on_error=False,
            ),
        )


def test_raw_instructions_counts_what_the_reader_did_not_keep_and_keeps_tools(tmp_path):
    data = tmp_path / "data"
    tools = json.dumps([{"name": "area", "parameters": {"type": "object"}}])
    chats = [
        {
            "id": i,
            "conversations": [
                {"from": "human", "value": f"Area of square {i}?"},
                {
                    "from": "function_call",
                    "value": f'{{"name": "area", "arguments": {{"s": {i}}}}}',
                },
                {"from": "observation", "value": str(i * i)},
                {"from": "gpt", "value": f"{i * i}."},
                {"from": "human", "value": "Thanks!"},  # after the last answer
            ],
            "tools": tools,
        }
        for i in range(3)
    ]
    write_jsonl(data / "raw" / "tools" / "glaive.jsonl", chats + tiny_records(5))
    with _materialized_raw(data, "tools") as (instance, result):
        assert result.success
        m = meta(instance, "raw_instructions", "tools")
        assert m["dropped_turns"] == {"after_last_assistant": 3}
        assert m["dropped_fields"] == {"id": 3}
        assert m["samples_with_tools"] == 3
        table = read(instance, "raw_instructions", "tools")
        with_tools = table.filter(pl.col("tools").is_not_null()).sort("source_line")
        assert with_tools["source_line"].to_list() == [1, 2, 3]
        assert json.loads(with_tools["tools"][0]) == [
            {"type": "function", "function": json.loads(tools)[0]}
        ]
        assert [m["role"] for m in json.loads(with_tools["messages"][0])] == [
            "user",
            "assistant",
            "tool",
            "assistant",
        ]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        pytest.param(
            '{"conversations": [{"from": "gpt", "value": "Hi!"}, {"from": "human", "value": "Q"}'
            ', {"from": "gpt", "value": "A"}]}\n',
            "{file}:2: the sharegpt record opens with an assistant turn (turn 0), before any user "
            "turn: there is no question for it to answer, and chat templates render an answer "
            "only after one. Remove the leading assistant turn(s), or put the user turn first.",
            id="assistant_first",
        ),
        pytest.param(
            '{"instruction": "Say hi \\ud800", "output": "hi"}\n',
            "{file}:2:25: the string holds \\ud800, an unpaired UTF-16 surrogate that UTF-8 "
            "cannot store (half of a character outside the Basic Multilingual Plane, such as an "
            "emoji cut in two). Re-encode the file from its source, or replace the escape with "
            "the whole character (a high surrogate \\ud800-\\udbff followed by a low one "
            "\\udc00-\\udfff) or delete it.",
            id="lone_surrogate",
        ),
    ],
)
def test_raw_instructions_refuses_bad_records_naming_file_and_line(tmp_path, content, message):
    data = tmp_path / "data"
    path = data / "raw" / "bad" / "a.jsonl"
    write_jsonl(path, tiny_records(1))
    path.write_text(path.read_text() + content)
    with _materialized_raw(data, "bad") as (_, result):
        assert not result.success
        assert step_failure(result)[0] == "dataset 'bad': " + message.format(file=path)


def test_raw_instructions_names_an_empty_file_beside_good_ones(tmp_path):
    data = tmp_path / "data"
    write_jsonl(data / "raw" / "mixed" / "a.jsonl", tiny_records(4))
    (data / "raw" / "mixed" / "b.json").write_text("\n  \n")
    with _materialized_raw(data, "mixed") as (_, result):
        assert not result.success
        assert step_failure(result)[0] == (
            f"dataset 'mixed': {data / 'raw' / 'mixed' / 'b.json'}: holds no records (only "
            "whitespace); remove the file or put the dataset's records in it."
        )


def test_a_folder_of_empty_files_is_never_a_partition(tmp_path):
    data = tmp_path / "data"
    (data / "raw" / "blank").mkdir(parents=True)
    (data / "raw" / "blank" / "a.jsonl").write_bytes(b"")
    (data / "raw" / "blank" / "b.json").write_text("[]\n")
    write_jsonl(data / "raw" / "good" / "a.jsonl", tiny_records(2))
    reason = (
        f"every data file in {data / 'raw' / 'blank'} holds no records: a.jsonl (0 bytes), "
        "b.json (only an empty JSON array); put the dataset's records there"
    )
    storage = StorageResource(data_dir=str(data))
    with dg.instance_for_test() as instance:
        ctx = dg.build_sensor_context(instance=instance, resources={"storage": storage})
        result = dataset_folders_sensor(ctx)
        assert isinstance(result, dg.SensorResult) and result.dynamic_partitions_requests
        assert result.dynamic_partitions_requests[0].partition_keys == ["python_stdlib", "good"]
    d = ["--data-dir", str(data)]
    required = _datasets_cli(tmp_path, "sync", "--require", "blank", *d)
    assert (required.returncode, required.stderr) == (
        2,
        f"cluster-pipeline datasets: error: dataset 'blank' cannot be registered: {reason}.\n",
    )
    synced = _datasets_cli(tmp_path, "sync", *d)
    assert synced.returncode == 0
    assert synced.stdout == "registered new dataset partitions: python_stdlib, good\n"
    assert synced.stderr == f"skipping data/raw/blank/: {reason}\n"
    listed = _datasets_cli(tmp_path, "list", *d).stdout.splitlines()
    assert listed == [
        "python_stdlib\tregistered",
        "good\tregistered",
        f"blank\trefused: {reason}",
    ]


def test_files_in_no_read_format_are_named_in_the_metadata(tiny_data_dir):
    from cluster_pipeline.defs.assets.raw_instructions import raw_instructions

    (tiny_data_dir / "raw" / "tiny" / "notes.txt").write_text("not data")
    (tiny_data_dir / "raw" / "tiny" / "extra.csv").write_text("a,b\n1,2\n")
    res = {"storage": StorageResource(data_dir=str(tiny_data_dir))}
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(DATASETS, ["tiny"])
        assert materialize_partition([raw_instructions], instance, res).success
        found = meta(instance, "raw_instructions")
        assert found["files_not_read"] == ["extra.csv", "notes.txt"]
        assert found["records_read"] == 60

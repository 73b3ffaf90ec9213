"""One source of settings per dataset partition: every way a run of a partition starts uses the
knobs its launch gives over the ones the partition was last launched with, never the schema
defaults behind the user's back (issue 43).

The kind, "a launch that gives no value for a knob": the automation sensor's run and the UI's
*Materialize* (run config ``{}``), the nightly schedule's ``selection_job`` run (its profile is
the default one: no knob stated), ``dagster asset materialize`` without ``-c``, and a
re-execution (its parent's run config again). Against them: a launch that gives the knob (a
config file, the launchpad, ``make run``'s profile config), a job of another size profile
(``main_job_gpu8`` states its sizes), and the one-shot knobs (``recompute``, ``retrain``),
which act on their run only. The real sequence (a CLI re-read, the sensor, a re-execution,
through ``dagster``) is tests in test_settings_kept_e2e.py."""

import dagster as dg
import pytest

from cluster_pipeline.defs.configs import BalancedClustersConfig, ProxyEmbeddingsConfig
from cluster_pipeline.defs.partition_settings import (
    effective_ops,
    effective_run_config,
    launched_knobs,
    remember,
    run_settings_line,
    stored_settings,
)
from cluster_pipeline.defs.partitions import DATASETS
from cluster_pipeline.defs.resources import StorageResource
from cluster_pipeline.defs.run_checks import ConfigRefused, check_stages
from cluster_pipeline.defs.stages import stage_asset
from cluster_pipeline.storage.layout import DataLayout
from cluster_pipeline.storage.partition_settings import (
    PartitionSettings,
    SettingsUnreadable,
    read_partition_settings,
    write_partition_settings,
)

# What a user launched the partition with (as storage/partition_settings.py keeps it); a
# one-shot knob that an older file might hold is never taken.
STORED = {
    "proxy_embeddings": {"max_length": 512, "bf16": True, "recompute": True},
    "balanced_clusters": {"num_clusters": 4, "seed": 7},
}
GPU8 = {"cluster_pipeline/profile": "gpu8"}
DEFAULT_JOB = {"cluster_pipeline/profile": "cpu_quick", "cluster_pipeline/job": "selection_job"}


def _stored(data) -> PartitionSettings:
    settings, _ = PartitionSettings("tiny").with_launch(STORED, "1a2b3c4d-aaaa")
    write_partition_settings(DataLayout.at(data).partition_settings("tiny"), settings)
    return settings


def _config(stage: str, **knobs) -> dict:
    return {"ops": {stage: {"config": knobs}}}


@pytest.mark.parametrize(
    ("run_config", "tags", "expected"),
    [
        # The sensor, the UI's Materialize, `dagster asset materialize` without -c.
        ({}, {}, {}),
        # The nightly schedule: selection_job, whose profile is the default.
        ({}, DEFAULT_JOB, {}),
        # A config file or the launchpad: what it gives, one-shot knobs included.
        (
            _config("proxy_embeddings", max_length=128, recompute=True),
            {},
            {"proxy_embeddings": {"max_length": 128, "recompute": True}},
        ),
        # main_job_gpu8 without a config states its profile's sizes...
        (
            {},
            GPU8,
            {
                "raw_instructions": {"max_train_samples": None, "max_heldout": 500},
                "proxy_embeddings": {
                    "max_length": 2048,
                    "world_size": 8,
                    "bf16": True,
                    "max_packed_length": 4096,
                },
                "balanced_clusters": {
                    "num_clusters": 8,
                    "alpha": 1.5,
                    "restarts": 10,
                    "niter": 300,
                    "seed": 0,
                },
                "peripheral_subsets": {"selector": "peripheral", "ratio": 0.5, "balance": "tokens"},
                "trained_checkpoint": {
                    "max_length": 2048,
                    "max_tokens_per_micro_batch": 8192,
                    "max_packed_length": 4096,
                    "gradient_accumulation_steps": 4,
                    "epochs": 3,
                    "learning_rate": 2e-5,
                    "bf16": True,
                },
                "eval_report": {
                    "max_length": 2048,
                    "humaneval_problems": 164,
                    "mbpp_problems": 397,
                    "max_new_tokens": 512,
                },
            },
        ),
        # ... under what its run config gives; a stage that is not a stage is no knob.
        (
            {"ops": {"proxy_embeddings": {"config": {"max_length": 1024}}, "x": {"config": {}}}},
            {"cluster_pipeline/profile": "nonexistent"},
            {"proxy_embeddings": {"max_length": 1024}},
        ),
    ],
)
def test_what_a_launch_gives(run_config, tags, expected):
    assert launched_knobs(run_config, tags) == expected


def test_the_run_uses_the_stored_knobs_under_its_own_and_never_a_one_shot_one():
    stored, _ = PartitionSettings("tiny").with_launch(
        {**STORED, "old_stage": {"x": 1}, "shard_manifests": {"gone_knob": 3}}, "r"
    )
    assert effective_ops({}, stored) == {
        "balanced_clusters": {"num_clusters": 4, "seed": 7},
        "proxy_embeddings": {"max_length": 512, "bf16": True},
    }
    launched = {"proxy_embeddings": {"max_length": 128}, "trained_checkpoint": {"retrain": True}}
    assert effective_ops(launched, stored) == {
        "balanced_clusters": {"num_clusters": 4, "seed": 7},
        "proxy_embeddings": {"max_length": 128, "bf16": True},
        "trained_checkpoint": {"retrain": True},
    }
    run_config = {
        "ops": {"proxy_embeddings": {"config": {"max_length": 128}}},
        "resources": {"storage": {"config": {"data_dir": "/x"}}},
    }
    assert effective_run_config(run_config, {}, stored) == {
        "ops": {
            "balanced_clusters": {"config": {"num_clusters": 4, "seed": 7}},
            "proxy_embeddings": {"config": {"max_length": 128, "bf16": True}},
        },
        "resources": {"storage": {"config": {"data_dir": "/x"}}},
    }


def test_a_selectors_stored_knobs_apply_to_that_selector_only():
    """A run of another selector neither takes nor is refused for the knobs an earlier run of
    ifd left (the benchmark's `ifd@pre` then `balanced_random`: "ifd_end_of_turn applies to the
    selectors ifd, cluster_ifd only"); a later run of a selector that reads them takes them
    (the members: another selector given, the stored selector, a selector sharing the knobs)."""
    stored, _ = PartitionSettings("tiny").with_launch(
        {
            "peripheral_subsets": {
                "selector": "ifd",
                "ratio": 0.3,
                "ifd_end_of_turn": True,
                "ifd_truncated": True,
            }
        },
        "r",
    )
    other = {"peripheral_subsets": {"selector": "balanced_random"}}
    assert effective_ops(other, stored) == {
        "peripheral_subsets": {"selector": "balanced_random", "ratio": 0.3}
    }
    check_stages(effective_run_config({"ops": {"peripheral_subsets": {"config": {
        "selector": "balanced_random"}}}}, {}, stored), ["peripheral_subsets"])  # fmt: skip
    # The run's settings line names only what the run takes.
    assert run_settings_line("tiny", "f", ["peripheral_subsets"], other, stored, []) == (
        "settings of dataset partition 'tiny' (f): not given by this run's config, kept from "
        "earlier launches: peripheral_subsets.ratio = 0.3 (run r)"
    )
    ifd_knobs = {"ratio": 0.3, "ifd_end_of_turn": True, "ifd_truncated": True}
    assert effective_ops({}, stored) == {"peripheral_subsets": {"selector": "ifd", **ifd_knobs}}
    shared = {"peripheral_subsets": {"selector": "cluster_ifd"}}
    assert effective_ops(shared, stored) == {
        "peripheral_subsets": {"selector": "cluster_ifd", **ifd_knobs}
    }
    # Given by the run config, another selector's knob is still refused (the run's own).
    with pytest.raises(ConfigRefused, match="applies to the selectors ifd, cluster_ifd only"):
        check_stages(
            {"ops": {"peripheral_subsets": {"config": {
                "selector": "longest", "ifd_truncated": True}}}},
            ["peripheral_subsets"],
        )  # fmt: skip


def test_the_run_checks_read_the_stored_knobs():
    """A stored knob the rules refuse refuses the run like one of its own config."""
    stored, _ = PartitionSettings("tiny").with_launch(
        {"balanced_clusters": {"num_clusters": 400}}, "r"
    )
    config = effective_run_config({}, {}, stored)
    with pytest.raises(ConfigRefused) as e:
        check_stages(config, ["raw_instructions", "balanced_clusters"])
    assert str(e.value) == (
        "balanced_clusters.num_clusters = 400: more clusters than training samples "
        "(raw_instructions.max_train_samples = 300 caps N); K <= N"
    )


def test_remember_keeps_what_a_launch_gives_except_one_shot_knobs(tmp_path):
    layout = DataLayout.at(tmp_path)
    launched = {
        "proxy_embeddings": {"max_length": 512, "recompute": True},
        "trained_checkpoint": {"retrain": True},
    }
    settings, changes = remember(layout, "tiny", "run-one", launched)
    assert changes == ["proxy_embeddings.max_length: (default) -> 512"]
    assert read_partition_settings(layout.partition_settings("tiny"), "tiny") == settings
    assert settings.stages == {"proxy_embeddings": {"max_length": 512}}
    # The sensor's run gives nothing: nothing changes, the file is not rewritten.
    mtime = layout.partition_settings("tiny").stat().st_mtime_ns
    assert remember(layout, "tiny", "run-two", {}) == (settings, [])
    assert layout.partition_settings("tiny").stat().st_mtime_ns == mtime
    assert stored_settings(layout, "tiny").origin("proxy_embeddings", "max_length") == (
        "run run-one"
    )
    line = run_settings_line(
        "tiny",
        "/d/settings/tiny.json",
        ["raw_instructions", "proxy_embeddings"],
        {},
        settings,
        [],
    )
    assert line == (
        "settings of dataset partition 'tiny' (/d/settings/tiny.json): not given by this run's "
        "config, kept from earlier launches: proxy_embeddings.max_length = 512 (run run-one)"
    )
    _, changes = remember(layout, "tiny", "run-three", {"proxy_embeddings": {"max_length": 256}})
    assert changes == ["proxy_embeddings.max_length: 512 -> 256"]
    assert run_settings_line("tiny", "f", ["proxy_embeddings"], {}, PartitionSettings("t"), []) is (
        None
    )
    # A knob first given its default (proxy_embeddings' chunk_size is 512) is recorded, not
    # listed as a change; given another value later, it is.
    kept, changes = remember(layout, "tiny", "run-3", {"proxy_embeddings": {"chunk_size": 512}})
    assert changes == [] and kept.knobs("proxy_embeddings")["chunk_size"] == 512
    _, changes = remember(layout, "tiny", "run-4", {"proxy_embeddings": {"chunk_size": 64}})
    assert changes == ["proxy_embeddings.chunk_size: 512 -> 64"]


@stage_asset("selection")
def proxy_embeddings(
    context: dg.AssetExecutionContext, config: ProxyEmbeddingsConfig, storage: StorageResource
) -> dg.MaterializeResult:
    """A stand-in for the stage: what its config holds when its step starts."""
    return dg.MaterializeResult(
        metadata={k: getattr(config, k) for k in ("max_length", "bf16", "recompute", "chunk_size")}
    )


@stage_asset("selection")
def balanced_clusters(
    context: dg.AssetExecutionContext, config: BalancedClustersConfig, storage: StorageResource
) -> dg.MaterializeResult:
    """A stand-in for the stage."""
    return dg.MaterializeResult(metadata={"num_clusters": config.num_clusters})


def _run(data, run_config: dict, tags: dict | None = None):
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(DATASETS, ["tiny"])
        result = dg.materialize(
            [proxy_embeddings, balanced_clusters],
            partition_key="tiny",
            instance=instance,
            resources={"storage": StorageResource(data_dir=str(data))},
            run_config=run_config,
            tags=tags,
        )
        assert result.success
        metadata = {
            key.to_user_string(): {k: v.value for k, v in m.metadata.items()}
            for key, m in (
                (e.materialization.asset_key, e.materialization)
                for e in result.get_asset_materialization_events()
            )
        }
        lines = [
            e.message
            for e in instance.all_logs(result.run_id)
            if e.message and "kept from the settings" in e.message
        ]
        return metadata, lines


@pytest.mark.parametrize(
    ("launch", "run_config", "tags", "expected"),
    [
        # Run config {}: the sensor, the UI's Materialize, the CLI without -c.
        ("no config", {}, None, (512, True, False, 4)),
        # The nightly schedule's selection_job run: its (default) profile states nothing.
        ("schedule", {}, DEFAULT_JOB, (512, True, False, 4)),
        # A config that gives max_length (a file, the launchpad, a re-executed run's parent's).
        ("config", _config("proxy_embeddings", max_length=128), None, (128, True, False, 4)),
        # A one-shot knob given: for this run.
        ("recompute", _config("proxy_embeddings", recompute=True), None, (512, True, True, 4)),
        # main_job_gpu8 launched without a config: its profile's sizes.
        ("gpu8", {}, GPU8, (2048, True, False, 8)),
    ],
)
def test_every_launch_path_takes_the_partitions_settings(
    tmp_path, launch, run_config, tags, expected
):
    _stored(tmp_path)
    metadata, lines = _run(tmp_path, run_config, tags)
    embed = metadata["proxy_embeddings"]
    assert (embed["max_length"], embed["bf16"], embed["recompute"]) == expected[:3], launch
    assert metadata["balanced_clusters"]["num_clusters"] == expected[3]
    assert embed["chunk_size"] == ProxyEmbeddingsConfig().chunk_size  # never given: default
    path = DataLayout.at(tmp_path).partition_settings("tiny")
    # The file keeps knobs in name order; the line names each with the run that set it.
    taken = {"no config": "bf16 = True (run 1a2b3c4d), max_length = 512 (run 1a2b3c4d)"}
    taken["schedule"] = taken["recompute"] = taken["no config"]
    taken["config"] = "bf16 = True (run 1a2b3c4d)"
    embed_lines = [line for line in lines if line.startswith("proxy_embeddings")]
    if launch in taken:
        assert embed_lines == [
            "proxy_embeddings: not given by this run's config, kept from the settings dataset "
            f"partition 'tiny' was last launched with ({path}): {taken[launch]}"
        ]
        assert embed["partition_settings"] == (
            {"bf16": "True"} if launch == "config" else {"max_length": "512", "bf16": "True"}
        )
    else:  # gpu8 gives every knob the stored settings hold
        assert embed_lines == []
        assert "partition_settings" not in embed
    clusters_lines = [line for line in lines if line.startswith("balanced_clusters")]
    assert len(clusters_lines) == (0 if launch == "gpu8" else 1)


def test_no_settings_file_changes_nothing(tmp_path):
    metadata, lines = _run(tmp_path, {})
    assert metadata["proxy_embeddings"]["max_length"] == ProxyEmbeddingsConfig().max_length
    assert metadata["balanced_clusters"]["num_clusters"] == 2
    assert lines == []


def test_a_stored_knob_the_stage_refuses_fails_the_step_naming_the_file(tmp_path):
    settings, _ = PartitionSettings("tiny").with_launch(
        {"proxy_embeddings": {"max_length": 1}}, "r"
    )
    path = DataLayout.at(tmp_path).partition_settings("tiny")
    write_partition_settings(path, settings)
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(DATASETS, ["tiny"])
        result = dg.materialize(
            [proxy_embeddings],
            partition_key="tiny",
            instance=instance,
            resources={"storage": StorageResource(data_dir=str(tmp_path))},
            raise_on_error=False,
        )
    failure = next(e for e in result.all_events if e.is_step_failure)
    data = failure.step_failure_data.user_failure_data
    assert data is not None
    assert data.description == (
        f"proxy_embeddings: the settings of dataset partition 'tiny' ({path}) give max_length a "
        "value the stage refuses (Input should be greater than or equal to 2); give max_length "
        "in the run config, or edit or delete the file"
    )


def test_a_stored_env_source_is_read_where_the_step_runs(tmp_path, monkeypatch):
    settings, _ = PartitionSettings("tiny").with_launch(
        {"proxy_embeddings": {"max_length": {"env": "I43_MAX_LENGTH"}}}, "r"
    )
    write_partition_settings(DataLayout.at(tmp_path).partition_settings("tiny"), settings)
    monkeypatch.setenv("I43_MAX_LENGTH", "333")
    metadata, lines = _run(tmp_path, {})
    assert metadata["proxy_embeddings"]["max_length"] == 333
    shown = "{env: I43_MAX_LENGTH}"  # the variable's name, never its value
    assert metadata["proxy_embeddings"]["partition_settings"] == {"max_length": shown}
    assert lines[0].endswith("max_length = {env: I43_MAX_LENGTH} (run r)")


def test_a_refusal_names_the_settings_file_only_for_the_knobs_taken_from_it():
    # A new user's trial (2026-12-05): ratio 1.5 given in the run config was refused with a
    # hint to edit the settings file, which had not given it.
    from cluster_pipeline.defs.partition_settings import from_settings_file

    stored, _ = PartitionSettings("tiny").with_launch(
        {"balanced_clusters": {"num_clusters": 100}, "peripheral_subsets": {"ratio": 0.4}}, "r"
    )
    problems = [
        "peripheral_subsets.ratio = 1.5: Input should be less than or equal to 1",
        "balanced_clusters.num_clusters = 100: more clusters than the 54 training samples",
    ]
    launched = {"peripheral_subsets": {"ratio": 1.5}}
    assert from_settings_file(problems, launched, stored) == ["balanced_clusters.num_clusters"]
    assert from_settings_file(problems[:1], launched, stored) == []


def test_a_knob_or_stage_the_pipeline_lacks_in_the_file_is_refused_with_the_nearest_name(
    tmp_path,
):
    """A file edited by hand: a misspelled knob, a misspelled stage, and a name near nothing.
    Each would otherwise be ignored while the user believes it applies (issue 43's trial:
    ``"num_cluster": 4`` ran with K = 2)."""
    path = DataLayout.at(tmp_path).partition_settings("tiny")
    path.parent.mkdir(parents=True)
    path.write_text(
        '{"dataset": "tiny", "origins": {}, "stages": {'
        '"balanced_clusters": {"num_cluster": 4, "alpha": 1.2},'
        '"peripheral_subset": {"ratio": 0.3},'
        '"proxy_embeddings": {"zzz": 1}}}'
    )
    with pytest.raises(SettingsUnreadable) as refused:
        stored_settings(DataLayout.at(tmp_path), "tiny")
    assert str(refused.value) == (
        f"{path}: balanced_clusters.num_cluster (did you mean 'num_clusters'?); stage "
        "'peripheral_subset' (did you mean 'peripheral_subsets'?); proxy_embeddings.zzz: not "
        "in the pipeline, so it would be ignored; correct the name, or remove it from the "
        "file's 'stages'"
    )
    # Corrected, the same file is read.
    path.write_text(
        '{"dataset": "tiny", "origins": {}, "stages": {'
        '"balanced_clusters": {"num_clusters": 4, "alpha": 1.2}}}'
    )
    stages = stored_settings(DataLayout.at(tmp_path), "tiny").stages
    assert stages == {"balanced_clusters": {"num_clusters": 4, "alpha": 1.2}}

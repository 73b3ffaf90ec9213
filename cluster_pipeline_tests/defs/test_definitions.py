"""The Definitions load, and their shape: assets, groups, partitions, checks, jobs."""

import dagster as dg
import pytest

from cluster_pipeline.definitions import defs
from cluster_pipeline.defs.profiles import PROFILES, job_name, profile_run_config
from cluster_pipeline.defs.resources import TorchrunResource
from cluster_pipeline.defs.stages import STAGES, ui_description

# One xdist worker runs this module: its module-scoped fixture starts once.
pytestmark = pytest.mark.xdist_group("definitions")


@pytest.fixture(scope="module")
def definitions() -> dg.Definitions:
    return defs()


def test_definitions_load_with_the_seven_stages(definitions):
    graph = definitions.resolve_asset_graph()
    groups = {k.to_user_string(): graph.get(k).group_name for k in graph.get_all_asset_keys()}
    assert groups == {
        "raw_instructions": "ingest",
        "proxy_embeddings": "selection",
        "balanced_clusters": "selection",
        "peripheral_subsets": "selection",
        "shard_manifests": "selection",
        "trained_checkpoint": "training",
        "eval_report": "training",
        "sample_lineage": "inspection",
    }
    for key in graph.get_all_asset_keys():
        assert graph.get(key).partitions_def == dg.DynamicPartitionsDefinition(name="datasets")
    # The chain is linear, in DESIGN.md order.
    for up, down in zip(STAGES, STAGES[1:], strict=False):
        assert dg.AssetKey(up) in graph.get(dg.AssetKey(down)).parent_keys


def test_asset_descriptions_are_markdown(definitions):
    """The UI shows an asset's description as Markdown: no reStructuredText marks left."""
    assert (
        ui_description(
            """First ``a`` and :func:`~pkg.mod.f`,
        a :class:`B` wrapped.

        Second    paragraph."""
        )
        == "First `a` and `pkg.mod.f`, a `B` wrapped.\n\nSecond paragraph."
    )
    graph = definitions.resolve_asset_graph()
    for key in graph.get_all_asset_keys():
        description = graph.get(key).description or ""
        assert description and "``" not in description and ":func:" not in description, key


def test_checks_jobs_and_sensor(definitions):
    graph = definitions.resolve_asset_graph()
    checks = {(c.asset_key.to_user_string(), c.name) for c in graph.asset_check_keys}
    assert checks == {
        ("balanced_clusters", "capacity"),
        ("shard_manifests", "equal_shards"),
        ("shard_manifests", "coverage"),
        ("shard_manifests", "weights"),
    }
    main = definitions.resolve_job_def("main_job")
    assert main.executor_def.name == "multiprocess"
    # Both jobs end with the lineage table (the automation sensor has nothing left to run).
    stages = {*STAGES, "sample_lineage"}
    assert {n.name for n in main.nodes_in_topological_order} == stages
    selection = definitions.resolve_job_def("selection_job")
    assert {n.name for n in selection.nodes_in_topological_order} == {
        *STAGES[:5],
        "sample_lineage",
    }
    assert sorted(s.name for s in definitions.sensors) == [
        "dataset_folders_sensor",
        "selection_automation_sensor",
    ]
    assert [s.name for s in definitions.schedules] == ["nightly_selection_refresh"]
    graph = definitions.resolve_asset_graph()
    conditions = {
        k.to_user_string(): graph.get(k).automation_condition for k in graph.get_all_asset_keys()
    }
    # The selection chain follows its parents; training and evaluation run only on request.
    assert all(conditions[a] is not None for a in STAGES[1:5])
    assert conditions["trained_checkpoint"] is None and conditions["eval_report"] is None


def _op_configs(job: dg.JobDefinition, run_config: dict) -> dict:
    from dagster._core.system_config.objects import ResolvedRunConfig

    resolved = ResolvedRunConfig.build(job, run_config)
    return {stage: resolved.ops[stage].config for stage in STAGES}


def test_each_profile_has_a_main_job_whose_default_config_is_the_profiles(definitions):
    for profile in PROFILES:
        job = definitions.resolve_job_def(job_name(profile))
        assert job.tags["cluster_pipeline/profile"] == profile
        config = job.get_run_config_for_partition_key("python_stdlib")
        assert config == profile_run_config(profile)
        _op_configs(job, config)  # valid against the stages' schemas


def test_runs_without_config_get_the_cpu_quick_sizes(definitions):
    """Materialize in the asset graph, the automation sensor and ``dagster asset materialize``
    without -c start with the schema defaults: the same resolved config as main_job's."""
    main = definitions.resolve_job_def("main_job")
    assert _op_configs(main, {}) == _op_configs(main, profile_run_config("cpu_quick"))
    # The sizes README.md and the job's docstring state.
    ops = profile_run_config("cpu_quick")["ops"]
    assert ops["raw_instructions"]["config"] == {"max_train_samples": 300, "max_heldout": 100}
    assert ops["proxy_embeddings"]["config"]["max_length"] == 256
    assert ops["balanced_clusters"]["config"]["num_clusters"] == 2
    assert ops["peripheral_subsets"]["config"] == {
        "selector": "peripheral",
        "ratio": 0.5,
        "balance": "tokens",
    }
    train = ops["trained_checkpoint"]["config"]
    assert (train["max_length"], train["max_tokens_per_micro_batch"]) == (256, 1024)
    assert train["max_packed_length"] == 512
    assert (train["gradient_accumulation_steps"], train["epochs"]) == (2, 1)
    assert train["learning_rate"] == 1e-4
    evaluation = ops["eval_report"]["config"]
    assert (evaluation["humaneval_problems"], evaluation["mbpp_problems"]) == (8, 8)
    assert evaluation["max_new_tokens"] == 200


def test_the_selection_job_and_the_gpu_profile(definitions):
    selection = definitions.resolve_job_def("selection_job")
    config = selection.get_run_config_for_partition_key("python_stdlib")
    assert set(config["ops"]) == {
        "raw_instructions",
        "proxy_embeddings",
        "balanced_clusters",
        "peripheral_subsets",
    }
    assert config["ops"]["proxy_embeddings"] == profile_run_config()["ops"]["proxy_embeddings"]
    gpu = profile_run_config("gpu8")["ops"]
    assert gpu["raw_instructions"]["config"]["max_train_samples"] is None  # the whole pool
    assert gpu["balanced_clusters"]["config"]["num_clusters"] == 8
    assert gpu["proxy_embeddings"]["config"]["world_size"] == 8


def test_torchrun_command_lines():
    single = TorchrunResource().command("m.x", 2, ["--config", "c.json"])
    assert single[1:] == [
        "-m",
        "cluster_pipeline.launch.launcher",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "m.x",
        "--config",
        "c.json",
    ]
    multi = TorchrunResource(nnodes=2, node_rank=1, rdzv_endpoint="10.0.0.1:29400").command(
        "m.x", 4, []
    )
    assert "--nnodes=2" in multi and "--node_rank=1" in multi
    assert "--rdzv_endpoint=10.0.0.1:29400" in multi and "--standalone" not in multi
    with pytest.raises(ValueError, match="rdzv_endpoint"):
        TorchrunResource(nnodes=2).command("m.x", 1, [])


@pytest.mark.parametrize(
    ("cls", "kwargs", "message"),
    [
        ("PeripheralSubsetsConfig", {"ratio": 1.5}, "ratio"),
        ("PeripheralSubsetsConfig", {"selector": "best"}, "'peripheral', 'core'"),
        ("BalancedClustersConfig", {"alpha": 0.5}, "alpha"),
        ("TrainedCheckpointConfig", {"learning_rate": 0.0}, "learning_rate"),
        ("EvalReportConfig", {"humaneval_problems": 500}, "humaneval_problems"),
    ],
)
def test_run_config_errors_name_the_knob(cls, kwargs, message):
    import pydantic

    from cluster_pipeline.defs import configs

    config_cls = getattr(configs, cls)
    with pytest.raises(pydantic.ValidationError, match=message):
        config_cls(**kwargs)
    assert all(f.description for f in config_cls.model_fields.values())

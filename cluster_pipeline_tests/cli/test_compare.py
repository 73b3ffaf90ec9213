"""make compare's run configs: selector x ratio x seed over the main job's settings."""

import pytest
import yaml

from cluster_pipeline.cli.compare import compare_config
from cluster_pipeline.cli.main import main
from cluster_pipeline.defs.profiles import profile_run_config

ASSETS = ["peripheral_subsets", "shard_manifests", "trained_checkpoint"]
CPU_QUICK = profile_run_config("cpu_quick")["ops"]


def test_seed_is_the_selection_and_the_training_seed_and_ratio_is_set():
    cfg = compare_config("core", 2, ASSETS, ratio=0.25)["ops"]
    assert cfg["peripheral_subsets"]["config"] == {
        "selector": "core",
        "ratio": 0.25,
        "balance": "tokens",
        "seed": 2,
    }
    train = cfg["trained_checkpoint"]["config"]
    assert train == {**CPU_QUICK["trained_checkpoint"]["config"], "seed": 2}
    assert set(cfg) == {"peripheral_subsets", "trained_checkpoint"}  # shard_manifests: defaults


def test_a_targeted_selector_gets_its_target_set_and_is_refused_without_one(capsys):
    cfg = compare_config("rds", 0, ASSETS, target="humaneval")["ops"]["peripheral_subsets"]
    assert cfg["config"]["selector"] == "rds" and cfg["config"]["target"] == "humaneval"
    # A selector that reads no target set is not given one (it would refuse it).
    cfg = compare_config("random_global", 0, ASSETS, target="humaneval")["ops"]
    assert "target" not in cfg["peripheral_subsets"]["config"]
    with pytest.raises(SystemExit) as e:
        main(["compare-config", "rds", "0", "peripheral_subsets"])
    assert e.value.code == 2 and "rds needs a target set" in capsys.readouterr().err


def test_full_data_ignores_the_ratio_and_the_default_ratio_is_the_main_jobs():
    assert (
        compare_config("full", 0, ASSETS, ratio=0.25)["ops"]["peripheral_subsets"]["config"][
            "ratio"
        ]
        == 1.0
    )
    default = CPU_QUICK["peripheral_subsets"]["config"]["ratio"]
    assert (
        compare_config("random_global", 0, ASSETS)["ops"]["peripheral_subsets"]["config"]["ratio"]
        == default
    )


def test_the_cli_prints_yaml(capsys):
    main(["compare-config", "random_global", "1", "peripheral_subsets", "--ratio", "0.75"])
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["ops"]["peripheral_subsets"]["config"]["ratio"] == 0.75


def test_an_unknown_asset_is_refused(capsys):

    with pytest.raises(SystemExit) as exit_:
        main(["compare-config", "core", "0", "peripheral_subsets,nosuch_asset"])
    assert exit_.value.code == 2
    assert (
        "unknown asset(s) 'nosuch_asset'; choose from raw_instructions" in capsys.readouterr().err
    )


def test_run_config_prints_the_profile_and_refuses_an_unknown_one(capsys):

    main(["run-config", "gpu8", "--assets", "balanced_clusters"])
    assert yaml.safe_load(capsys.readouterr().out)["ops"] == {
        "balanced_clusters": {
            "config": {"num_clusters": 8, "alpha": 1.5, "restarts": 10, "niter": 300, "seed": 0}
        }
    }
    with pytest.raises(SystemExit) as exit_:
        main(["run-config", "gpu9"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (
        "cluster-pipeline run-config: error: unknown size profile 'gpu9'; "
        "choose from cpu_quick, gpu8\n"
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["compare-config", "core", "0", "peripheral_subsets", "--ratio", "1.5"],
            "peripheral_subsets.ratio = 1.5: Input should be less than or equal to 1",
        ),
        (
            ["compare-config", "core", "-1", "trained_checkpoint"],
            "trained_checkpoint.seed = -1: Input should be greater than or equal to 0",
        ),
        (
            ["run-config", "--assets", "raw_instructions, x,"],
            "unknown asset(s) 'x'; choose from raw_instructions",
        ),
        (["run-config", "--assets", ","], "--assets names no asset; choose from"),
    ],
)
def test_bad_values_are_refused_before_any_run(capsys, args, message):
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_assets_are_read_with_spaces_around_names(capsys):
    main(["run-config", "--assets", " balanced_clusters , peripheral_subsets"])
    assert list(yaml.safe_load(capsys.readouterr().out)["ops"]) == [
        "balanced_clusters",
        "peripheral_subsets",
    ]

"""The params of a selection's MLflow run: only the knobs its selector reads (the peripheral
selector's run logs no s2l_*/less_*/target knob, trial note), and the whole config as the run's
run_config.yaml artifact, written to a real SQLite store and read back."""

import pytest
import yaml

from cluster_pipeline.defs.assets.peripheral_subsets import (
    LESS_KNOBS,
    RUN_CONFIG_ARTIFACT,
    S2L_KNOBS,
    PeripheralSubsetsConfig,
    run_config_yaml,
    tracked_knobs,
)
from cluster_pipeline.defs.run_checks import TARGET_KNOBS
from cluster_pipeline.storage.layout import DataLayout
from cluster_pipeline.tracking.tracker import Tracker, local_store

COMMON = {"selector", "ratio", "seed", "balance"}


@pytest.mark.parametrize(
    ("config", "knobs"),
    [
        (PeripheralSubsetsConfig(), COMMON),
        (PeripheralSubsetsConfig(selector="core", ratio=0.25), COMMON),
        (PeripheralSubsetsConfig(selector="s2l", s2l_steps=16), COMMON | set(S2L_KNOBS)),
        (PeripheralSubsetsConfig(selector="rds", target="mbpp"), COMMON | set(TARGET_KNOBS)),
        (
            PeripheralSubsetsConfig(selector="less", target="mbpp"),
            COMMON | set(TARGET_KNOBS) | set(LESS_KNOBS),
        ),
    ],
)
def test_only_the_knobs_the_selector_reads_are_params(config, knobs):
    params = tracked_knobs(config)
    assert set(params) == knobs
    assert params == {k: getattr(config, k) for k in knobs}


def test_the_whole_config_is_an_artifact_of_the_run(tmp_path):
    store = local_store(DataLayout.at(tmp_path / "data"))
    tracker = Tracker(store.uri, experiment="params", artifact_location=store.artifact_location)
    config = PeripheralSubsetsConfig(ratio=0.2)
    run_id = tracker.start_run("selection", tags={}, params=tracked_knobs(config))
    tracker.log_bytes(run_id, run_config_yaml(config), RUN_CONFIG_ARTIFACT)
    tracker.end_run(run_id)
    assert run_id is not None and tracker.enabled

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=store.uri)
    params = client.get_run(run_id).data.params
    assert params == {"selector": "peripheral", "ratio": "0.2", "seed": "0", "balance": "tokens"}
    assert not [k for k in params if k.startswith(("s2l_", "less_", "target"))]
    saved = client.download_artifacts(run_id, RUN_CONFIG_ARTIFACT, str(tmp_path))
    with open(saved) as f:
        run_config = yaml.safe_load(f)
    knobs = run_config["ops"]["peripheral_subsets"]["config"]
    # Every knob, the ones the params leave out too, and a config Dagster takes as it is.
    assert knobs == config.model_dump()
    assert knobs["s2l_steps"] == 8 and knobs["less_projection_dim"] == 8192
    assert PeripheralSubsetsConfig.model_validate(knobs) == config

"""The params of a selection's MLflow run: only the knobs its selector reads (the peripheral
selector's run logs no s2l_*/less_*/target knob, trial note), which are also what a logged run
config repeats (the run checks refuse the others). The logged run config itself, read back from
a real store and run again: test_pipeline_runs.py."""

import pytest

from cluster_pipeline.defs.configs import (
    PeripheralSubsetsConfig,
    repeatable_config,
    tracked_knobs,
)
from cluster_pipeline.selection.selectors import REGISTRY

COMMON = {"selector", "ratio", "seed", "balance"}
TARGET_KNOBS = {"target", "target_size"}
S2L_KNOBS = {
    "s2l_steps",
    "s2l_checkpoints",
    "s2l_clusters",
    "s2l_sources",
    "s2l_small_clusters",
    "s2l_learning_rate",
}
RDS_KNOBS = {"rds_selection", "rds_pooling"}
LESS_KNOBS = {
    "less_warmup_fraction",
    "less_warmup_steps",
    "less_checkpoints",
    "less_lora_r",
    "less_learning_rate",
    "less_adam",
    "less_subtasks",
    "less_projection_dim",
}


@pytest.mark.parametrize(
    ("config", "knobs"),
    [
        (PeripheralSubsetsConfig(), COMMON),
        (PeripheralSubsetsConfig(selector="core", ratio=0.25), COMMON),
        (PeripheralSubsetsConfig(selector="s2l", s2l_steps=16), COMMON | S2L_KNOBS),
        (PeripheralSubsetsConfig(selector="rds", target="mbpp"), COMMON | TARGET_KNOBS | RDS_KNOBS),
        (
            PeripheralSubsetsConfig(selector="less", target="mbpp"),
            COMMON | TARGET_KNOBS | LESS_KNOBS,
        ),
    ],
)
def test_only_the_knobs_the_selector_reads_are_params(config, knobs):
    params = tracked_knobs(config)
    assert set(params) == knobs
    assert params == {k: getattr(config, k) for k in knobs}


@pytest.mark.parametrize("selector", sorted(REGISTRY))
def test_a_repeated_config_holds_the_knobs_the_run_checks_take(selector):
    """The whole config of a selection is refused by the run checks as a run config (another
    selector's knobs, even at their defaults); what a logged run config repeats
    (repeatable_config) is not, and it is the same config."""
    from cluster_pipeline.selection.selectors import misplaced_knobs

    config = PeripheralSubsetsConfig(selector=selector, ratio=0.2)
    values = config.model_dump(mode="json")
    repeated = repeatable_config("peripheral_subsets", values)
    assert misplaced_knobs(selector, repeated) == {}
    assert PeripheralSubsetsConfig.model_validate(repeated) == config
    foreign = misplaced_knobs(selector, values)
    assert set(foreign) == set(values) - set(repeated)
    assert foreign  # every selector leaves some other selector's knob out
    # Another stage's config is repeated whole.
    assert repeatable_config("balanced_clusters", {"seed": 3}) == {"seed": 3}

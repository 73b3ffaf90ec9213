"""The selector registry: one entry per selector, its inputs checked, its cost recorded, and the
UI's description of ``selector`` listing every entry."""

from typing import Any

import numpy as np
import pytest

from cluster_pipeline.selection.selectors import (
    CLUSTER_SELECTORS,
    REGISTRY,
    REWEIGHTED_SELECTORS,
    SELECTORS,
    PassCost,
    SelectionInputs,
    SelectionParams,
    run_selector,
)

LABELS = np.array([0, 0, 0, 0, 0, 0, 1, 1, 1, 1])
DIST = np.array([0.1, 0.9, 0.5, 0.3, 0.7, 0.2, 0.4, 0.8, 0.05, 0.6], dtype=np.float32)
EMBEDDING = PassCost("embedding", samples=10, tokens=200, seconds=1.5, run_now=10)


def test_the_six_clustering_selectors_are_registered_with_their_roles():
    # (A selector module added later joins the registry after them: the roles of the six are
    # pinned, not the registry's whole list.)
    assert SELECTORS[:6] == ("peripheral", "core", "random", "uniform", "random_global", "full")
    six = SELECTORS[:6]
    assert [n for n in CLUSTER_SELECTORS if n in six] == ["peripheral", "core", "random", "uniform"]
    assert [n for n in REWEIGHTED_SELECTORS if n in six] == ["peripheral", "core", "random"]
    assert SELECTORS[6:10] == ("ifd", "rds", "s2l", "less")
    # The baselines the field now reports (issue 41) follow.
    assert SELECTORS[-2:] == ("balanced_random", "longest") and "cluster_less" in SELECTORS
    assert not {"ifd", "rds", "s2l", "less"} & {*CLUSTER_SELECTORS, *REWEIGHTED_SELECTORS}
    for name, spec in REGISTRY.items():
        assert spec.name == name and spec.summary and spec.run.__doc__


def test_the_ui_description_of_selector_lists_every_registered_selector():
    from cluster_pipeline.defs.configs import PeripheralSubsetsConfig

    field = PeripheralSubsetsConfig.model_fields["selector"]
    assert field.description is not None
    for name, spec in REGISTRY.items():
        assert f"{name} = {spec.summary}" in field.description
    # Dagster's schema offers exactly the registry's names.
    schema: Any = PeripheralSubsetsConfig.to_config_schema().as_field().config_type
    assert {f.config_value for f in schema.fields["selector"].config_type.enum_values} == set(
        SELECTORS
    )


def test_the_cost_record_names_the_passes_a_selector_needs():
    inputs = SelectionInputs(LABELS, 2, sq_distance=DIST, passes=(EMBEDDING,))
    peripheral = run_selector("peripheral", inputs, SelectionParams(r=0.5))
    assert peripheral.cost is not None and peripheral.cost.passes == (EMBEDDING,)
    assert peripheral.cost.forward_passes == 10 and peripheral.cost.backward_passes == 0
    assert peripheral.cost.total_seconds == pytest.approx(1.5 + peripheral.cost.seconds)
    # The score is what the selector ranks by: the kept samples have the largest distances.
    assert peripheral.score is not None
    np.testing.assert_array_equal(peripheral.score, DIST.astype(np.float64))
    baseline = run_selector("random_global", inputs, SelectionParams(r=0.5))
    assert baseline.cost is not None and baseline.cost.passes == ()
    assert baseline.score is not None and np.isnan(baseline.score).all()


def test_a_selector_without_its_inputs_is_refused_naming_them():
    with pytest.raises(ValueError, match="'peripheral' needs sq_distance"):
        run_selector("peripheral", SelectionInputs(LABELS, 2), SelectionParams(r=0.5))
    with pytest.raises(ValueError, match="token balance needs"):
        run_selector("full", SelectionInputs(LABELS, 2), SelectionParams(balance="tokens"))

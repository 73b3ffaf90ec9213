"""The benchmarks' ``NAME@pre`` variants (issue 41): each runs a peer under this project's rules
before issue 41, so each names only knobs of that peer, each set to a value the knob accepts
and other than its default (else ``ifd@pre`` would silently be ``ifd``), and the two benchmark
scripts name the same rules. Read from the scripts' source (they import Dagster and torch)."""

import ast
from pathlib import Path

import pytest

from cluster_pipeline.selection.selectors import REGISTRY, knobs_of

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = ("selection_quality.py", "selection_cost.py")


def _pre_fidelity(script: str) -> dict:
    tree = ast.parse((BENCHMARKS / script).read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "PRE_FIDELITY" for t in node.targets
        ):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{script} defines no PRE_FIDELITY")


def test_both_benchmarks_run_the_same_earlier_rules():
    quality, cost = (_pre_fidelity(s) for s in SCRIPTS)
    assert quality == cost
    # The four peers whose rules issue 41 changed, and the knobs that changed each.
    assert quality == {
        "ifd": {"ifd_end_of_turn": True, "ifd_truncated": True},
        "rds": {"rds_selection": "round_robin_untaken", "rds_pooling": "response_mean"},
        "s2l": {"s2l_sources": False, "s2l_small_clusters": "algorithm_1"},
        "less": {"less_adam": "paper", "less_subtasks": "max"},
    }


@pytest.mark.parametrize("peer", sorted(_pre_fidelity(SCRIPTS[0])))
def test_each_earlier_rule_is_a_valid_non_default_setting_of_its_peer(peer):
    pre = _pre_fidelity(SCRIPTS[0])[peer]
    fields = REGISTRY[peer].knobs.model_fields
    assert set(pre) <= set(fields), set(pre) - set(fields)
    knobs = knobs_of(peer, pre)  # raises on a value the knob refuses
    for knob, value in pre.items():
        assert getattr(knobs, knob) == value
        assert fields[knob].default != value, f"{peer}@pre's {knob} is the default"

"""The run-config schema that users' YAML files, the CLI and the launchpad are written against
stays what it was, knob for knob: every job's schema (each stage's knobs, each resource's,
the executor's and the loggers'), with its type, whether it is required, its default and its
description, and the config each job's launchpad opens with (a size profile's values,
defs/profiles.py), compared with the snapshot ``run_config_schema.json`` taken from the code.

The snapshot is data, not a rule: a change to a knob that is meant (a new knob, a new default)
is made by writing it again and reviewing the diff::

    PYTHONPATH=. python -m cluster_pipeline_tests.defs.test_run_config_schema --write

Two knobs grow by design: ``peripheral_subsets.selector`` lists the registered selectors
(selection/selectors/), so a new selector module adds a choice and a clause of its
description; the torchrun resource's ``launcher`` lists the launchers of launch/. There the
snapshot's choices and clauses must still come first, unchanged.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
from dagster._config import ConfigTypeKind

SNAPSHOT = Path(__file__).with_name("run_config_schema.json")
# The knobs built from a registry (module docstring).
REGISTRY_KNOB = "ops.peripheral_subsets.config.selector"
REGISTRY_KNOBS = (REGISTRY_KNOB, "resources.torchrun.config.launcher")

pytestmark = pytest.mark.xdist_group("definitions")


def type_name(config_type: Any) -> str:
    """A config type as one string: ``Int``, ``Noneable[IntSourceType]``, ``Enum[a, b]``,
    ``Array[...]``, ``Shape`` (its fields are entries of their own)."""
    kind = config_type.kind
    if kind == ConfigTypeKind.NONEABLE:
        return f"Noneable[{type_name(config_type.inner_type)}]"
    if kind == ConfigTypeKind.ARRAY:
        return f"Array[{type_name(config_type.inner_type)}]"
    if kind == ConfigTypeKind.MAP:
        key = type_name(config_type.key_type)
        return f"Map[{key}, {type_name(config_type.inner_type)}]"
    if kind == ConfigTypeKind.ENUM:
        values = [v.config_value for v in config_type.enum_values]
        return f"Enum[{', '.join(values)}]"
    if kind in (ConfigTypeKind.STRICT_SHAPE, ConfigTypeKind.PERMISSIVE_SHAPE):
        return "PermissiveShape" if kind == ConfigTypeKind.PERMISSIVE_SHAPE else "Shape"
    if kind == ConfigTypeKind.SELECTOR:
        return "Selector"
    return config_type.key


def _fields(config_type: Any) -> dict[str, Any] | None:
    """The fields of a shape or selector (through Noneable), else None."""
    while config_type.kind == ConfigTypeKind.NONEABLE:
        config_type = config_type.inner_type
    if config_type.kind in (
        ConfigTypeKind.STRICT_SHAPE,
        ConfigTypeKind.PERMISSIVE_SHAPE,
        ConfigTypeKind.SELECTOR,
    ):
        return config_type.fields
    return None


def flatten(config_type: Any, path: str = "") -> dict[str, dict[str, Any]]:
    """Every field under ``config_type`` by its dotted path (``ops.<stage>.config.<knob>``):
    type, required, default (as Dagster's JSON; None when there is none) and description."""
    out: dict[str, dict[str, Any]] = {}
    for name, field in sorted((_fields(config_type) or {}).items()):
        where = f"{path}.{name}" if path else name
        out[where] = {
            "type": type_name(field.config_type),
            "required": field.is_required,
            "default": field.default_value_as_json_str if field.default_provided else None,
            "description": field.description,
        }
        out.update(flatten(field.config_type, where))
    return out


def schema_of(definitions: dg.Definitions) -> dict[str, dict[str, dict[str, Any]]]:
    """Job name -> its run-config schema, flattened (:func:`flatten`), for every job of the
    Definitions (the asset jobs, and Dagster's implicit one that the asset graph's launchpad
    uses)."""
    return {
        job.name: flatten(job.run_config_schema.config_type)
        for job in sorted(definitions.resolve_all_job_defs(), key=lambda j: j.name)
    }


def _leaves(value: Any, path: str) -> dict[str, str]:
    """A run config's values by dotted path, each as JSON."""
    if isinstance(value, dict) and value:
        out: dict[str, str] = {}
        for key, inner in sorted(value.items()):
            out.update(_leaves(inner, f"{path}.{key}" if path else key))
        return out
    return {path: json.dumps(value, sort_keys=True)}


def launchpad_of(definitions: dg.Definitions) -> dict[str, dict[str, str]]:
    """Job name -> the run config its launchpad opens with (the same for every dataset
    partition), flattened (:func:`_leaves`); jobs without one are left out."""
    out = {}
    for job in sorted(definitions.resolve_all_job_defs(), key=lambda j: j.name):
        if job.partitioned_config is not None:
            config = job.partitioned_config.get_run_config_for_partition_key("any_dataset")
            out[job.name] = _leaves(config, "")
    return out


def snapshot_of(definitions: dg.Definitions) -> dict[str, Any]:
    """The snapshot's content: ``{"schema": schema_of, "launchpad": launchpad_of}``."""
    return {"schema": schema_of(definitions), "launchpad": launchpad_of(definitions)}


def _registry_knob_differences(before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """Where a registry's knob lost or changed a choice, its default or a clause (new
    selectors or launchers may add choices, and clauses, after the snapshot's)."""
    problems = []
    old_values = before["type"].removeprefix("Enum[").removesuffix("]").split(", ")
    new_values = now["type"].removeprefix("Enum[").removesuffix("]").split(", ")
    if new_values[: len(old_values)] != old_values:
        problems.append(f"choices {old_values} became {new_values}")
    if not (now["description"] or "").startswith((before["description"] or "").removesuffix(".")):
        problems.append(f"description {before['description']!r} became {now['description']!r}")
    for key in ("required", "default"):
        if before[key] != now[key]:
            problems.append(f"{key} {before[key]!r} became {now[key]!r}")
    return problems


def differences(
    before: dict[str, dict[str, dict[str, Any]]], now: dict[str, dict[str, dict[str, Any]]]
) -> list[str]:
    """One line per job, knob and attribute that differs between two schemas."""
    problems = []
    for job in sorted(set(before) | set(now)):
        if job not in now or job not in before:
            problems.append(f"job {job}: {'gone' if job not in now else 'new'}")
            continue
        old, new = before[job], now[job]
        for knob in sorted(set(old) | set(new)):
            if knob not in new or knob not in old:
                problems.append(f"{job}: {knob} {'gone' if knob not in new else 'new'}")
            elif knob in REGISTRY_KNOBS:
                problems += [
                    f"{job}: {knob}: {p}" for p in _registry_knob_differences(old[knob], new[knob])
                ]
            else:
                for key in ("type", "required", "default", "description"):
                    if old[knob][key] != new[knob][key]:
                        problems.append(
                            f"{job}: {knob}: {key} {old[knob][key]!r} became {new[knob][key]!r}"
                        )
    return problems


def launchpad_differences(
    before: dict[str, dict[str, str]], now: dict[str, dict[str, str]]
) -> list[str]:
    """One line per job and knob whose launchpad value differs."""
    problems = []
    for job in sorted(set(before) | set(now)):
        old, new = before.get(job, {}), now.get(job, {})
        for knob in sorted(set(old) | set(new)):
            if old.get(knob) != new.get(knob):
                problems.append(
                    f"{job} launchpad: {knob} {old.get(knob, '(none)')} became "
                    f"{new.get(knob, '(none)')}"
                )
    return problems


@pytest.fixture(scope="module")
def current() -> dict[str, Any]:
    from cluster_pipeline.definitions import defs

    return snapshot_of(defs())


@pytest.fixture(scope="module")
def snapshot() -> dict[str, Any]:
    return json.loads(SNAPSHOT.read_text())


def test_the_run_config_schema_is_the_snapshot_knob_for_knob(current, snapshot):
    assert differences(snapshot["schema"], current["schema"]) == []


def test_every_launchpad_opens_with_the_snapshot_config(current, snapshot):
    assert launchpad_differences(snapshot["launchpad"], current["launchpad"]) == []


def test_the_snapshot_holds_every_stage_knob(snapshot):
    """The snapshot is of the stages' real config classes (not an empty or partial file)."""
    schema, launchpad = snapshot["schema"], snapshot["launchpad"]
    stages = {
        "raw_instructions": "max_train_samples",
        "proxy_embeddings": "world_size",
        "balanced_clusters": "num_clusters",
        "peripheral_subsets": "less_projection_dim",
        "shard_manifests": "seed",
        "trained_checkpoint": "retrain",
        "eval_report": "compare_checkpoints",
    }
    for stage, knob in stages.items():
        assert f"ops.{stage}.config.{knob}" in schema["main_job"], (stage, knob)
    assert schema["main_job"]["ops.peripheral_subsets.config.ratio"]["default"] == "0.5"
    assert launchpad["main_job_gpu8"]["ops.balanced_clusters.config.num_clusters"] == "8"
    assert launchpad["main_job"]["ops.balanced_clusters.config.num_clusters"] == "2"


def test_a_changed_knob_is_named():
    """The comparison finds a changed default, a lost knob and a lost selector choice."""
    knob = {"type": "Int", "required": False, "default": "1", "description": "d"}
    selector = {"type": "Enum[a, b]", "required": False, "default": '"a"', "description": "a; b."}
    before = {"j": {"ops.s.config.k": knob, "ops.s.config.gone": knob, REGISTRY_KNOB: selector}}
    grown = {**selector, "type": "Enum[a, b, c]", "description": "a; b; c."}
    after = {"j": {"ops.s.config.k": {**knob, "default": "2"}, REGISTRY_KNOB: grown}}
    assert differences(before, after) == [
        "j: ops.s.config.gone gone",
        "j: ops.s.config.k: default '1' became '2'",
    ]
    shrunk = {"j": {**before["j"], REGISTRY_KNOB: {**selector, "type": "Enum[b, a]"}}}
    assert differences(before, shrunk) == [
        f"j: {REGISTRY_KNOB}: choices ['a', 'b'] became ['b', 'a']"
    ]


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python -m cluster_pipeline_tests.defs.test_run_config_schema --write")
    from cluster_pipeline.definitions import defs

    SNAPSHOT.write_text(json.dumps(snapshot_of(defs()), indent=1, sort_keys=True) + "\n")
    print(f"wrote {SNAPSHOT}")

"""One source of settings per dataset partition (docs/design.md, "Runs: settings, one per
partition"): the knobs a launch of a partition gives are remembered
(``<data>/settings/<dataset>.json``, storage/partition_settings.py), and every later run of
the partition uses them for every knob its own launch does not give.

Why: a run started without a config (the automation sensor's, the nightly schedule's, the UI's
*Materialize* of a few assets, ``dagster asset materialize`` without ``-c``, a re-execution of
such a run) used to run with the stages' schema defaults, so the sensor could re-run a user's
selection at other sizes and write it over theirs (issue 43: a new embedding pass at
max_length 256, new shard manifests, and then the user's re-executed training run trained the
new subset). Now the only way a knob changes is a launch that gives it, and the run says so.

What a launch gives (:func:`launched_knobs`): the stage configs of its run config as given
(``{env: NAME}`` kept as such), and, for a job of another size profile than the default
(``main_job_gpu8``), that profile's knobs, which the job states. ``cpu_quick``'s jobs
(``main_job``, ``selection_job``) state no knob by being launched; their launchpad writes the
profile's values into the run config, which then gives them. One-shot knobs
(:data:`ONE_SHOT`: ``recompute``, ``retrain``) act on their run only and are never kept.

Where: the project's executor remembers a run's knobs once its settings are checked and its
partition lock is held (:func:`remember`), and logs what it changed and what it keeps; every
stage step builds its config from the partition's settings under the run's own
(:func:`apply_to_step`, from ``defs/stages.py``), logs the knobs it took from there and
records them as the ``partition_settings`` metadata; the run checks read the same effective
config (:func:`effective_run_config`). Runs that skip the project's executor (``dg.materialize``
and ``execute_in_process``: tests, notebooks) read the settings but do not change them.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Collection, Iterable, Mapping
from typing import Any

import dagster as dg
import pydantic

from cluster_pipeline.defs.configs import STAGE_CONFIGS
from cluster_pipeline.defs.profiles import DEFAULT_PROFILE, PROFILES, profile_run_config
from cluster_pipeline.selection.selectors import SelectionKnobs, own_knobs
from cluster_pipeline.storage.layout import DataLayout
from cluster_pipeline.storage.names import (
    PERIPHERAL_SUBSETS,
    PROXY_EMBEDDINGS,
    TRAINED_CHECKPOINT,
)
from cluster_pipeline.storage.partition_settings import (
    Change,
    PartitionSettings,
    SettingsUnreadable,
    read_partition_settings,
    write_partition_settings,
)

# Knobs that ask for an action of their run (embed again, train again), not a setting: kept by
# no later run.
ONE_SHOT: dict[str, frozenset[str]] = {
    PROXY_EMBEDDINGS: frozenset({"recompute"}),
    TRAINED_CHECKPOINT: frozenset({"retrain"}),
}
# Carried by every run of a job made from a size profile (defs/jobs.py).
PROFILE_TAG = "cluster_pipeline/profile"
METADATA_KEY = "partition_settings"

__all__ = [
    "METADATA_KEY",
    "ONE_SHOT",
    "SettingsUnreadable",
    "apply_to_step",
    "effective_ops",
    "effective_run_config",
    "from_settings_file",
    "give_back",
    "launched_knobs",
    "remember",
    "stored_settings",
]


def launched_knobs(
    run_config: Mapping[str, Any], tags: Mapping[str, str]
) -> dict[str, dict[str, Any]]:
    """The knobs a launch gives, stage -> knob -> value (module docstring), one-shot knobs included.

    Args:
        run_config: the run's config as launched (``DagsterRun.run_config``).
        tags: the run's tags (its job's size profile, :data:`PROFILE_TAG`).
    """
    out: dict[str, dict[str, Any]] = {}
    profile = tags.get(PROFILE_TAG, DEFAULT_PROFILE)
    if profile != DEFAULT_PROFILE and profile in PROFILES:
        for stage, body in profile_run_config(profile)["ops"].items():
            out[stage] = dict(body["config"])
    for stage, body in (run_config.get("ops") or {}).items():
        if stage in STAGE_CONFIGS and isinstance(body, Mapping):
            out.setdefault(stage, {}).update(body.get("config") or {})
    return {stage: knobs for stage, knobs in out.items() if knobs}


def _kept(stage: str, knobs: Mapping[str, Any]) -> dict[str, Any]:
    """``knobs`` of ``stage`` that a later run may take: knobs the stage still has, not
    one-shot."""
    fields = STAGE_CONFIGS[stage].model_fields if stage in STAGE_CONFIGS else {}
    skip = ONE_SHOT.get(stage, frozenset())
    return {k: v for k, v in knobs.items() if k in fields and k not in skip}


def _taken(stage: str, stored: Mapping[str, Any], launched: Mapping[str, Any]) -> dict[str, Any]:
    """The partition's knobs of ``stage`` a run takes (:func:`_kept`) where its launch does not
    give them; for ``peripheral_subsets`` only those of the selector the run uses (the launch's,
    else the stored one, else the default): another selector's knobs stay in the file, for a
    later run of that selector, and neither apply nor trip that selector's rule ("applies to
    selector ifd only"), which is for knobs a run config gives."""
    kept = {k: v for k, v in _kept(stage, stored).items() if k not in launched}
    if stage != PERIPHERAL_SUBSETS:
        return kept
    selector = launched.get("selector", stored.get("selector", SelectionKnobs().selector))
    own = own_knobs(selector)
    return {k: v for k, v in kept.items() if k in own}


def stored_settings(layout: DataLayout, dataset: str) -> PartitionSettings:
    """The partition's settings file, read, every stage and knob in it one the pipeline has.

    Raises:
        SettingsUnreadable: the file is damaged, or names a stage or knob the pipeline does not
            have (a typo made by hand, or a knob a newer version dropped: it would otherwise be
            ignored while the user believes it applies); the message names the file, the stage
            and knob, the nearest name there is, and what to do.
    """
    path = layout.partition_settings(dataset)
    settings = read_partition_settings(path, dataset)
    unknown = unknown_knobs(settings.stages)
    if unknown:
        raise SettingsUnreadable(
            f"{path}: {'; '.join(unknown)}: not in the pipeline, so it would be ignored; "
            "correct the name, or remove it from the file's 'stages'"
        )
    return settings


def unknown_knobs(stages: Mapping[str, Iterable[str]]) -> list[str]:
    """Of ``stages`` (stage -> its knob names), each stage the pipeline does not have and each
    knob its stage does not have, as ``stage 'x'`` / ``<stage>.<knob>``, each with the nearest
    name there is (`` (did you mean 'selector'?)``); [] when every name is known."""
    unknown = []
    for stage, knobs in stages.items():
        if stage not in STAGE_CONFIGS:
            unknown.append(f"stage {stage!r}{_nearest(stage, STAGE_CONFIGS)}")
            continue
        fields = STAGE_CONFIGS[stage].model_fields
        unknown += [f"{stage}.{k}{_nearest(k, fields)}" for k in knobs if k not in fields]
    return unknown


def _nearest(name: str, names: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``names`` (difflib's ratio >= 0.6), else ''."""
    close = difflib.get_close_matches(name, list(names), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def effective_ops(
    launched: Mapping[str, Mapping[str, Any]], stored: PartitionSettings
) -> dict[str, dict[str, Any]]:
    """The knobs (stage -> knob -> value) a run uses beyond the schema defaults: the
    partition's settings (those a later run may take) under the launch's own knobs."""
    stages = set(launched) | set(stored.stages)
    out = {}
    for stage in sorted(stages):
        given = launched.get(stage, {})
        knobs = {**_taken(stage, stored.knobs(stage), given), **given}
        if knobs:
            out[stage] = knobs
    return out


def effective_run_config(
    run_config: Mapping[str, Any], tags: Mapping[str, str], stored: PartitionSettings
) -> dict[str, Any]:
    """``run_config`` with its stage configs as the run uses them (:func:`effective_ops`): what
    the run checks validate."""
    ops = effective_ops(launched_knobs(run_config, tags), stored)
    other = {k: v for k, v in (run_config.get("ops") or {}).items() if k not in ops}
    return {**run_config, "ops": {**other, **{s: {"config": k} for s, k in ops.items()}}}


def _value(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def _shown(value: Any) -> str:
    """A knob's value for a log line, ``{env: NAME}`` as such (never the variable's value)."""
    if isinstance(value, Mapping) and set(value) == {"env"}:
        return f"{{env: {value['env']}}}"
    return _value(value)


def remember(
    layout: DataLayout, dataset: str, run_id: str, launched: Mapping[str, Mapping[str, Any]]
) -> tuple[PartitionSettings, list[str]]:
    """Record the knobs a run's launch gives as the partition's settings (one-shot knobs left
    out; call it under the partition's lock) and say what changed.

    Returns:
        (the settings now, the changed knobs: ``proxy_embeddings.max_length: 512 -> 256``; a
        knob no launch had given, given its default, is recorded but not listed).

    Raises:
        SettingsUnreadable: the file is damaged.
        OSError: the file cannot be written.
    """
    stored = stored_settings(layout, dataset)
    kept = {stage: _kept(stage, knobs) for stage, knobs in launched.items()}
    updated, changes = stored.with_launch({s: k for s, k in kept.items() if k}, run_id)
    if changes:
        write_partition_settings(layout.partition_settings(dataset), updated)
    # A knob first given its default changes nothing the run does: recorded, not listed (a new
    # user's first run listed all 24 knobs as "(default) -> <the same default>").
    return updated, [c.describe() for c in changes if c.was_set or not _is_default(c)]


def _is_default(change: Change) -> bool:
    """Whether ``change`` gives its knob the value its stage's schema defaults to."""
    fields = getattr(STAGE_CONFIGS.get(change.stage), "model_fields", {})
    return change.knob in fields and fields[change.knob].default == change.after


def give_back(
    layout: DataLayout, dataset: str, run_id: str, only: Collection[str] | None = None
) -> list[str]:
    """Take back the knobs run ``run_id`` recorded at launch for the stages ``only`` (None:
    every stage; its settings were refused in a step: call it under the partition's lock, which
    the run holds), each to the value it replaced or to no value; say which
    (``balanced_clusters.num_clusters: 100 -> (default)``).

    Raises:
        SettingsUnreadable: the file is damaged.
        OSError: the file cannot be written.
    """
    stored = stored_settings(layout, dataset)
    restored, changes = stored.without_run(run_id, only)
    if changes:
        write_partition_settings(layout.partition_settings(dataset), restored)
    return [c.describe() for c in changes]


def from_settings_file(
    problems: Iterable[str], launched: Mapping[str, Mapping[str, Any]], stored: PartitionSettings
) -> list[str]:
    """The knobs (``stage.knob``) that ``problems`` (run-check lines, ``<stage>.<knob> = <value>:
    <rule>``) refuse and that the run took from the partition's settings file, not from its
    own config: the ones the file's note is about."""
    out = []
    for problem in problems:
        name = problem.split(" = ", 1)[0]
        stage, _, knob = name.partition(".")
        if knob in stored.knobs(stage) and knob not in launched.get(stage, {}):
            out.append(name)
    return out


def run_settings_line(
    dataset: str,
    path: str,
    stages: Iterable[str],
    launched: Mapping[str, Mapping[str, Any]],
    stored: PartitionSettings,
    changes: list[str],
) -> str | None:
    """The run's line about its partition's settings: the knobs this launch changed, and those
    of its stages it takes from earlier launches; None when there is neither."""
    taken = []
    for stage in stages:
        # Those the run takes: another selector's knobs stay in the file unused (_taken).
        for knob, value in sorted(
            _taken(stage, stored.knobs(stage), launched.get(stage, {})).items()
        ):
            origin = stored.origin(stage, knob)
            by = f" ({origin})" if origin else ""
            taken.append(f"{stage}.{knob} = {_shown(value)}{by}")
    if not taken and not changes:
        return None
    parts = []
    if changes:
        parts.append("this run's config changes " + ", ".join(changes))
    if taken:
        kept = ", ".join(taken)
        parts.append(f"not given by this run's config, kept from earlier launches: {kept}")
    return f"settings of dataset partition {dataset!r} ({path}): " + "; ".join(parts)


def _resolve(stage: str, knobs: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``knobs`` with Dagster's ``{env: NAME}`` read from the environment, as Dagster reads a
    run config's.

    Raises:
        dagster.Failure: a variable is not set (names the knob, the variable and the file).
    """
    out = {}
    for knob, value in knobs.items():
        if isinstance(value, Mapping) and set(value) == {"env"}:
            name = str(value["env"])
            if name not in os.environ:
                raise dg.Failure(
                    description=f"{stage}.{knob} = {{env: {name}}} (from {where}): the "
                    f"environment variable {name} is not set where the step runs; set it, or "
                    f"give {stage}.{knob} in the run config"
                )
            out[knob] = os.environ[name]
        else:
            out[knob] = value
    return out


def apply_to_step(
    context: dg.AssetExecutionContext, layout: DataLayout, config: dg.Config
) -> dg.Config:
    """The step's config as the run uses it: ``config`` (the run config over the schema
    defaults, as Dagster built it) with each knob of the partition's settings that the run's
    launch does not give. When that changes a knob, one log line says which, with the value and
    the run that set it, and the asset's ``partition_settings`` metadata lists them.

    Raises:
        dagster.Failure: the settings file is damaged, or a kept knob no longer validates (names
            the file and the knob).
    """
    stage, dataset = context.op_def.name, context.partition_key
    if stage not in STAGE_CONFIGS or not isinstance(config, STAGE_CONFIGS[stage]):
        return config
    path = layout.partition_settings(dataset)
    try:
        stored = stored_settings(layout, dataset)
    except SettingsUnreadable as e:
        raise dg.Failure(description=f"{stage}: {e}") from e
    launched = launched_knobs(context.run.run_config, context.run.tags).get(stage, {})
    taken = _taken(stage, stored.knobs(stage), launched)
    # The launch's own knobs as Dagster gave them (a job's profile too, which Dagster applies
    # as the job's config: the same values), over the partition's.
    own = {k: v for k, v in launched.items() if k in type(config).model_fields}
    if not taken and not own:
        return config
    values = {
        **config.model_dump(),
        **_resolve(stage, taken, str(path)),
        **_resolve(stage, own, "the run config"),
    }
    try:
        merged = type(config).model_validate(values)
    except pydantic.ValidationError as e:
        bad = ", ".join(str(err["loc"][0]) for err in e.errors() if err["loc"])
        raise dg.Failure(
            description=f"{stage}: the settings of dataset partition {dataset!r} ({path}) give "
            f"{bad} a value the stage refuses ({e.errors()[0]['msg']}); give {bad} in the run "
            "config, or edit or delete the file"
        ) from e
    differ = {k: taken[k] for k in taken if getattr(merged, k) != getattr(config, k)}
    if differ:
        shown = ", ".join(
            f"{k} = {_shown(v)}"
            + (f" ({stored.origin(stage, k)})" if stored.origin(stage, k) else "")
            for k, v in differ.items()
        )
        context.log.info(
            f"{stage}: not given by this run's config, kept from the settings dataset "
            f"partition {dataset!r} was last launched with ({path}): {shown}"
        )
        context.add_asset_metadata(
            {METADATA_KEY: {k: _shown(v) for k, v in differ.items()}},
            asset_key=context.asset_key,
        )
    return merged

"""Every stage config of a run, checked before the run's first step does any work.

Dagster checks a run config against each stage's schema at launch, but the schema it derives
from a ``dg.Config`` class carries only types and choices: a knob's bounds (pydantic ``Field``
``ge``/``gt``/``le``, validators such as the benchmark names) are checked when the step builds
its config object, i.e. inside the step, after every earlier step of the run has done its work
(issue 23: ``ratio: 1.5`` refused only after the embedding pass). :func:`check_run` validates
them all up front, for every entry (the project's executor calls it in the run's worker before
any step; ``cluster-pipeline`` calls :func:`check_run_config`), together with the rules that
span stages or need the data and the base model:

- ``balanced_clusters.num_clusters`` at most the training pool N (the latest
  ``raw_instructions`` when the run does not re-read the data; ``max_train_samples`` when it
  does) and a multiple of the torchrun agents (nodes), as ``proxy_embeddings.world_size``;
- ``raw_instructions.heldout_fraction`` above 0 when the run evaluates (``eval_report`` scores
  the held-out split);
- each ``max_length`` (``proxy_embeddings``, ``trained_checkpoint``, ``eval_report``) at least
  what the base model's chat template writes before an answer, plus one token
  (:func:`~cluster_pipeline.data.tokenization.min_prompted_length`); the three may differ
  (training on shorter sequences than were embedded is allowed);
- the selection knobs: a knob of another selector than the run's is refused (``applies to
  selector s2l only``), and the chosen selector's own rules apply (its spec's ``rules``, in
  its module under selection/selectors/: a targeted selector's ``target`` names a benchmark
  whose file is found, where the run's worker knows the data folder, or a readable folder;
  s2l's steps a multiple of its checkpoints and its trajectory clusters at most N; less's
  warm-up share at least ``proxy_embeddings.world_size`` samples), with what is known of the
  pool (N where known); an r that keeps no sample is refused before clustering.

A refusal is one line per problem, ``<stage>.<knob> = <value>: <rule>``, joined by ``; ``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg
import pydantic

from cluster_pipeline.defs.configs import STAGE_CONFIGS
from cluster_pipeline.defs.partition_settings import (
    SettingsUnreadable,
    effective_run_config,
    from_settings_file,
    give_back,
    launched_knobs,
    stored_settings,
)
from cluster_pipeline.defs.records import (
    RawInstructionsRecord,
    UpstreamNotMaterialized,
    latest_record,
)
from cluster_pipeline.defs.resources import (
    BaseModelResource,
    TorchrunResource,
    TrackingResource,
)
from cluster_pipeline.evaluation.targets import target_problem, target_samples
from cluster_pipeline.models.loading import local_model
from cluster_pipeline.selection.passes import SelectionFacts
from cluster_pipeline.selection.selectors import (
    REGISTRY,
    knobs_of,
    misplaced_knobs,
    selector_rules,
)
from cluster_pipeline.storage.cache import JsonCache, model_fingerprint
from cluster_pipeline.storage.layout import SHARED_EVAL_DIR, DataLayout
from cluster_pipeline.storage.partition_settings import PartitionSettings


def stage_configs() -> dict[str, type[dg.Config]]:
    """Each stage's run config class (defs/configs.py)."""
    return STAGE_CONFIGS


LENGTH_STAGES = ("proxy_embeddings", "trained_checkpoint", "eval_report")
# The stages that open or add to an MLflow run (the tracking resource).
TRACKED_STAGES = ("peripheral_subsets", "trained_checkpoint", "eval_report")


class ConfigRefused(ValueError):
    """A run's settings are refused; the message is one line, ``<stage>.<knob> = <value>:
    <rule>`` for each problem, joined by ``; ``."""


@dataclass(frozen=True)
class RunFacts:
    """What the rules across stages know beyond the run config; None where unknown.

    ``train_samples`` / ``heldout_samples``: of the dataset's latest ``raw_instructions``;
    ``text_records``: whether it holds prompt-less ``text`` records (they fit any length);
    ``min_length``: :func:`~cluster_pipeline.data.tokenization.min_prompted_length` of the base
    model ``model``; ``agents``: torchrun agents (nodes) ranks are split over;
    ``eval_folders``: where a target set's benchmark file is looked for.
    """

    dataset: str | None = None
    train_samples: int | None = None
    heldout_samples: int | None = None
    text_records: bool = False
    min_length: int | None = None
    model: str = ""
    agents: int = 1
    # Where benchmark files are looked for (a target set's); empty: not checked.
    eval_folders: tuple[Path, ...] = ()


def _value(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def _env_source(value: Any) -> str | None:
    """NAME when ``value`` is Dagster's environment-variable source ``{env: NAME}``."""
    if isinstance(value, Mapping) and len(value) == 1 and isinstance(value.get("env"), str):
        return value["env"]
    return None


def resolve_env_sources(
    config: Mapping[str, Any], where: str
) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """``config`` (one stage's or resource's run config) with every ``{env: NAME}`` value, a
    knob's own or an element of a list knob's, replaced by the environment variable NAME.

    Dagster's config schema lets every ``int``, ``str`` and ``bool`` knob of a ``dg.Config``
    take a value or ``{env: NAME}`` (IntSource, StringSource, BoolSource: the launchpad types
    them ``Int | { One of the following: env: String }``) and reads NAME in the process that
    builds the step's config; the run checks read it the same way, here, so a knob given
    ``{env: NAME}`` is checked against its bounds like any other (its value is never printed:
    a refusal shows ``{env: NAME}``, as Dagster keeps a variable's value out of its errors).

    Args:
        config: knob -> value, as the run config gives it.
        where: what ``config`` configures (``trained_checkpoint``), for the problems' names.

    Returns:
        (the config with the variables' values, the knobs read from a variable -> NAME, one
        ``<where>.<knob> = {env: NAME}: ...`` problem per variable that is not set; a knob of
        an unset variable is left out of the config).
    """
    resolved: dict[str, Any] = {}
    sources: dict[str, str] = {}
    problems: list[str] = []

    def read(knob: str, value: Any) -> tuple[bool, Any]:
        name = _env_source(value)
        if name is None:
            return True, value
        sources[knob] = name
        if name not in os.environ:
            problems.append(
                f"{where}.{knob} = {{env: {name}}}: the environment variable {name} is not "
                "set where the run's steps run; set it, or give the value itself"
            )
            return False, None
        return True, os.environ[name]

    for knob, value in config.items():
        if isinstance(value, list):
            items = [read(knob, v) for v in value]
            if all(ok for ok, _ in items):
                resolved[knob] = [v for _, v in items]
            continue
        ok, value = read(knob, value)
        if ok:
            resolved[knob] = value
    return resolved, sources, problems


def _rule(message: str) -> str:
    # pydantic's own words for a bound ("Input should be greater than 0"), without the noise
    # its validators add ("Value error, ...").
    return message.removeprefix("Value error, ")


def _non_finite(value: Any) -> bool:
    """Whether a config value is or holds (in a list or mapping) an infinite or NaN float."""
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, Mapping):
        return any(_non_finite(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_non_finite(v) for v in value)
    return False


def validate_stages(
    run_config: Mapping[str, Any], stages: Collection[str]
) -> tuple[dict[str, Any], list[str]]:
    """Each stage's config object (run config over the schema defaults), and the problems of
    the stages whose config does not validate, one ``<stage>.<knob> = <value>: <rule>`` each."""
    ops = run_config.get("ops") or {}
    classes = stage_configs()
    configs: dict[str, Any] = {}
    problems: list[str] = []
    for stage in stages:
        if stage not in classes:
            continue
        given, sources, unset = resolve_env_sources(
            (ops.get(stage) or {}).get("config") or {}, stage
        )
        problems += unset
        known = classes[stage].model_fields
        for knob in sorted(given):
            if _non_finite(given[knob]):
                # (pydantic passes inf through ge/le-less bounds and ge=1 alike: no knob is
                # meant to be infinite or NaN.)
                problems.append(
                    f"{stage}.{knob} = {_value(given[knob])}: not a finite number; give a "
                    "finite value"
                )
        given = {k: v for k, v in given.items() if not _non_finite(v)}
        for knob in sorted(set(given) - set(known)):
            # (Dagster refuses these at launch too; dg.Config itself ignores them.)
            problems.append(
                f"{stage}.{knob} = {_value(given[knob])}: not a knob of {stage}; its knobs: "
                + ", ".join(known)
            )
        try:
            configs[stage] = classes[stage].model_validate(given)
        except pydantic.ValidationError as e:
            bad = set()
            for err in e.errors():
                knob = ".".join(str(x) for x in err["loc"]) or "config"
                bad.add(str(err["loc"][0]) if err["loc"] else knob)
                top = str(err["loc"][0]) if err["loc"] else ""
                value = f"{{env: {sources[top]}}}" if top in sources else _value(err.get("input"))
                owner = _owner(stage, knob, given, classes[stage])
                rule = _rule(err["msg"]) if owner is None else owner
                problems.append(f"{stage}.{knob} = {value}: {rule}")
            # The rules across knobs and stages still run, over the knobs that are valid (the
            # others at their defaults), so one message names every problem.
            try:
                valid = {k: v for k, v in given.items() if k not in bad}
                configs[stage] = classes[stage].model_validate(valid)
            except pydantic.ValidationError:
                pass
    return configs, problems


def _owner(stage: str, knob: str, given: Mapping[str, Any], cls: type[dg.Config]) -> str | None:
    """For a peripheral_subsets knob of another selector than the run's: that it does not
    apply (instead of the bound it broke, which would not matter); None otherwise."""
    if stage != "peripheral_subsets":
        return None
    selector = given.get("selector", cls.model_fields["selector"].default)
    return misplaced_knobs(selector, [knob]).get(knob)


def stage_rules(configs: Mapping[str, Any], facts: RunFacts) -> list[str]:
    """The problems of the rules across stages (module docstring) for the stages in
    ``configs`` (those of the run)."""
    problems: list[str] = []
    raw, clusters = configs.get("raw_instructions"), configs.get("balanced_clusters")
    embed = configs.get("proxy_embeddings")
    where = f"dataset {facts.dataset!r}" if facts.dataset else "the dataset"
    if clusters is not None:
        k = clusters.num_clusters
        cap = getattr(raw, "max_train_samples", None)
        if facts.train_samples is not None and k > facts.train_samples:
            problems.append(
                f"balanced_clusters.num_clusters = {k}: more clusters than the "
                f"{facts.train_samples} training samples of {where} (raw_instructions); K <= N"
            )
        elif cap is not None and k > cap:
            problems.append(
                f"balanced_clusters.num_clusters = {k}: more clusters than training samples "
                f"(raw_instructions.max_train_samples = {cap} caps N); K <= N"
            )
        if "trained_checkpoint" in configs and k % facts.agents:
            problems.append(
                f"balanced_clusters.num_clusters = {k}: K training ranks must split evenly over "
                f"the {facts.agents} torchrun agents (resources.torchrun nnodes)"
            )
    if embed is not None and embed.world_size % facts.agents:
        problems.append(
            f"proxy_embeddings.world_size = {embed.world_size}: must be a multiple "
            f"of the {facts.agents} torchrun agents (resources.torchrun nnodes)"
        )
    subsets = configs.get("peripheral_subsets")
    if subsets is not None:
        problems += _selection_rules(subsets, embed, facts)
    if subsets is not None and clusters is not None and facts.train_samples is not None:
        problems += _empty_subset_rule(subsets, clusters.num_clusters, embed, facts)
    if "eval_report" in configs and raw is not None and raw.heldout_fraction == 0:
        problems.append(
            f"raw_instructions.heldout_fraction = {raw.heldout_fraction}: "
            "eval_report scores the held-out split, so it must be > 0 when the run evaluates"
        )
    if facts.min_length is not None and not facts.text_records:
        for stage in LENGTH_STAGES:
            config = configs.get(stage)
            length = getattr(config, "max_length", None)
            if length is not None and length < facts.min_length:
                problems.append(
                    f"{stage}.max_length = {length}: too short for any sample: the chat "
                    f"template of {facts.model} writes {facts.min_length - 1} tokens before an "
                    f"answer even for an empty question, so max_length must be >= "
                    f"{facts.min_length}"
                )
    return problems


def _selection_rules(subsets: Any, embed: Any, facts: RunFacts) -> list[str]:
    """The selection knobs' rules: a knob given for another selector than the run's
    (``applies to ... only``), then the selector's own rules (its spec's ``rules``) with what
    is known of the pool."""
    selector = subsets.selector
    given = {k: getattr(subsets, k) for k in sorted(subsets.model_fields_set)}
    problems = [
        f"peripheral_subsets.{knob} = {_value(given[knob])}: {rule}"
        for knob, rule in misplaced_knobs(selector, _in_field_order(subsets, given)).items()
    ]
    where = f"dataset {facts.dataset!r}" if facts.dataset else "the dataset"
    pool = SelectionFacts(
        pool_size=facts.train_samples,
        pool_is=f"training samples of {where}",
        world_size=getattr(embed, "world_size", 1),
        target_problem=lambda target, size, name: _target_problem(
            target, size, name, facts.eval_folders
        ),
    )
    return problems + selector_rules(selector, knobs_of(selector, subsets), pool)


def _in_field_order(config: Any, knobs: Collection[str]) -> list[str]:
    return [k for k in type(config).model_fields if k in knobs]


def _target_problem(
    target: str | None, size: int, selector: str, folders: tuple[Path, ...]
) -> str | None:
    """Why a target set cannot give the selector its samples (None when it can): a benchmark
    whose file is not found where the run's worker knows the data folder, or a folder whose
    first ``size`` distinct samples cannot be read now, as the selector's pass will read them
    (an empty folder, or a bad file or record, named by file and line), before any model
    loads."""
    problem = target_problem(target, folders or None, selector)
    if problem is not None or target is None or not Path(target).is_dir():
        return problem
    try:
        target_samples(target, size, [])
    except ValueError as e:  # DatasetFormatError is one
        return str(e)
    except OSError as e:
        return f"cannot be read ({e}); give a folder of sample files this user can read"
    return None


def _empty_subset_rule(subsets: Any, k: int, embed: Any, facts: RunFacts) -> list[str]:
    """An empty subset, known before clustering. Sample balance keeps floor(r m) per cluster,
    m the smallest cluster, m <= N / K; token balance floor(r L_min) tokens, L_min the smallest
    cluster's tokens, L_min <= N x max_length / K. Either bound at 0 keeps nothing."""
    if not REGISTRY[subsets.selector].budgeted:
        return []
    n, r = facts.train_samples or 0, subsets.ratio
    if subsets.balance == "samples":
        bound, what = f"floor(r N / K) = floor({r} x {n} / {k})", math.floor(round(r * n / k, 9))
    else:
        length = getattr(embed, "max_length", None)
        if length is None:
            return []
        bound = f"floor(r N max_length / K) = floor({r} x {n} x {length} / {k})"
        what = math.floor(round(r * n * length / k, 9))
    if what > 0:
        return []
    unit = "samples" if subsets.balance == "samples" else "tokens"
    return [
        f"peripheral_subsets.ratio = {_value(r)}: keeps no sample: every cluster keeps at most "
        f"{bound} = 0 {unit} (balance: {subsets.balance}); raise it"
    ]


def check_stages(
    run_config: Mapping[str, Any], stages: Collection[str], facts: RunFacts = RunFacts()
) -> dict[str, Any]:
    """:func:`validate_stages` then :func:`stage_rules`.

    Returns:
        The validated config of each stage of ``stages``.

    Raises:
        ConfigRefused: any problem (all of them in one line).
    """
    configs, problems = validate_stages(run_config, stages)
    problems += stage_rules(configs, facts)
    if problems:
        raise ConfigRefused("; ".join(problems))
    return configs


def min_length_of(model_path: str, layout: DataLayout) -> int:
    """:func:`~cluster_pipeline.data.tokenization.min_prompted_length` of a local model,
    cached per model (loading a tokenizer takes seconds; the cache a file read)."""
    cache = JsonCache(layout.root / "cache" / "template_lengths")
    key = model_fingerprint(model_path)[:20]
    found = cache.get(key)
    if isinstance(found, int):
        return found
    # Here, not at the top: not a cycle, the import cost (transformers), which the definitions
    # must not pay (cluster_pipeline_tests/test_layout.py).
    from cluster_pipeline.data.tokenization import min_prompted_length
    from cluster_pipeline.models.loading import load_tokenizer

    length = min_prompted_length(load_tokenizer(model_path))
    cache.put(key, length)
    return length


def resource_config(run_config: Mapping[str, Any], resource: str) -> dict[str, Any]:
    """A resource's config in ``run_config``, ``{env: NAME}`` values read
    (:func:`resolve_env_sources`; one whose variable is not set is left at its default, as
    Dagster refuses such a run at launch)."""
    given = ((run_config.get("resources") or {}).get(resource) or {}).get("config") or {}
    return resolve_env_sources(given, resource)[0]


def run_facts(
    run_config: Mapping[str, Any],
    stages: Collection[str],
    instance: dg.DagsterInstance | None,
    dataset: str | None,
    layout: DataLayout,
) -> RunFacts:
    """The :class:`RunFacts` of a run: the dataset's latest ``raw_instructions`` record (when
    the instance has one), the base model's template length when the model is already on
    disk (the built-in one once converted; otherwise the stage checks it before loading it),
    and the torchrun agents."""
    train = heldout = None
    text_records = False
    if instance is not None and dataset is not None:
        try:
            record = latest_record(instance, RawInstructionsRecord, dataset)
        except UpstreamNotMaterialized:
            record = None
        if record is not None:
            text_records = record.forms.get("text", 0) > 0
            if "raw_instructions" not in stages:  # else this run reads the data again
                train, heldout = record.train_samples, record.heldout_samples
    model = BaseModelResource(**resource_config(run_config, "base_model")).model
    min_length = None
    if any(stage in stages for stage in LENGTH_STAGES):
        path = local_model(model, layout.models_dir)
        if path is not None:
            min_length = min_length_of(path, layout)
    torchrun = TorchrunResource(**resource_config(run_config, "torchrun"))
    return RunFacts(
        dataset=dataset,
        train_samples=train,
        heldout_samples=heldout,
        text_records=text_records,
        min_length=min_length,
        model=model,
        agents=torchrun.agents,
        eval_folders=(layout.eval_dir, SHARED_EVAL_DIR),
    )


def check_run(
    run_config: Mapping[str, Any],
    stages: Collection[str],
    instance: dg.DagsterInstance | None,
    dataset: str | None,
    layout: DataLayout,
) -> dict[str, Any]:
    """Check the config of every stage of a run (``stages``: the steps it executes).

    Raises:
        ConfigRefused: the one-line refusal (module docstring).
    """
    _, problems = validate_stages(run_config, stages)
    problems += tracking_problems(run_config, stages)
    if problems:  # bounds first: the rules below read valid configs only
        raise ConfigRefused("; ".join(problems))
    return check_stages(
        run_config, stages, run_facts(run_config, stages, instance, dataset, layout)
    )


def tracking_problems(run_config: Mapping[str, Any], stages: Collection[str]) -> list[str]:
    """The tracking settings a run with a tracked stage (:data:`TRACKED_STAGES`) is refused
    for (:meth:`~cluster_pipeline.defs.resources.TrackingResource.problems`: an unknown
    ``$CLUSTER_PIPELINE_TRACKING``, an empty ``experiment_name``, a tracking URI MLflow cannot
    track to), checked before any MLflow call; none for a run without one."""
    if not any(stage in stages for stage in TRACKED_STAGES):
        return []
    given = resource_config(run_config, "tracking")
    return TrackingResource(**given).problems(check_switch="enabled" not in given)


def check_run_config(config: Mapping[str, Any]) -> None:
    """:func:`check_stages` for the stages a run config names (no instance, data or model: the
    CLI's check of a config it prints).

    Raises:
        ConfigRefused (a ValueError): see :func:`check_stages`.
    """
    check_stages(config, list((config.get("ops") or {}).keys()))


def run_stages(context: dg.AssetExecutionContext) -> list[str]:
    """The stages the run of ``context`` executes (its job's steps, or the re-executed
    subset)."""
    names = [node.name for node in context.job_def.nodes_in_topological_order]
    keys = context.run.step_keys_to_execute
    return [n for n in names if keys is None or n in keys]


def recheck_settings(
    context: dg.AssetExecutionContext,
    layout: DataLayout,
    model_path: str,
    agents: int,
    instructions: RawInstructionsRecord | None = None,
) -> None:
    """The rules of :func:`check_run` again, inside a step that is about to load the base model
    (``model_path``, on disk by now) and launch torchrun, with what it knows by now: the chat
    template's length, which the run's worker could not measure before the built-in model was
    converted, and the pool N and forms of ``instructions`` (the ``raw_instructions`` record
    the step reads, written earlier in this run, perhaps). The run config is read as the run
    uses it: its knobs over the partition's settings (defs/partition_settings.py).

    Raises:
        dagster.Failure: the one-line refusal.
    """
    path = local_model(model_path, layout.models_dir)
    dataset = context.partition_key if context.has_partition_key else None
    run_config: Mapping[str, Any] = context.run.run_config
    stored = None
    if dataset is not None:
        try:
            stored = stored_settings(layout, dataset)
        except SettingsUnreadable as e:
            raise dg.Failure(description=str(e)) from e
        run_config = effective_run_config(run_config, context.run.tags, stored)
    facts = RunFacts(
        dataset=dataset,
        train_samples=instructions.train_samples if instructions else None,
        text_records=bool(instructions and instructions.forms.get("text", 0)),
        min_length=min_length_of(path, layout) if path else None,
        model=model_path,
        agents=agents,
    )
    configs, _ = validate_stages(run_config, run_stages(context))
    problems = stage_rules(configs, facts)
    if problems:
        notes = _refused_settings(context, layout, problems, stored)
        raise dg.Failure(description="; ".join(problems) + notes)


def refused_in_step(
    context: dg.AssetExecutionContext, layout: DataLayout, problem: str
) -> dg.Failure:
    """The failure of a step that refuses this run's settings with what it knows by now (a
    selector's rules, a pool one rank would find empty, a cluster count against the pool): as
    :func:`recheck_settings`, the knobs this run recorded at launch are taken back from the
    partition's settings file, so the sensor, the schedule and a config-less run do not repeat
    the refused run, and the message says which (docs/guide/settings.md).

    Args:
        context: the step's context (its partition and run).
        layout: the data folder's layout (the settings file).
        problem: the refusal, one line.

    Returns:
        The ``dagster.Failure`` to raise.
    """
    stored = None
    if context.has_partition_key:
        try:
            stored = stored_settings(layout, context.partition_key)
        except SettingsUnreadable as e:
            return dg.Failure(description=f"{problem} ({e})")
    return dg.Failure(description=problem + _refused_settings(context, layout, [problem], stored))


def _refused_settings(
    context: dg.AssetExecutionContext,
    layout: DataLayout,
    problems: list[str],
    stored: PartitionSettings | None,
) -> str:
    """What a refusal inside a step does to the partition's settings, said: the knobs this
    run recorded at launch for this step and the steps after it are given back (a refused value
    must not be what the sensor, the schedule or a re-execution runs with next; the steps that
    completed keep theirs, which made their tables), and the refused knobs the run took from the
    settings file are named with it."""
    if stored is None:
        return ""
    dataset = context.partition_key
    notes = []
    launched = launched_knobs(context.run.run_config, context.run.tags)
    taken = from_settings_file(problems, launched, stored)
    if taken:
        notes.append(
            f"{', '.join(taken)}: not given by this run's config, taken from "
            f"{layout.partition_settings(dataset)}: give them in the run config, or edit or "
            "delete the file"
        )
    try:
        stages, step = run_stages(context), context.op_def.name
        rest = stages[stages.index(step) :] if step in stages else None
        given_back = give_back(layout, dataset, context.run_id, rest)
    except (SettingsUnreadable, OSError) as e:
        notes.append(f"this run's settings could not be taken back from the settings file: {e}")
    else:
        if given_back:
            notes.append(
                f"this run's settings are not kept for dataset partition {dataset!r}: "
                + ", ".join(given_back)
            )
    return f" ({'; '.join(notes)})" if notes else ""

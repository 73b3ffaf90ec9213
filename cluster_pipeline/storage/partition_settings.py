"""The settings a dataset partition was launched with: one JSON file per partition, so every
later launch of it (the automation sensor, the nightly schedule, a re-execution, the CLI, the
UI's *Materialize*) runs with them unless it gives its own (docs/design.md, "Runs: settings,
one per partition").

``<data>/settings/<dataset>.json`` holds, per stage and knob, the value a launch last gave
(as the run config gave it: a value, or Dagster's ``{env: NAME}``) and which run gave it and
when, and what it replaced (so that a run whose settings are refused inside a step can give
them back: :meth:`PartitionSettings.without_run`)::

    {"dataset": "tiny", "stages": {"proxy_embeddings": {"max_length": 512}},
     "origins": {"proxy_embeddings": {"max_length": {"run_id": "1a2b...", "at": "2026-...",
                                                     "replaced": {"value": 256, "run_id": ...}}}}}

(``replaced`` absent: no launch had given the knob.)

A knob no launch gave is absent (the stage's default applies). The file is written atomically
under the partition's run lock (``defs/executor.py``) and read by every step of the partition.
Nothing here knows which knobs exist: the Dagster layer decides what is kept
(``defs/partition_settings.py``).
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster_pipeline.storage.atomic import write_text


class SettingsUnreadable(ValueError):
    """A partition's settings file that is not the JSON this module writes (edited by hand,
    truncated); the message names the file and what to do."""


@dataclass(frozen=True)
class Change:
    """One knob a launch set: its stage, name, the value before (None with ``was_set`` False:
    no launch had given it) and the value now."""

    stage: str
    knob: str
    before: Any
    after: Any
    was_set: bool
    unset: bool = False  # the knob is given no value now (its stage's default applies)

    def describe(self) -> str:
        """``proxy_embeddings.max_length: 512 -> 256`` (``(default) -> 256`` when it was
        unset, ``256 -> (default)`` when it is unset now)."""
        before = json.dumps(self.before) if self.was_set else "(default)"
        after = "(default)" if self.unset else json.dumps(self.after)
        return f"{self.stage}.{self.knob}: {before} -> {after}"


@dataclass(frozen=True)
class PartitionSettings:
    """The settings of one dataset partition.

    Attributes:
        dataset: the partition.
        stages: stage -> knob -> the value a launch last gave (JSON values).
        origins: stage -> knob -> ``{"run_id": ..., "at": ISO time}`` of the launch that gave it,
            with ``"replaced": {"value": ..., "run_id": ..., "at": ...}`` where it replaced a
            value a launch had given.
    """

    dataset: str
    stages: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    origins: Mapping[str, Mapping[str, Mapping[str, Any]]] = field(default_factory=dict)

    def knobs(self, stage: str) -> dict[str, Any]:
        """The knobs (name -> value) of ``stage`` ({} when no launch gave any)."""
        return dict(self.stages.get(stage, {}))

    def origin(self, stage: str, knob: str) -> str:
        """``run 1a2b3c4d`` (the first 8 characters of the run id) that gave the knob, or ''."""
        run_id = self.origins.get(stage, {}).get(knob, {}).get("run_id", "")
        return f"run {run_id[:8]}" if run_id else ""

    def with_launch(
        self, launched: Mapping[str, Mapping[str, Any]], run_id: str, at: dt.datetime | None = None
    ) -> tuple[PartitionSettings, list[Change]]:
        """These settings with every knob of ``launched`` (stage -> knob -> value) set, each
        recorded as given by ``run_id`` at ``at`` (now, UTC); and the knobs whose value that
        changed, in stage then knob order (a knob given again with its value is no change, and
        keeps its first origin).
        """
        when = (at or dt.datetime.now(dt.UTC)).isoformat(timespec="seconds")
        stages = {s: dict(k) for s, k in self.stages.items()}
        origins = {s: {k: dict(o) for k, o in v.items()} for s, v in self.origins.items()}
        changes = []
        for stage in sorted(launched):
            for knob in sorted(launched[stage]):
                value = launched[stage][knob]
                had = knob in stages.get(stage, {})
                if had and stages[stage][knob] == value:
                    continue
                changes.append(Change(stage, knob, stages.get(stage, {}).get(knob), value, had))
                origin: dict[str, Any] = {"run_id": run_id, "at": when}
                if had:
                    before = origins.get(stage, {}).get(knob, {})
                    origin["replaced"] = {
                        "value": stages[stage][knob],
                        **{k: v for k, v in before.items() if k in ("run_id", "at")},
                    }
                stages.setdefault(stage, {})[knob] = value
                origins.setdefault(stage, {})[knob] = origin
        return PartitionSettings(self.dataset, stages, origins), changes

    def without_run(
        self, run_id: str, only: Collection[str] | None = None
    ) -> tuple[PartitionSettings, list[Change]]:
        """These settings with every knob that run ``run_id`` set given back: the value it
        replaced (with that value's origin), or no value where no launch had given one; and
        those knobs, as changes from the run's value back. For a run whose settings a step
        refused: what it recorded at launch must not outlive it. ``only``: the stages whose
        knobs are given back (None: all; the stages that completed keep theirs)."""
        stages = {s: dict(k) for s, k in self.stages.items()}
        origins = {s: {k: dict(o) for k, o in v.items()} for s, v in self.origins.items()}
        changes = []
        for stage in sorted(s for s in origins if only is None or s in only):
            for knob in sorted(origins[stage]):
                origin = origins[stage][knob]
                if origin.get("run_id") != run_id or knob not in stages.get(stage, {}):
                    continue
                value, replaced = stages[stage][knob], origin.get("replaced")
                if replaced is None:
                    del stages[stage][knob], origins[stage][knob]
                    changes.append(Change(stage, knob, value, None, True, unset=True))
                else:
                    stages[stage][knob] = replaced["value"]
                    origins[stage][knob] = {k: v for k, v in replaced.items() if k != "value"}
                    changes.append(Change(stage, knob, value, replaced["value"], True))
        stages = {s: k for s, k in stages.items() if k}
        origins = {s: o for s, o in origins.items() if o}
        return PartitionSettings(self.dataset, stages, origins), changes

    def to_json(self) -> str:
        """The file's text (sorted keys, one level of indentation per mapping)."""
        body = {"dataset": self.dataset, "stages": self.stages, "origins": self.origins}
        return json.dumps(body, indent=1, sort_keys=True) + "\n"


def read_partition_settings(path: Path, dataset: str) -> PartitionSettings:
    """The settings in ``path`` (empty settings when the file does not exist).

    Raises:
        SettingsUnreadable: the file is not this module's JSON (names the file; deleting it
            makes every knob's default apply again).
    """
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return PartitionSettings(dataset)
    try:
        body = json.loads(text)
        stages, origins = body.get("stages", {}), body.get("origins", {})
        ok = isinstance(stages, dict) and isinstance(origins, dict)
        ok = ok and all(isinstance(v, dict) for v in (*stages.values(), *origins.values()))
    except (ValueError, AttributeError):
        ok = False
    if not ok:
        raise SettingsUnreadable(
            f"{path}: not a settings file of dataset {dataset!r} (JSON with 'stages' and "
            "'origins' mappings); fix it, or delete it to run with the stages' defaults (the "
            "next launch with a run config writes it again)"
        )
    return PartitionSettings(dataset, stages, origins)


def write_partition_settings(path: Path, settings: PartitionSettings) -> None:
    """Write ``settings`` to ``path`` atomically (a reader sees the old file or the new one).

    Raises:
        OSError: the folder cannot be made or written.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, settings.to_json(), encoding="utf-8")

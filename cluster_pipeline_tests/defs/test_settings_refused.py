"""Bad settings are refused before the run's first step does any work, in one line naming
``<stage>.<knob> = <value>: <rule>`` (issue 23, item 6; docs/guide/settings.md), from a shell as
docs/guide/your-own-data.md shows (``dagster asset materialize -c``); the daemon's path is in
test_orphans.py."""

import json
import time

import dagster as dg
import pytest
import yaml

from cluster_pipeline.defs.partition_settings import stored_settings
from cluster_pipeline.storage.layout import DataLayout
from cluster_pipeline_tests.runs import Project

pytestmark = pytest.mark.slow

STAGES = ["raw_instructions", "proxy_embeddings", "balanced_clusters", "peripheral_subsets"]
SELECT = ",".join(STAGES)


def _steps_started(project: Project) -> int:
    with project.instance() as instance:
        return sum(
            len(instance.all_logs(r.run_id, of_type=dg.DagsterEventType.STEP_START))
            for r in instance.get_runs()
        )


def test_bad_settings_are_refused_before_any_step(tmp_path, tiny_model_dir):
    with Project.create(tmp_path, tiny_model_dir, datasets=("tiny", "fresh")) as project:
        # A knob outside its bounds: one line, no traceback, no step, no table.
        start = time.monotonic()
        out = project.materialize(
            SELECT, project.config("ratio", STAGES, peripheral_subsets={"ratio": 1.5})
        )
        assert out.returncode == 1
        refused = [line for line in out.stdout.splitlines() if " - ERROR - " in line]
        assert len(refused) == 1, out.stdout
        assert refused[0].endswith(
            " - peripheral_subsets.ratio = 1.5: Input should be less than or equal to 1"
        )
        assert "Traceback" not in out.stdout and "Stack Trace" not in out.stdout
        assert out.stdout.rstrip().endswith("Error: Materialization failed.")
        assert _steps_started(project) == 0 and not (project.data / "tables").exists()
        print(f"refused in {time.monotonic() - start:.1f} s (the CLI's own start included)")

        # Rules that need the data and the model: K against the pool N of the dataset's
        # latest raw_instructions, max_length against the model's chat template.
        assert (
            project.materialize("raw_instructions", project.config("raw", STAGES[:1])).returncode
            == 0
        )
        bad = project.config(
            "rules",
            STAGES[1:],
            proxy_embeddings={"max_length": 8},
            balanced_clusters={"num_clusters": 100},
        )
        out = project.materialize(",".join(STAGES[1:]), bad)
        assert out.returncode == 1
        (line,) = [line for line in out.stdout.splitlines() if " - ERROR - " in line]
        assert line.endswith(
            " - balanced_clusters.num_clusters = 100: more clusters than the 54 training samples "
            "of dataset 'tiny' (raw_instructions); K <= N; proxy_embeddings.max_length = 8: too "
            f"short for any sample: the chat template of {tiny_model_dir} writes 15 tokens "
            "before an answer even for an empty question, so max_length must be >= 16"
        )
        assert "Traceback" not in out.stdout and _steps_started(project) == 1  # raw's, above

        # A dataset never read before: N is known once raw_instructions has run in this run,
        # and proxy_embeddings refuses before it loads the model or starts torchrun.
        out = project.materialize(
            SELECT,
            project.config("fresh", STAGES, balanced_clusters={"num_clusters": 100}),
            partition="fresh",
        )
        assert out.returncode == 1
        assert (
            "balanced_clusters.num_clusters = 100: more clusters than the 54 training samples of "
            "dataset 'fresh' (raw_instructions); K <= N" in out.stdout
        )
        assert not list((project.data / "cache").rglob("fresh/**/embed_job.json"))
        # The refused run's launch recorded its knobs as the partition's settings; refused in
        # a step, it takes them back and says so: the sensor, the schedule and a re-execution
        # must not run with num_clusters 100 (a new user's trial, 2026-12-05).
        line = next(line for line in out.stdout.splitlines() if "more clusters than" in line)
        given_back = line.split("this run's settings are not kept for dataset partition 'fresh': ")
        assert len(given_back) == 2, line
        # Every knob the launch gave for the refusing step and the steps after it was new:
        # unset again; raw_instructions completed, and keeps the knobs its table was made with.
        launched = yaml.safe_load(project.root.joinpath("fresh.yaml").read_text())["ops"]
        assert given_back[1].removesuffix(")").split(", ") == [
            f"{stage}.{knob}: {json.dumps(value)} -> (default)"
            for stage in sorted(launched)
            if stage != "raw_instructions"
            for knob, value in sorted(launched[stage]["config"].items())
        ]
        kept = stored_settings(DataLayout.at(project.data), "fresh")
        assert kept.stages == {"raw_instructions": launched["raw_instructions"]["config"]}

        # Refused inside the selection step (a rule that needs the clustered pool: longest at
        # ratio 0.01 keeps no sample in a cluster): the same, its launch's knobs taken back (a
        # new user's trial of issue 41 found them kept).
        out = project.materialize(
            SELECT,
            project.config(
                "tiny_ratio", STAGES, peripheral_subsets={"selector": "longest", "ratio": 0.01}
            ),
            partition="fresh",
        )
        assert out.returncode == 1
        line = next(line for line in out.stdout.splitlines() if "longest can keep at most" in line)
        given_back = line.split("this run's settings are not kept for dataset partition 'fresh': ")
        assert given_back[1].removesuffix(")").split(", ") == [
            "peripheral_subsets.ratio: 0.01 -> (default)",
            'peripheral_subsets.selector: "longest" -> (default)',
        ]
        kept = stored_settings(DataLayout.at(project.data), "fresh")
        assert kept.knobs("peripheral_subsets") == {}
        launched = yaml.safe_load(project.root.joinpath("tiny_ratio.yaml").read_text())["ops"]
        assert kept.knobs("balanced_clusters") == launched["balanced_clusters"]["config"]

        # A choice Dagster's schema knows (a Literal) is refused by Dagster itself at launch,
        # before any run exists; its CLI prints its own error (with a traceback).
        runs_before = len(project.instance().get_runs())
        out = project.materialize(
            SELECT, project.config("sel", STAGES, peripheral_subsets={"selector": "periphral"})
        )
        assert out.returncode == 1
        assert (
            "Value at path root:ops:peripheral_subsets:config:selector not in enum type"
            in out.stdout
        )
        assert len(project.instance().get_runs()) == runs_before

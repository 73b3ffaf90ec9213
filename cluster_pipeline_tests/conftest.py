"""Shared fixtures: a tiny tokenizer and causal LM built offline, and a tiny dataset
(builders in :mod:`cluster_pipeline_tests.helpers`)."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

from cluster_pipeline_tests.helpers import (
    build_model,
    build_tokenizer,
    materialize_partition,
    pipeline_assets,
    resources,
    run_config_for,
    tiny_records,
    write_jsonl,
)


def pytest_configure(config):
    """MLflow tracking off for every test and every process a test starts (the CLI, dagster
    dev), unless the test turns it on with a store of its own (``helpers.resources(...,
    tracking_uri=...)``): a tracked stage pays seconds to import MLflow and open its SQLite
    store, and a developer's $MLFLOW_TRACKING_URI must not receive test runs."""
    from cluster_pipeline.defs.resources import TRACKING_ENV

    os.environ[TRACKING_ENV] = "off"
    # Under `make test` (what CI runs) make exports its own state; a `make` a test starts would
    # read it as a sub-make's and print "Entering/Leaving directory" lines into the plans the
    # tests read (CI failed on exactly that, 2026-12-05). Each test's make is a top-level one.
    for var in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES"):
        os.environ.pop(var, None)


# The longest end-to-end and fault tests, and second cases of one rule, by what they repeat:
# `make test-all` runs them, CI's `make test` does not (its budget is 25 minutes on 2 cores;
# with them the suite took 41 min on CI, 2026-12-05). Each one's contract keeps a faster test
# in `make test`, named here; seconds are the test's own on the 2-core machine under load
# (2026-12-05).
EXTENDED = {
    # the main job from the CLI, then every documented command (483 s); the seven stages run in
    # test_pipeline_e2e, each command's own tests in cli/
    "cli/test_documented_commands.py::test_every_documented_command_works_after_the_main_job",
    # a killed step, worker or daemon-launched run leaves no process (538 s); test_faults.py and
    # test_run_watchdog.py kill ranks and workers in `make test`
    "defs/test_orphans.py",
    # runs of one partition queue, take turns, are marked failed when dead (564 s);
    # storage/test_run_lock.py holds the lock's rules
    "defs/test_run_queue.py",
    "defs/test_partition_runs.py",
    # signals named for a step process, a rank and the evaluation (196 s); test_crashed_step.py
    # and test_faults.py name them in `make test`
    "defs/test_killed_processes.py",
    # bad settings refused before any step, through `dagster` commands (156 s);
    # test_partition_settings.py and defs/test_run_checks.py refuse them in-process
    "defs/test_settings_refused.py",
    # the report over selectors and seeds, trained for real (278 s); the fast tests of
    # test_eval_report.py and evaluation/test_render.py build it from given numbers
    "defs/test_eval_report.py::test_report_compares_selectors_and_seeds",
    # FSDP2's and LoRA's resume after a kill (260 s); DDP's stays in `make test`
    "recipes/test_train.py::test_resume_after_a_kill_reaches_the_same_weights[fsdp]",
    "recipes/test_train.py::test_resume_after_a_kill_reaches_the_same_weights[ddp_lora]",
    # packed = padded losses and gradients on the real SmolLM2 (231 s); on the tiny Llama,
    # for every packing path: the fast tests of data/test_packing.py
    "data/test_packing.py::test_packed_losses_and_gradients_equal_padded_ones_on_smollm2",
    # a run in progress when `make dev` stops resumes (220 s); make dev's stop itself:
    # test_make_dev_stops_within_10_s, four ways
    "cli/test_dev_stop.py::test_a_run_in_progress_stays_resumable",
    # LESS's warm-up and gradient pass through the assets (278 s); its math against the
    # authors' code: selection/test_less.py; the other selectors' passes stay in `make test`
    "defs/test_selector_passes.py::test_less_warms_up_lora_and_selects_by_gradient_influence",
    # a killed embedding pass resumes with the missing chunks (139 s); the cache's own tests
    # (storage/test_embedding_cache.py) keep the rule
    "recipes/test_embed.py::test_a_killed_run_resumes_with_only_the_missing_chunks",
    # every record form through all seven stages (68 s); each form's reading and its response
    # tokens: data/test_formats.py and data/test_tokenization.py, the seven stages on one form:
    # test_all_seven_assets_on_a_tiny_model
    "defs/test_pipeline_e2e.py::test_every_form_trains_end_to_end",
    # the weighted step's equalities on the second of two parallelisms (20-27 s each); each
    # stays in `make test` on the other: the full gradient on fsdp and on ddp with activation
    # checkpointing (the same DDP step, layers recomputed), the packed step's on fsdp, equal
    # steps for unequal shards packed (LoRA's step stays on both: its wrapping differs)
    "recipes/test_train.py::test_one_weighted_step_equals_the_stratified_full_gradient[ddp]",
    "recipes/test_train.py::"
    "test_a_packed_step_on_ranks_of_unequal_samples_equals_the_token_stratified_gradient[ddp]",
    "recipes/test_train.py::test_shards_of_unequal_sizes_take_the_same_steps[padded]",
}


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    """Mark the tests of :data:`EXTENDED` ``extended``. Run slow tests first (in their files'
    order): pytest-xdist hands tests out in this order (after the ``xdist_group`` groups, which
    ``--dist loadgroup`` hands out first, largest first), so the workers end on short tests
    instead of one worker finishing a minutes-long end-to-end test while the others idle. Skip
    ``@pytest.mark.gpu`` tests, with the reason, where torch sees no CUDA device."""
    for item in items:
        name = item.nodeid.removeprefix("cluster_pipeline_tests/").split("@")[0]
        if any(name == e or name.startswith(e + "::") for e in EXTENDED):
            item.add_marker(pytest.mark.extended)
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable
    gpu_tests = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_tests:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in gpu_tests:
        item.add_marker(skip)


def pytest_runtest_setup(item):
    """Under ``--dist loadgroup``, fail a grouped test whose xdist_group mark is not in effect
    (pytest-xdist appends ``@group`` to its id; pytest 9.2 ignores that write, and then every
    worker started its own Slurm cluster and web UI server)."""
    if (
        getattr(item.config.option, "loadgroup", False)
        and item.get_closest_marker("xdist_group")
        and "@" not in item.nodeid
    ):
        pytest.fail(
            "pytest-xdist's --dist loadgroup ignores this test's xdist_group mark: install the "
            "pytest and pytest-xdist of requirements.lock (make setup)",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def tiny_model(tiny_tokenizer):
    return build_model(len(tiny_tokenizer), pad_token_id=tiny_tokenizer.pad_token_id)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_model, tiny_tokenizer) -> Path:
    """The tiny model and tokenizer as a save_pretrained folder."""
    path = tmp_path_factory.mktemp("tiny_model")
    tiny_model.save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def tiny_data_dir(tmp_path) -> Path:
    """A data folder with one dataset partition ``tiny`` of 60 samples."""
    data = tmp_path / "data"
    write_jsonl(data / "raw" / "tiny" / "samples.jsonl", tiny_records(60))
    return data


@pytest.fixture(scope="session")
def tiny_embedding_cache(tmp_path_factory, tiny_model_dir) -> Path:
    """The embedding cache folder of partition ``tiny`` (``<data>/cache/embeddings/tiny``): all
    60 samples of :func:`tiny_records` (no held-out split, so any split of them is cached)
    embedded once per worker by a real ``proxy_embeddings`` run under the tests' embedding
    settings and tiny model; built when a test first asks for it.
    :func:`~cluster_pipeline_tests.helpers.seed_embeddings` copies it into a test's data
    folder."""
    import dagster as dg

    from cluster_pipeline.defs.partitions import DATASETS
    from cluster_pipeline.storage.layout import DataLayout

    data = tmp_path_factory.mktemp("embedding_cache") / "data"
    write_jsonl(data / "raw" / "tiny" / "samples.jsonl", tiny_records(60))
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(DATASETS, ["tiny"])
        assets = pipeline_assets()[:2]
        config = run_config_for(assets, raw_instructions={"heldout_fraction": 0.0})
        result = materialize_partition(
            assets, instance, resources(data, tiny_model_dir), run_config=config
        )
        assert result.success
    return DataLayout.at(data).embeddings_dir("tiny")


@pytest.fixture(autouse=True)
def _no_defs_state_storage_left_by_an_earlier_test():
    """Start every test with no current definitions-state storage. An instance an earlier test
    opened sets one in a context variable; once that instance is disposed, a later
    ``dg.materialize`` without an instance resolved it ("Attempted to resolve undefined
    DagsterInstance weakref", seen in test_slurm_launcher after the e2e tests). Dagster has no
    public way to clear it, hence the private import."""
    from dagster._core.storage.defs_state.base import set_defs_state_storage

    with set_defs_state_storage(None):
        yield


@pytest.fixture(autouse=True)
def _collect_garbage_between_tests():
    """Finalise what earlier tests left for the garbage collector before this test opens its
    Dagster instance: a finaliser that runs in the middle of a test can reset Dagster's
    context-local definitions-state storage to one of an instance already disposed ("Attempted
    to resolve undefined DagsterInstance weakref", seen once in a full run).

    Then everything still alive is frozen (``gc.freeze``: moved to a generation the collector
    never scans), so the next test's collection traverses only the objects made since: a full
    collection over the millions of objects of torch, transformers and Dagster took 0.5-1.4 s,
    before every one of 700 tests. A frozen object that becomes cyclic garbage later (a module
    fixture's, say) is not collected; it is only memory, and its finaliser never runs mid-test."""
    gc.collect()
    gc.freeze()

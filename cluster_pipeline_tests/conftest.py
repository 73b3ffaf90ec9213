"""Shared fixtures: a tiny tokenizer and causal LM built offline, and a tiny dataset
(builders in :mod:`cluster_pipeline_tests.helpers`)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from cluster_pipeline_tests.helpers import build_model, build_tokenizer, tiny_records, write_jsonl


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


@pytest.fixture(autouse=True)
def _collect_garbage_between_tests():
    """Finalise what earlier tests left for the garbage collector before this test opens its
    Dagster instance: a finaliser that runs in the middle of a test can reset Dagster's
    context-local definitions-state storage to one of an instance already disposed ("Attempted
    to resolve undefined DagsterInstance weakref", seen once in a full run)."""
    gc.collect()

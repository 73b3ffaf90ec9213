"""Loading weights into a model built on the meta device (the FSDP2 path of training.loop):
the same parameters and buffers as ``from_pretrained``, from one safetensors file or several,
in the checkpoint's dtype or another."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cluster_pipeline.models.loading import empty_model, safetensors_files
from cluster_pipeline.training.checkpointing import load_into_shards


def _loaded(path) -> Any:
    files = safetensors_files(str(path))
    assert files is not None
    model = empty_model(str(path))
    load_into_shards(model, files, torch.device("cpu"))
    return model


@pytest.mark.parametrize("layout", ["one file", "index of shards", "bfloat16"])
def test_load_into_shards_matches_from_pretrained(tmp_path, tiny_model, tiny_model_dir, layout):
    path = tiny_model_dir
    if layout != "one file":
        path = tmp_path / "model"
        source = tiny_model.to(torch.bfloat16) if layout == "bfloat16" else tiny_model
        try:
            source.save_pretrained(path, max_shard_size="20KB" if layout != "bfloat16" else "1GB")
        finally:
            tiny_model.to(torch.float32)
        assert (path / "model.safetensors.index.json").exists() == (layout != "bfloat16")
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = _loaded(path)
    want = dict(reference.named_parameters())
    got = dict(model.named_parameters())
    assert got.keys() == want.keys()
    for name, p in got.items():
        assert p.dtype == torch.float32
        torch.testing.assert_close(p, want[name], rtol=0, atol=0)
    for name, b in model.named_buffers():
        torch.testing.assert_close(b, dict(reference.named_buffers())[name], rtol=0, atol=0)
    if reference.config.tie_word_embeddings:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


def test_load_into_shards_names_a_missing_tensor(tmp_path, tiny_model):
    tiny_model.save_pretrained(tmp_path)
    files = safetensors_files(str(tmp_path))
    assert files is not None
    name = next(iter(files))
    with pytest.raises(KeyError, match=name):
        del files[name]
        load_into_shards(empty_model(str(tmp_path)), files, torch.device("cpu"))


def test_safetensors_files_is_none_without_safetensors(tmp_path):
    assert safetensors_files(str(tmp_path)) is None
    assert safetensors_files("HuggingFaceTB/SmolLM2-135M") is None


def test_a_local_model_path_that_is_not_a_folder_is_named_before_transformers_reads_it(tmp_path):
    from cluster_pipeline.models.loading import empty_model, load_tokenizer

    missing, a_file = tmp_path / "no-model", tmp_path / "model.gguf"
    a_file.write_bytes(b"GGUF")
    for load in (load_tokenizer, empty_model):
        with pytest.raises(FileNotFoundError) as e:
            load(str(missing))
        assert str(e.value) == (
            f"model folder {missing} does not exist: give a folder save_pretrained wrote "
            "(config.json, weights, tokenizer) or a Hugging Face hub id"
        )
        with pytest.raises(NotADirectoryError) as e:
            load(str(a_file))
        assert str(e.value) == (
            f"model path {a_file} is a file, not a folder: give the folder save_pretrained "
            "wrote (config.json, weights, tokenizer)"
        )
    # Relative paths are local too; a name without ./ is a hub id and left to transformers.
    with pytest.raises(FileNotFoundError, match=r"^model folder \./no-model does not exist"):
        load_tokenizer("./no-model")

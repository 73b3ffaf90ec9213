"""Checkpoints, the one home (as torchtune's ``training/checkpointing``): what a fine-tuning run
leaves and how it is written and read back.

- **The catalogue** (read by lineage, evaluation and the asset metadata): :class:`Checkpoint`,
  :func:`read_checkpoint`, :func:`list_checkpoints`, :func:`finished_for`, the metrics file,
  and the runs that can still resume (:func:`resumable_runs`).
- **Writers**: :func:`save_checkpoint` (``save_pretrained`` + ``training_info.json``,
  atomically), :class:`CheckpointDir` (the resumable ``step_<n>/`` folders), FSDP2's sharded
  files (:func:`save_sharded` / :func:`load_sharded`, ``torch.distributed.checkpoint``), LoRA
  adapters (:func:`save_adapter` / :func:`load_adapter`), and the export of a gathered state
  into a plain model (:func:`full_state_dict`, :func:`export_model`).
- **Base weights into FSDP2 shards**: :class:`SafetensorsRows`, :func:`load_into_shards`.

A finished checkpoint is a folder ``<data>/checkpoints/<dataset>/<name>/`` holding the
``save_pretrained`` output (safetensors + tokenizer) and ``training_info.json``: base model,
the shard manifests trained on (rank, path, content hash), the training job (settings and
provenance: selector, ratio, seeds, data fraction, table versions), git commit, steps, seconds,
tokens and final loss. Beside it, ``<name>.metrics.jsonl`` holds one line per optimizer step
(written by rank 0 as training goes), and ``<name>.checkpoints/`` the resumable intermediate
checkpoints. The folder appears atomically (written elsewhere, then renamed), so a folder with a
``training_info.json`` is complete. Training writes these files; lineage, evaluation and the
asset metadata read them through this module only.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cluster_pipeline.launch.fate import check_alive
from cluster_pipeline.storage.atomic import atomic_file, atomic_folder
from cluster_pipeline.storage.disk import DiskFull, free_bytes, naming_full_disk, require_space

if TYPE_CHECKING:  # imported where tensors are handled: the assets read checkpoints without it
    import torch

TRAINING_INFO = "training_info.json"


def metrics_path(checkpoint: str | Path) -> Path:
    """The per-step metrics file of a checkpoint folder (a sibling, ``<name>.metrics.jsonl``)."""
    return Path(f"{checkpoint}.metrics.jsonl")


def intermediate_dir(checkpoint: str | Path) -> Path:
    """Where the resumable ``step_<n>/`` checkpoints of a run live."""
    return Path(f"{checkpoint}.checkpoints")


def read_metrics(checkpoint: str | Path) -> list[dict[str, Any]]:
    """The per-step records of a run (keys: step, epoch, lr, loss, loss_per_rank, grad_norm,
    tokens, step_seconds, elapsed_seconds), oldest first; [] if the file is absent. A torn
    last line (a run killed while writing) is skipped."""
    path = metrics_path(checkpoint)
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def killed_seconds(rows: list[dict[str, Any]], resumed_step: int, elapsed_at_step: float) -> float:
    """Training seconds an interrupted run spent past the checkpoint it resumes from, which
    its resumption trains again: the last ``elapsed_seconds`` its metrics file logged after
    step ``resumed_step``, less ``elapsed_at_step`` (what the checkpoint recorded); 0 when it
    logged no later step. The resumed run adds them to its ``train_seconds``, so the time a
    kill cost counts in what the training cost (issue 43: the report's saving left it out).

    Args:
        rows: the metrics file's rows (:func:`read_metrics`), before the resumed run rewrites it.
        resumed_step: the step of the checkpoint resumed from.
        elapsed_at_step: that checkpoint's ``elapsed_seconds``.
    """
    later = [
        float(r["elapsed_seconds"])
        for r in rows
        if int(r.get("step", 0)) > resumed_step and "elapsed_seconds" in r
    ]
    return max(0.0, max(later) - elapsed_at_step) if later else 0.0


@dataclass(frozen=True)
class Checkpoint:
    """One finished checkpoint folder and its ``training_info.json``."""

    path: Path
    info: dict[str, Any]

    @property
    def manifest_sha256(self) -> list[str]:
        """Content hashes of the shard manifests it was trained on, in rank order."""
        return [m["sha256"] for m in self.info.get("manifests", [])]

    @property
    def provenance(self) -> dict[str, Any]:
        """Selector, ratio, seeds, data fraction and table versions recorded at launch ({} for
        checkpoints written before provenance was recorded)."""
        return self.info.get("config", {}).get("provenance", {})

    @property
    def settings(self) -> dict[str, Any]:
        """The training settings the checkpoint was trained with."""
        config = self.info.get("config", {})
        return config.get("settings", config)

    @property
    def train_seconds(self) -> float | None:
        """Seconds of the training loop (resumed runs included), or None."""
        return self.info.get("train_seconds")

    @property
    def data_fraction(self) -> float | None:
        """Distinct selected samples / pool size, as recorded at launch, or None."""
        return self.provenance.get("data_fraction")

    def mean_grad_cosine(self) -> float | None:
        """Mean over logged steps of the mean inter-rank cosine of the ranks' local gradients
        (``grad_cosine`` in the metrics file; None if never logged)."""
        values = [r["grad_cosine"] for r in read_metrics(self.path) if "grad_cosine" in r]
        return float(sum(values) / len(values)) if values else None

    def loss_curve(self) -> list[tuple[int, float]]:
        """(optimizer step, mean loss over ranks) per step."""
        return [(r["step"], r["loss"]) for r in read_metrics(self.path)]


def read_checkpoint(path: str | Path) -> Checkpoint | None:
    """The checkpoint at ``path``, or None if the folder is not a finished checkpoint."""
    info_path = Path(path) / TRAINING_INFO
    try:
        return Checkpoint(Path(path), json.loads(info_path.read_text()))
    except (FileNotFoundError, NotADirectoryError, ValueError):
        return None


def list_checkpoints(root: Path) -> list[Checkpoint]:
    """Every finished checkpoint directly under ``root`` (a dataset's checkpoint folder),
    oldest first by the time its ``training_info.json`` was written."""
    if not root.is_dir():
        return []
    found = [c for c in (read_checkpoint(p.parent) for p in root.glob(f"*/{TRAINING_INFO}")) if c]
    return sorted(found, key=lambda c: ((c.path / TRAINING_INFO).stat().st_mtime_ns, c.path.name))


def checkpoints_by_manifest(checkpoints: list[Checkpoint]) -> dict[str, list[str]]:
    """Manifest sha256 -> paths of the checkpoints trained on that manifest."""
    out: dict[str, list[str]] = {}
    for ckpt in checkpoints:
        for sha in ckpt.manifest_sha256:
            out.setdefault(sha, []).append(str(ckpt.path))
    return out


def finished_for(path: str | Path, manifest_sha256: list[str]) -> Checkpoint | None:
    """The finished checkpoint at ``path`` if it was trained on exactly these manifests (in
    rank order), else None."""
    ckpt = read_checkpoint(path)
    return ckpt if ckpt is not None and ckpt.manifest_sha256 == list(manifest_sha256) else None


TRAINING_STATE = "training_state.pt"
# Beside the tensors: the tokenizer's files, config and JSON (the built-in model's are 3.5 MB).
CHECKPOINT_OVERHEAD_BYTES = 16 * 2**20


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in ``obj`` (a tensor, or dicts, lists and tuples holding them), each
    storage counted once (tied weights share one): what ``save_pretrained`` or ``torch.save``
    writes of it, give or take headers."""
    seen: set[tuple[int, int]] = set()

    def walk(value: Any) -> int:
        if hasattr(value, "untyped_storage") and hasattr(value, "element_size"):
            storage = value.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            if key in seen or value.device.type == "meta":
                return 0
            seen.add(key)
            return int(value.numel() * value.element_size())
        if isinstance(value, dict):
            return sum(walk(v) for v in value.values())
        if isinstance(value, (list, tuple)):
            return sum(walk(v) for v in value)
        return 0

    return walk(obj)


def checkpoint_bytes(n_parameters: int, n_trainable: int, intermediate: bool) -> int:
    """Bytes a training run writes at least, known before it starts: the finished checkpoint
    (the weights in float32, as the loop trains them: 4 x P) and, when it saves resumable
    checkpoints, the next one of those (weights, plus AdamW's two float32 moments of the T
    trainable parameters: 4 P + 8 T), each with the tokenizer's files."""
    final = 4 * n_parameters + CHECKPOINT_OVERHEAD_BYTES
    step = 4 * n_parameters + 8 * n_trainable + CHECKPOINT_OVERHEAD_BYTES
    return final + (step if intermediate else 0)


@dataclass(frozen=True)
class ResumableRun:
    """A training run that stopped before it finished and can resume: the checkpoint folder
    it was writing (no ``training_info.json`` there), its newest complete ``step_<n>/``, that
    step, the bytes its intermediate folder holds, and the Dagster run that launched it and
    its manifest set (from the job file beside it; None where it cannot be read)."""

    output_dir: Path
    latest: Path
    step: int
    bytes: int
    run_id: str | None
    manifest_set_sha256: str | None

    @property
    def intermediate(self) -> Path:
        """Its ``<name>.checkpoints/`` folder (delete it to free :attr:`bytes`)."""
        return intermediate_dir(self.output_dir)

    def to_metadata(self) -> dict[str, Any]:
        """JSON-ready: path, step, GiB, run id, manifest set (12 hex digits)."""
        return {
            "path": str(self.latest),
            "step": self.step,
            "gib": round(self.bytes / 2**30, 3),
            "run_id": self.run_id,
            "manifest_set": (self.manifest_set_sha256 or "")[:12] or None,
        }


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def resumable_runs(root: Path) -> list[ResumableRun]:
    """Every run under ``root`` (a dataset's checkpoint folder) that left a complete
    intermediate checkpoint and no finished checkpoint, by folder name. A re-executed run
    resumes only the one of its own manifests, data, model and settings; the others are what a
    new selection would leave behind unsaid (issue 43), so ``trained_checkpoint`` names them."""
    if not root.is_dir():
        return []
    out = []
    for folder in sorted(root.glob("*.checkpoints")):
        output_dir = root / folder.name.removesuffix(".checkpoints")
        latest = CheckpointDir(folder).latest()
        if latest is None or read_checkpoint(output_dir) is not None:
            continue
        run_id = manifest_set = None
        job = output_dir.parent / f"{output_dir.name}.job.json"
        try:
            provenance = json.loads(job.read_text()).get("provenance", {})
            run_id = provenance.get("dagster_run_id")
            manifest_set = provenance.get("manifest_set_sha256")
        except (OSError, ValueError, AttributeError):
            pass
        step = int(latest.name.split("_")[-1])
        out.append(
            ResumableRun(output_dir, latest, step, _folder_bytes(folder), run_id, manifest_set)
        )
    return out


class CheckpointDir:
    """Intermediate checkpoints ``step_<n>/`` under ``root``: each a save_pretrained folder plus
    ``training_state.pt`` (optimizer, scheduler, step, every rank's RNG state, loss history).
    A folder exists only once complete (see :func:`save_checkpoint`)."""

    def __init__(self, root: Path):
        self.root = root

    def all(self) -> list[Path]:
        """The complete ``step_<n>/`` folders, oldest first."""
        if not self.root.is_dir():
            return []
        done = [p for p in self.root.glob("step_*") if (p / TRAINING_STATE).exists()]
        return sorted(done, key=lambda p: int(p.name.split("_")[-1]))

    def latest(self) -> Path | None:
        """The newest complete step folder, or None."""
        found = self.all()
        return found[-1] if found else None

    def step_dir(self, step: int) -> Path:
        """The folder of step ``step``."""
        return self.root / f"step_{step:07d}"

    def save(self, model, tokenizer, step: int, state: dict, keep: int) -> Path:
        """Write ``step_<n>/``: ``model`` (``save_pretrained``; None when the sharded files are
        already there, written by every rank), the tokenizer and the training state last, which
        marks the folder complete; then drop all but the ``keep`` newest."""
        import torch

        path = self.step_dir(step)
        if model is None:
            what = f"save the resumable checkpoint {path}"
            needed = tensor_bytes(state) + CHECKPOINT_OVERHEAD_BYTES
            require_space(self.root, needed, what)
            with naming_full_disk(self.root, needed, what):
                tokenizer.save_pretrained(path)
                with atomic_file(path / TRAINING_STATE) as tmp:
                    torch.save(state, tmp)
                    check_alive(f"complete checkpoint {path}")
        else:
            save_checkpoint(model, tokenizer, path, {"step": step}, extra={TRAINING_STATE: state})
        for old in self.all()[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        return path


def save_checkpoint(
    model,
    tokenizer,
    out_dir: Path,
    info: dict,
    extra: dict | None = None,
    also: Callable[[Path], Any] | None = None,
) -> None:
    """``save_pretrained`` (safetensors) + tokenizer + ``training_info.json`` (+ ``extra`` objects
    saved with ``torch.save``, + whatever ``also(folder)`` writes) into ``out_dir``, atomically:
    written to a temporary sibling folder, then renamed over ``out_dir``, so a killed save
    leaves no half checkpoint.

    Raises:
        DiskFull: the disk lacks the room for the model's and ``extra``'s tensors (checked
            before anything is written), or ran out while writing (the temporary folder is
            removed; an earlier ``out_dir`` stays as it was).
    """
    import torch

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    what = f"save the checkpoint {out_dir}"
    needed = tensor_bytes(model.state_dict()) + tensor_bytes(extra) + CHECKPOINT_OVERHEAD_BYTES
    require_space(out_dir.parent, needed, what)
    with naming_full_disk(out_dir.parent, needed, what), atomic_folder(out_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / TRAINING_INFO).write_text(json.dumps(info, indent=1, default=str))
        for name, obj in (extra or {}).items():
            torch.save(obj, tmp / name)
        if also is not None:
            also(tmp)
        check_alive(f"rename checkpoint {out_dir} into place")


ADAPTER_DIR = "adapter"  # the LoRA adapter, beside the merged weights of a checkpoint


ADAPTER_WEIGHTS = "adapter_model.safetensors"  # peft's file name for adapter weights


SHARDED_DIR = "sharded"  # torch.distributed.checkpoint files of an FSDP intermediate checkpoint


SAFETENSORS_DTYPES = {  # the header's dtype -> the torch dtype's name
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
}


class SafetensorsRows:
    """Reads row ranges of the tensors in safetensors files with plain reads, not ``mmap``:
    pages of a mapped file count in the reader's resident memory (and its peak) until it is
    unmapped, read pages do not. Format: an 8-byte little-endian header length, a JSON header
    giving each tensor's dtype, shape and byte offsets, then the data, row-major
    (huggingface/safetensors, README "Format")."""

    def __init__(self, files: dict[str, Path]):
        self.files = files
        self.headers: dict[Path, tuple[int, dict[str, Any]]] = {}

    def entry(self, name: str) -> tuple[Path, int, dict[str, Any]]:
        """(file, byte offset of the tensor's data, its header entry)."""
        import json
        import struct

        if name not in self.files:
            raise KeyError(f"the checkpoint has no tensor {name!r} for the model's parameter")
        file = self.files[name]
        if file not in self.headers:
            with open(file, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                self.headers[file] = (8 + length, json.loads(f.read(length)))
        data_start, header = self.headers[file]
        meta = header[name]
        return file, data_start + meta["data_offsets"][0], meta

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor ``name``."""
        return tuple(self.entry(name)[2]["shape"])

    def read_into(self, name: str, start: int, out: torch.Tensor) -> None:
        """Copy rows ``start : start + out.shape[0]`` of tensor ``name`` into ``out`` (a
        CPU or GPU tensor of the tensor's trailing shape, any float dtype)."""
        import torch

        file, offset, meta = self.entry(name)
        dtype = getattr(torch, SAFETENSORS_DTYPES[meta["dtype"]])
        row_bytes = math.prod(meta["shape"][1:]) * dtype.itemsize
        direct = out.dtype == dtype and out.device.type == "cpu" and out.is_contiguous()
        buffer = out if direct else torch.empty(out.shape, dtype=dtype)
        with open(file, "rb", buffering=0) as f:
            f.seek(offset + start * row_bytes)
            f.readinto(buffer.reshape(-1).view(torch.uint8).numpy())  # pyright: ignore[reportArgumentType]
        if not direct:
            out.copy_(buffer)


def load_into_shards(model, files: dict[str, Path], device: torch.device) -> None:
    """Fill the parameters of a model built on the meta device (``modeling.empty_model``) and
    sharded with :func:`wrap`, each rank reading from the safetensors ``files`` (tensor name ->
    file) only the rows of its own shard (:class:`SafetensorsRows`): no rank ever holds the
    full weights, only its shards. Buffers keep the values they were built with. Works
    unsharded too (every row). What torchtune's ``load_from_full_model_state_dict`` does,
    without a full state dict on rank 0 to scatter from.

    Raises:
        KeyError: a parameter of the model has no tensor in ``files``.
        ValueError: a tensor's shape differs from its parameter's, or a parameter is sharded
            otherwise than FSDP2's default (rows, dim 0).
    """
    import torch
    from torch.distributed.tensor import DTensor, Shard

    with torch.no_grad():
        buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
        model.to_empty(device=device)
        for name, b in model.named_buffers():
            b.copy_(buffers[name])
        reader = SafetensorsRows(files)
        for name, param in model.named_parameters():
            if reader.shape(name) != tuple(param.shape):
                raise ValueError(
                    f"{name}: {reader.shape(name)} in the checkpoint, "
                    f"{tuple(param.shape)} in the model"
                )
            local, start = param, 0
            if isinstance(param, DTensor):
                if tuple(param.placements) != (Shard(0),):
                    raise ValueError(f"{name} is sharded as {param.placements}, not by rows")
                local = param.to_local()
                rows = -(-param.shape[0] // param.device_mesh.size())  # torch.chunk's chunk size
                start = param.device_mesh.get_local_rank() * rows
            if local.numel():
                reader.read_into(name, start, local)


def full_state_dict(model) -> dict[str, Any]:
    """The unsharded model state on CPU (collective under FSDP2: every rank must call it; rank 0
    gets the tensors)."""
    from cluster_pipeline.training.parallel import is_fsdp

    if not is_fsdp(model):
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def export_model(model, state: dict[str, Any]):
    """A plain ``transformers`` model holding ``state`` that ``save_pretrained`` writes as the
    base architecture (an FSDP2-sharded model's class is a generated subclass; LoRA adapters are
    merged into the weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    # A copy: peft's merge below edits the config it is given.
    config = copy.deepcopy(base.config)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config)
    lora = getattr(model, "peft_config", None)
    if lora:  # load into a peft copy, then merge the adapters into the weights
        from peft import get_peft_model

        plain = get_peft_model(plain, lora["default"])
    # strict=False: a state gathered from shards may list tied weights (lm_head) once.
    plain.load_state_dict(state, strict=False, assign=True)
    if lora:
        plain = plain.merge_and_unload()
    plain.tie_weights()
    if tied:
        # The gathered state holds the tied matrices as two tensors, and peft's merge then
        # unties them (clearing the config flag): tie them again, so the export keeps the base
        # architecture (one embedding matrix, not two).
        plain.config.tie_word_embeddings = True
        output = plain.get_output_embeddings()
        if output is not None:
            output.weight = plain.get_input_embeddings().weight
    empty = [name for name, p in plain.named_parameters() if p.is_meta]
    if empty:
        raise RuntimeError(f"the gathered state has no value for {empty[:3]} ({len(empty)} in all)")
    return plain


def adapter_config(model) -> dict[str, Any] | None:
    """A LoRA model's peft adapter config as a JSON-ready dict (sets as sorted lists; None for
    a model without adapters)."""
    configs = getattr(model, "peft_config", None)
    if not configs:
        return None
    return {
        k: sorted(v) if isinstance(v, set) else v for k, v in configs["default"].to_dict().items()
    }


def save_adapter(model, state: dict[str, Any], out_dir: Path) -> None:
    """Save a LoRA model's adapter in peft's format (``adapter_config.json``,
    ``adapter_model.safetensors``) under ``out_dir/adapter``; nothing for other models."""
    configs = getattr(model, "peft_config", None)
    if not configs:
        return
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    folder = out_dir / ADAPTER_DIR
    folder.mkdir(parents=True, exist_ok=True)
    configs["default"].save_pretrained(str(folder))
    adapter = get_peft_model_state_dict(model, state_dict=state)
    save_file({k: v.contiguous() for k, v in adapter.items()}, str(folder / ADAPTER_WEIGHTS))


def load_adapter(model, folder: Path) -> None:
    """Load the adapter weights a peft ``save_pretrained`` wrote to ``folder`` into ``model``."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    set_peft_model_state_dict(model, load_file(str(folder / ADAPTER_WEIGHTS)))


def local_tensor_bytes(obj: Any) -> int:
    """:func:`tensor_bytes` of this rank's part of ``obj``: a DTensor (FSDP2's sharded
    parameters and their optimizer states) counts its local shard, what
    ``torch.distributed.checkpoint`` writes of it from this rank."""
    from torch.distributed.tensor import DTensor

    def local(value: Any) -> Any:
        if isinstance(value, DTensor):
            return value.to_local()
        if isinstance(value, dict):
            return {k: local(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [local(v) for v in value]
        return value

    return tensor_bytes(local(obj))


def save_sharded(model, optimizer, folder: Path) -> None:
    """Model and optimizer state, sharded as FSDP2 holds them, with
    ``torch.distributed.checkpoint`` (collective: every rank calls it, and writes its shards).

    The room is checked first, on every rank at once: the shards of all ranks (each rank's
    :func:`local_tensor_bytes`, summed: a shared filesystem receives every one; ranks on
    separate local disks are asked for more than each needs) plus
    :data:`CHECKPOINT_OVERHEAD_BYTES`, against the least free space any rank sees, so that every
    rank refuses together, before any writes.

    Raises:
        DiskFull: the room is lacking (every rank raises it), or the disk ran out while
            writing.
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import save

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    what = f"save the sharded checkpoint {folder}"
    mine = (local_tensor_bytes(state), free_bytes(folder.parent))
    if dist.is_available() and dist.is_initialized():
        views: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(views, mine)
    else:
        views = [mine]
    needed = sum(v[0] for v in views) + CHECKPOINT_OVERHEAD_BYTES
    free = min(v[1] for v in views)
    if free < needed:
        raise DiskFull(what, folder.parent, needed, free)
    with naming_full_disk(folder.parent, needed, what):
        save(state, checkpoint_id=str(folder))


def load_sharded(model, optimizer, folder: Path) -> None:
    """Restore what :func:`save_sharded` wrote into an FSDP2 model and its optimizer
    (collective)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load

    model_state, optim_state = get_state_dict(model, optimizer)
    check_sharded_keys(folder, model_state)
    state = {"model": model_state, "optim": optim_state}
    load(state, checkpoint_id=str(folder))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )


def check_sharded_keys(folder: Path, model_state: dict) -> None:
    """Refuse a sharded checkpoint that does not hold every tensor of ``model_state`` (the
    model's state dict as :func:`load_sharded` reads it), before ``torch.distributed.checkpoint``
    fails on the first missing one: a checkpoint of another model, or of a training loop that
    wrapped the model differently (intermediate checkpoints written before the loss module
    became FSDP's root, 2026-12-05, name their tensors without its ``model.`` prefix).

    Raises:
        ValueError: a tensor of the model is not in the checkpoint; the message names the
            folder, how many are missing, one of them, and what to do.
    """
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    saved = set(FileSystemReader(str(folder)).read_metadata().state_dict_metadata)
    wanted = [f"model.{key}" for key in model_state]
    missing = [key for key in wanted if key not in saved]
    if missing:
        raise ValueError(
            f"{folder} does not hold this model's weights: {len(missing)} of {len(wanted)} "
            f"tensors are missing (e.g. {missing[0]!r}); it was written for another model or "
            "by an earlier version of the training loop. Set resume: false to train from the "
            f"start, or move {folder.parent.parent} aside to keep it."
        )

"""Train on the pipeline's shards with your own Hugging Face ``Trainer`` or TRL ``SFTTrainer``
script: rank c is fed exactly its shard manifest, in the product's fixed step order, and its loss
is multiplied by its weight w_c (docs/design.md, steps 4 and 5).

The lines a TRL script adds (launch it with ``torchrun --nproc_per_node=K train.py``, K = the
number of shard manifests)::

    from trl import SFTConfig, SFTTrainer
    from cluster_pipeline.integrations.hf_trainer import ClusterShards, ClusterTrainer

    class ClusterSFTTrainer(ClusterTrainer, SFTTrainer): ...

    shards = ClusterShards.from_export("data/exports/mydata")  # `cluster-pipeline export mydata`
    args = SFTConfig("out", per_device_train_batch_size=4, gradient_accumulation_steps=2,
                     average_tokens_across_devices=False)  # use_cpu=True on a machine without GPUs
    train = shards.dataset(args.process_index, tokenizer)  # this rank's shard
    trainer = ClusterSFTTrainer(model, args=args, train_dataset=train,
                                processing_class=tokenizer, shards=shards)
    trainer.train()

(``args.process_index`` is the rank the trainer will run as; accelerate's ``PartialState()``
called before the config reports rank 0 on every process of a CPU-only machine, as it does not
set up gloo unless told ``cpu=True``.)

A plain ``transformers`` script uses :class:`ClusterTrainer` in place of ``Trainer``.

**The order** (:meth:`ClusterShards.steps`) is the product's padded plan
(``training/plan.py``, ``packing: false``): epoch e visits each shard in the permutation of
``default_rng([seed, e])``, ``per_device_train_batch_size`` samples per micro-batch,
``gradient_accumulation_steps`` micro-batches per optimizer step, ``ceil(max_c n_c /
(batch x accumulation))`` steps per epoch on every rank; where a rank has fewer micro-batches at
a step than another, it gets placeholder micro-batches (one padding token, no target), so every
rank runs the same forward and backward passes. The plan is computed from the sizes of all K
manifests, the same way on every rank, with no communication. It is not the packed plan that
the product trains with by default (``packing: true`` fills micro-batches by tokens, so its steps
and step count differ); compare a script with a product run made with ``packing: false``.

**The hooks**, chosen from the installed transformers 5.24, accelerate 1.15 and TRL 1.16:

- *Data*: :class:`ClusterTrainer` overrides ``Trainer.get_train_dataloader``, the method
  transformers says to override for custom loading. ``Trainer._get_train_sampler`` cannot carry
  the plan: its sampler becomes the DataLoader's per-sample ``sampler`` under a fixed
  ``batch_size`` (an epoch's last micro-batch is shorter, a placeholder holds no sample of the
  dataset), and ``accelerator.prepare`` then wraps the batches in ``BatchSamplerShard``, which
  deals them round-robin to the processes: rank r would see every K-th micro-batch of one global
  order. So the override builds the DataLoader with :class:`ShardBatchSampler` as its
  ``batch_sampler``, prepares it with accelerate (device placement, ``set_epoch``, resumption)
  and sets the wrapper's ``num_processes`` to 1, which is what ``Trainer._get_dataloader``
  does for transformers' own rank-aware ``BatchRebalanceSampler``. accelerate's
  ``split_batches`` and ``dispatch_batches`` cut one global batch into per-process parts and
  are refused; ``use_seedable_sampler`` only reseeds a ``RandomSampler``, which is not used.
- *Weight*: :class:`ClusterTrainer` overrides ``compute_loss`` and multiplies the trainer's own
  training loss by w_c. TRL 1.16 deprecates ``compute_loss_func`` ("subclass SFTTrainer and
  override compute_loss instead"; it also costs SFTTrainer a second forward pass), and a
  callback never sees the loss before its backward.
- *Normalisation*: with ``average_tokens_across_devices=False``, ``Trainer`` and ``SFTTrainer``
  divide a micro-batch's summed cross-entropy by ``num_items_in_batch``, the targets
  (``labels[..., 1:] != -100``) of the rank's whole accumulated step: the product's τ_{c,s}
  (``training/step.py``). Rank c's step loss is then ``w_c Σ CE / τ_{c,s}``, as in the product.
  The default ``True`` divides by the targets of all ranks and multiplies by K, which makes the
  weight of rank c's tokens depend on the other ranks' token counts: refused. A step where a rank
  has only placeholders has no target; its count is clamped to 1 (as the product does), so its
  loss is 0, not 0/0.

With the product's tokens (:meth:`ClusterShards.dataset` given a tokenizer encodes each sample as
the product's trainer does) and float32, every rank's weighted loss equals the product's
trainer's within 1e-5 at the first optimizer step and, with the same AdamW settings, at the
later ones (``cluster_pipeline_tests/integrations/test_hf_trainer.py``). Without a tokenizer
the dataset holds conversational ``prompt`` / ``completion`` columns that TRL tokenizes its own
way (its chat-template call, its truncation), so the order and weights are the product's and the
tokens TRL's.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import polars as pl
import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import seed_worker

from cluster_pipeline.data.formats import conversation, sample_id
from cluster_pipeline.data.packing import IGNORE_INDEX
from cluster_pipeline.data.tokenization import SequenceSettings, encode_rows
from cluster_pipeline.integrations.hf_datasets import DATASET_DICT, ExportError, verify_export
from cluster_pipeline.selection.sharding import ShardManifest, content_sha256
from cluster_pipeline.storage.layout import DataLayout, default_data_dir
from cluster_pipeline.training.plan import plan_padded

# The sample columns a shard's rows carry (as raw_instructions stores them).
SAMPLE_COLUMNS = ["sample_id", "system", "prompt", "response", "messages", "tools"]


def _stored_messages(frame: pl.DataFrame) -> list[str | None]:
    """An export's ``messages`` lists as ``raw_instructions`` stores them: JSON text, or null
    where the list is the single exchange of ``system``, ``prompt`` and ``response``
    (:func:`~cluster_pipeline.data.formats.conversation` renders either the same)."""
    out: list[str | None] = []
    columns = [frame[c].to_list() for c in ("system", "prompt", "response", "messages")]
    for s, p, r, m in zip(*columns, strict=True):
        out.append(None if m == conversation(s, p, r, None) else json.dumps(m, ensure_ascii=False))
    return out


@dataclass(frozen=True)
class RankShard:
    """One rank's shard: its samples in manifest order (copies repeated), the rank's loss weight
    w_c and the manifest's content hash (:func:`~cluster_pipeline.selection.sharding.
    content_sha256`)."""

    rank: int
    weight: float
    sample_ids: tuple[str, ...]
    sha256: str


@dataclass(frozen=True)
class ClusterShards:
    """The K shards of one selection (``ranks[c]`` is rank c's) and, when read from an export,
    the samples' text (``rows``: one row per sample id, :data:`SAMPLE_COLUMNS`) and the
    card's facts (``facts``: the export's ``selection``, :func:`~cluster_pipeline.integrations.
    dataset_card.card_fields`; from manifest files, the manifest hashes and weights alone).
    ``source`` names where they were read, for error messages."""

    ranks: tuple[RankShard, ...]
    source: str
    rows: pl.DataFrame | None = None
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        """K: the number of ranks (shards) the selection was allocated to."""
        return len(self.ranks)

    @property
    def weights(self) -> list[float]:
        """w_c of every rank, in rank order."""
        return [r.weight for r in self.ranks]

    @classmethod
    def from_manifests(cls, manifests: Sequence[str | Path] | str | Path) -> ClusterShards:
        """The shards of the manifest files ``rank_<c>.json`` (a list of paths, or the folder
        holding them: ``data/shards/<dataset>/<hash>/``), each checked against its content
        hash. They hold sample ids only: pair them with a dataset that has a ``sample_id``
        column.

        Raises:
            ValueError: no manifest, a manifest edited (hash mismatch), or manifests that are not
                ranks 0..K-1 of one world of size K.
        """
        if isinstance(manifests, str | Path):
            folder = Path(manifests)
            paths = sorted(folder.glob("rank_*.json")) if folder.is_dir() else [folder]
        else:
            paths = [Path(p) for p in manifests]
        if not paths:
            raise ValueError(f"no shard manifest (rank_<c>.json) in {manifests}")
        read = sorted((ShardManifest.read(p) for p in paths), key=lambda m: m.rank)
        ranks = [m.rank for m in read]
        worlds = {m.world_size for m in read}
        if ranks != list(range(len(read))) or worlds != {len(read)}:
            raise ValueError(
                f"{[str(p) for p in paths]} hold ranks {ranks} of world sizes {sorted(worlds)}: "
                "pass all K manifests of one shard_manifests materialization, rank_0 ... "
                "rank_<K-1>"
            )
        return cls(
            tuple(RankShard(m.rank, m.weight, m.sample_ids, m.sha256) for m in read),
            source=str(paths[0].parent),
            facts={
                "dataset": read[0].dataset,
                "selector": read[0].selector,
                "manifest_sha256": [m.sha256 for m in read],
                "rank_weights": [m.weight for m in read],
            },
        )

    @classmethod
    def from_export(cls, folder: str | Path) -> ClusterShards:
        """The shards and samples of an export (``cluster-pipeline export``: its ``rank_<c>``
        splits of ``dataset_dict/``, in position order), checked before use: every file the
        export wrote (``dataset_dict/`` and the Parquet files alike) has the SHA-256 that
        ``export.json`` records (:func:`~cluster_pipeline.integrations.hf_datasets.
        verify_export`), each rank's ids and weight hash to the manifest the export recorded,
        and each row's text hashes to its ``sample_id`` (:func:`~cluster_pipeline.data.formats.
        sample_id`). ``dataset_dict/`` is what is read; the Parquet files are checked to be the
        ones exported with it.

        Raises:
            ValueError (``ExportError``): ``folder`` is not an export, its ``export.json`` is
                not valid JSON or lacks a key, ``dataset_dict/`` or a split is missing, a file
                changed since the export, a rank's split no longer hashes to its manifest, or a
                row's text is not its sample's; each message names the file and says to export
                again.
        """
        import datasets

        folder = Path(folder)
        record = verify_export(folder)
        again = ["cluster-pipeline", "export", record.dataset, "--out", str(folder), "--overwrite"]
        redo = f"export it again: `{shlex.join(again)}`"
        where = folder / DATASET_DICT
        try:
            splits = datasets.load_from_disk(str(where))
        except (FileNotFoundError, ValueError, OSError) as e:
            raise ExportError(f"{where} cannot be read as a DatasetDict ({e}); {redo}") from None
        hashes = record.manifest_sha256
        missing = [f"rank_{c}" for c in range(len(hashes)) if f"rank_{c}" not in splits]
        if not isinstance(splits, datasets.DatasetDict) or missing:
            raise ExportError(
                f"{where} lacks the split(s) {', '.join(missing) or 'rank_0'} that {record.path} "
                f"records ({len(hashes)} ranks); {redo}"
            )
        ranks, frames = [], []
        for c, sha in enumerate(hashes):
            frame = splits[f"rank_{c}"].to_polars()
            assert isinstance(frame, pl.DataFrame)
            frame = frame.sort("position")
            weights = frame["weight"].unique().to_list()
            shard = RankShard(c, float(weights[0]), tuple(frame["sample_id"].to_list()), sha)
            if len(weights) != 1 or content_sha256(shard.sample_ids, shard.weight) != sha:
                raise ExportError(
                    f"{where} split rank_{c} does not hash to the manifest {sha[:12]} that "
                    f"{record.path} records (edited?); {redo}"
                )
            # The export writes null for "no system prompt" (the product's text is ""), the
            # conversation as a list (the product keeps JSON text, null for one exchange: both
            # render the same) and the tools' JSON text as tools_json (byte for byte).
            frame = frame.with_columns(pl.col("system").fill_null("")).with_columns(
                pl.Series("messages", _stored_messages(frame), dtype=pl.String),
                pl.col("tools_json").alias("tools"),
            )
            for row in frame.iter_rows(named=True):
                text_id = sample_id(
                    row["system"], row["prompt"], row["response"], row["tools"], row["messages"]
                )
                if text_id != row["sample_id"]:
                    raise ExportError(
                        f"{where} split rank_{c}, position {row['position']}: the text of sample "
                        f"{row['sample_id']} hashes to {text_id} (its system, prompt, response, "
                        f"messages or tools were edited); {redo}"
                    )
            ranks.append(shard)
            frames.append(frame.select(SAMPLE_COLUMNS))
        rows = pl.concat(frames).unique("sample_id", keep="first", maintain_order=True)
        facts = record.selection or {
            "dataset": record.dataset,
            "manifest_set_sha256": record.manifest_set_sha256,
            "manifest_sha256": record.manifest_sha256,
        }
        return cls(tuple(ranks), source=str(folder), rows=rows, facts=dict(facts))

    @classmethod
    def from_data_dir(cls, dataset: str, data_dir: str | Path | None = None) -> ClusterShards:
        """:meth:`from_export` of the dataset's default export folder,
        ``<data_dir>/exports/<dataset>/`` (``data_dir``: ``$CLUSTER_PIPELINE_DATA_DIR``, else the
        project's ``data/``).

        Raises:
            ValueError: the dataset has not been exported there.
        """
        folder = DataLayout.at(data_dir or default_data_dir()).exports_dir(dataset)
        if not folder.is_dir():
            raise ValueError(
                f"no export of dataset {dataset!r} at {folder}: run "
                f"`{shlex.join(['cluster-pipeline', 'export', dataset])}` first (it writes the "
                "shard manifests and their samples there)"
            )
        return cls.from_export(folder)

    def _rank(self, rank: int) -> RankShard:
        if not 0 <= rank < self.world_size:
            raise ValueError(
                f"rank {rank} is not one of the {self.world_size} ranks of the shards in "
                f"{self.source}: launch K = {self.world_size} processes (torchrun "
                f"--nproc_per_node x --nnodes = {self.world_size})"
            )
        return self.ranks[rank]

    def steps(
        self, rank: int, batch_size: int, accumulation: int, epoch: int = 0, seed: int = 0
    ) -> list[list[list[str]]]:
        """Rank ``rank``'s optimizer steps of epoch ``epoch``: per step its micro-batches, each
        the sample ids of its rows (``[]``: a placeholder micro-batch). The product's padded
        plan (module docstring; :func:`~cluster_pipeline.training.plan.plan_padded`) over the
        sizes of every rank, so all ranks have the same steps and micro-batches per step.

        Args:
            rank: the data-parallel rank, 0..K-1.
            batch_size: samples per micro-batch (``per_device_train_batch_size``).
            accumulation: micro-batches per step (``gradient_accumulation_steps``).
            epoch: the epoch, from 0.
            seed: the training seed of the order (the product's ``TrainSettings.seed``).

        Raises:
            ValueError: a rank outside 0..K-1, or a size or epoch below its bound.
        """
        shard = self._rank(rank)
        if batch_size < 1 or accumulation < 1 or epoch < 0:
            raise ValueError(
                f"batch_size and accumulation must be >= 1 and epoch >= 0, got {batch_size}, "
                f"{accumulation}, {epoch}"
            )
        sizes = [len(r.sample_ids) for r in self.ranks]
        plan = plan_padded(sizes, batch_size, accumulation, epoch + 1, seed)[rank]
        ids = shard.sample_ids
        return [
            [[ids[i] for i in mb.samples] for mb in step.micro_batches]
            for step in plan
            if step.epoch == epoch
        ]

    def dataset(self, rank: int, tokenizer: Any = None, settings: SequenceSettings | None = None):
        """Rank ``rank``'s shard as a ``datasets.Dataset``, one row per shard entry in manifest
        order, with a ``sample_id`` column (what :class:`ShardBatchSampler` looks rows up by).

        With ``tokenizer``: ``input_ids`` and ``labels`` (-100 outside the trained turns),
        encoded as the product's trainer encodes them (chat template, masking and truncation
        under ``settings``, default :class:`~cluster_pipeline.data.tokenization.
        SequenceSettings`: 256 tokens, ``left``, every assistant turn), which TRL takes as they
        are. Without: TRL's conversational ``prompt`` (the messages before the last assistant
        turn) and ``completion`` (that turn), plus ``tools`` (JSON text) when a sample has
        any; TRL then trains the last assistant turn, tokenized its own way.

        Raises:
            ValueError: the shards hold no samples (read from manifest files), or a sample
                keeps no trained token under ``settings`` (names it and what to do).
            ChatTemplateError: the tokenizer's chat template cannot render a sample.
        """
        import datasets

        shard = self._rank(rank)
        if self.rows is None:
            raise ValueError(
                f"the shards read from {self.source} hold sample ids only: read them with "
                "ClusterShards.from_export (or from_data_dir), or give the trainer a dataset of "
                "your own with a sample_id column"
            )
        order = pl.DataFrame({"sample_id": list(shard.sample_ids)})
        frame = order.join(self.rows, on="sample_id", how="left", maintain_order="left")
        if tokenizer is not None:
            settings = settings or SequenceSettings()
            encoded = encode_rows(tokenizer, frame, settings)
            for sid, e in zip(frame["sample_id"], encoded, strict=True):
                if e.skip_reason is not None:
                    raise ValueError(
                        f"sample {sid} of rank {rank} keeps no trained token under "
                        f"{settings.model_dump()} ({e.skip_reason}): use the max_length and "
                        "truncation the selection embedded with (proxy_embeddings' settings)"
                    )
            return datasets.Dataset.from_dict(
                {
                    "sample_id": frame["sample_id"].to_list(),
                    "input_ids": [e.input_ids for e in encoded],
                    "labels": [e.labels for e in encoded],
                }
            )
        columns: dict[str, list] = {"sample_id": [], "prompt": [], "completion": []}
        for row in frame.iter_rows(named=True):
            messages = conversation(row["system"], row["prompt"], row["response"], row["messages"])
            last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
            columns["sample_id"].append(row["sample_id"])
            columns["prompt"].append(messages[:last])
            columns["completion"].append([messages[last]])
        if frame["tools"].is_not_null().any():
            columns["tools"] = frame["tools"].to_list()
        return datasets.Dataset.from_dict(columns)


class ShardBatchSampler(Sampler[list[int]]):
    """A DataLoader ``batch_sampler`` that yields rank ``rank``'s micro-batches of
    :meth:`ClusterShards.steps`, epoch after epoch (``set_epoch``), as row indices of the
    dataset the DataLoader reads; a placeholder micro-batch is ``[placeholder]``. Every rank's
    sampler has the same length. It has no ``batch_size`` attribute, so accelerate's
    ``BatchSamplerShard`` passes its uneven micro-batches through.

    Args:
        shards: the K shards.
        rank: this process's rank.
        rows: sample id -> row index in the DataLoader's dataset (any row of that sample).
        batch_size: samples per micro-batch.
        accumulation: micro-batches per optimizer step.
        seed: the training seed of the order.
        placeholder: the row index of the placeholder sample (one padding token, label -100);
            needed only when the plan has placeholder micro-batches.

    Raises:
        ValueError: a sample of the shard has no row, or the plan has placeholders and no
            ``placeholder`` row was given.
    """

    def __init__(
        self,
        shards: ClusterShards,
        rank: int,
        rows: Mapping[str, int],
        batch_size: int,
        accumulation: int,
        seed: int = 0,
        placeholder: int | None = None,
    ):
        self.shards, self.rank, self.rows = shards, rank, rows
        # Not ``batch_size``: accelerate's BatchSamplerShard would then drop short micro-batches.
        self.micro_batch_size, self.accumulation, self.seed = batch_size, accumulation, seed
        self.placeholder = placeholder
        self.epoch = 0
        missing = [s for s in shards._rank(rank).sample_ids if s not in rows]
        if missing:
            raise ValueError(
                f"{len(missing)} sample(s) of rank {rank}'s shard ({shards.source}), e.g. "
                f"{missing[0]}, are not in the trainer's train_dataset (its sample_id column). "
                f"Give rank {rank} the dataset of ClusterShards.dataset({rank}, ...); TRL drops "
                "samples whose labels its truncation masks entirely: raise max_length"
            )
        first = self.micro_batches(0)
        self._length = len(first)
        self.has_placeholders = any(not mb for mb in first)
        if self.has_placeholders and placeholder is None:
            raise ValueError(
                f"rank {rank}'s plan has placeholder micro-batches (its shard is smaller than "
                "another rank's) and no placeholder row was given"
            )

    def micro_batches(self, epoch: int) -> list[list[str]]:
        """The sample ids of every micro-batch of ``epoch`` in order (``[]``: a placeholder)."""
        steps = self.shards.steps(
            self.rank, self.micro_batch_size, self.accumulation, epoch, self.seed
        )
        return [mb for step in steps for mb in step]

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration visits (``Trainer`` calls it before each epoch)."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[list[int]]:
        for mb in self.micro_batches(self.epoch):
            if mb:
                yield [self.rows[s] for s in mb]
            else:
                assert self.placeholder is not None  # checked in __init__
                yield [self.placeholder]

    def __len__(self) -> int:
        return self._length


class _WithPlaceholder(Dataset):
    """``data`` with one more row, at index ``len(data)``: the placeholder sample."""

    def __init__(self, data, placeholder: dict[str, list[int]] | None):
        self.data, self.placeholder = data, placeholder

    def __len__(self) -> int:
        return len(self.data) + (self.placeholder is not None)

    def __getitem__(self, i: int):
        if self.placeholder is not None and i == len(self.data):
            return self.placeholder
        return self.data[i]


def placeholder_row(columns: Sequence[str], pad_token_id: int) -> dict[str, list[int]]:
    """The placeholder sample in a dataset of ``columns``: one padding token, attended to, at
    position 0, that is no target.

    Raises:
        ValueError: a column it cannot fill (only input_ids, labels, attention_mask and
            position_ids can be).
    """
    values = {"input_ids": pad_token_id, "labels": IGNORE_INDEX, "attention_mask": 1}
    values["position_ids"] = 0
    unknown = [c for c in columns if c not in values]
    if unknown:
        raise ValueError(
            f"the train dataset's columns {unknown} have no placeholder value; ranks with "
            "fewer micro-batches need a placeholder row of input_ids, labels and attention_mask "
            "only"
        )
    return {c: [values[c]] for c in columns}


class ClusterTrainer(Trainer):
    """``transformers.Trainer`` whose training data follow the shards (module docstring): rank
    r is fed its shard's micro-batches in the product's step order, and its training loss is
    multiplied by w_r. Use it as the trainer, or put it first among the bases of a TRL trainer:
    ``class ClusterSFTTrainer(ClusterTrainer, SFTTrainer)``.

    Without a ``data_collator``, a plain ``transformers`` run collates with
    ``DataCollatorForSeq2Seq`` (labels padded with -100), not ``Trainer``'s default, which
    does not pad labels; a TRL trainer keeps the collator it chooses.

    Args:
        *args: ``Trainer``'s (or the TRL trainer's) arguments; ``train_dataset`` must be a
            ``datasets.Dataset`` with a ``sample_id`` column holding this rank's samples
            (:meth:`ClusterShards.dataset`).
        shards: the K shards; the process count must be K.
        order_seed: the training seed of the order (the product's ``TrainSettings.seed``,
            default 0).
        reweight: multiply the loss by w_c (False: weight 1, the product's ``reweight: false``).
        **kwargs: the trainer's keyword arguments.

    Raises:
        ValueError: a process count other than K, ``average_tokens_across_devices=True``,
            ``packing=True``, accelerate's ``split_batches`` or ``dispatch_batches``, or a train
            dataset without a ``sample_id`` column (each message says what to set).
    """

    def __init__(
        self,
        *args,
        shards: ClusterShards,
        order_seed: int = 0,
        reweight: bool = True,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self.shards, self.order_seed = shards, order_seed
        self._pad_labels_by_default(kwargs.get("data_collator"))
        a = self.args
        if a.world_size != shards.world_size:
            raise ValueError(
                f"{a.world_size} process(es) for {shards.world_size} shards ({shards.source}): "
                f"launch torchrun with --nproc_per_node x --nnodes = {shards.world_size}"
            )
        if a.average_tokens_across_devices:
            raise ValueError(
                "average_tokens_across_devices=True divides every rank's loss by the tokens of "
                "all ranks; the shards' weights w_c assume each rank's own step tokens "
                "(docs/design.md, step 5): set average_tokens_across_devices=False in your "
                "TrainingArguments / SFTConfig"
            )
        if getattr(a, "packing", False):
            raise ValueError(
                "packing=True concatenates samples before the sampler sees them; the shards' "
                "order is one sample per row: set packing=False"
            )
        accel = a.accelerator_config
        if getattr(accel, "split_batches", False) or getattr(accel, "dispatch_batches", False):
            raise ValueError(
                "accelerator_config split_batches / dispatch_batches share one batch among the "
                "processes; each rank reads its own shard here: leave both off"
            )
        data = self.train_dataset
        if getattr(data, "column_names", None) is None or "sample_id" not in data.column_names:  # type: ignore[union-attr]
            raise ValueError(
                "the train_dataset needs a sample_id column (a datasets.Dataset): use "
                "ClusterShards.dataset(rank, ...)"
            )
        self.shard_rank = a.process_index
        self.shard_weight = shards.ranks[self.shard_rank].weight if reweight else 1.0
        # The selection goes to the run's trackers (report_to) and the checkpoint's config:
        # stamped now, before any tracker's setup (at on_train_begin) reads the model's config.
        selection = SelectionCallback(shards, rank=self.shard_rank)
        selection.stamp(self.model)
        self.add_callback(selection)

    def _pad_labels_by_default(self, given: Any) -> None:
        """Where no collator was given and the trainer fell back on ``transformers.Trainer``'s
        own (``DataCollatorWithPadding``, which pads ``input_ids`` but not ``labels``, so a
        micro-batch of samples of unequal length fails with "Unable to create tensor"), collate
        with ``DataCollatorForSeq2Seq`` instead: ``input_ids`` padded by the tokenizer,
        ``labels`` with -100 (no target). A collator given, or one a TRL trainer chose, is kept.
        """
        from transformers import DataCollatorForSeq2Seq, DataCollatorWithPadding
        from transformers.data.data_collator import default_data_collator

        if given is not None:
            return
        fallback = self.data_collator
        if not isinstance(fallback, DataCollatorWithPadding) and fallback is not (
            default_data_collator
        ):
            return
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        if tokenizer is None or not hasattr(tokenizer, "pad"):
            return  # no tokenizer to pad with: the user gives a collator
        self.data_collator = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE_INDEX)

    def _pad_token_id(self) -> int:
        tok = getattr(self.processing_class, "tokenizer", self.processing_class)
        pad = getattr(tok, "pad_token_id", None)
        if pad is None:
            pad = getattr(getattr(self.model, "config", None), "pad_token_id", None)
        if pad is None:
            raise ValueError(
                "placeholder micro-batches need a pad token: give the trainer a tokenizer with "
                "one (processing_class)"
            )
        return int(pad)

    def get_train_dataloader(self) -> DataLoader:
        """This rank's DataLoader over its shard (module docstring): the train dataset's rows
        in :class:`ShardBatchSampler`'s order, collated by the trainer's collator, prepared by
        accelerate without re-sharding.

        Raises:
            ValueError: a sample of the shard is missing from the train dataset.
        """
        import datasets

        data = self.train_dataset
        assert isinstance(data, datasets.Dataset)
        rows: dict[str, int] = {}
        for i, sid in enumerate(data["sample_id"]):
            rows.setdefault(sid, i)
        data = self._remove_unused_columns(data, description="training")
        a = self.args
        sampler = ShardBatchSampler(
            self.shards,
            self.shard_rank,
            rows,
            self._train_batch_size,
            a.gradient_accumulation_steps,
            self.order_seed,
            placeholder=len(data),
        )
        placeholder = (
            placeholder_row(data.column_names, self._pad_token_id())
            if sampler.has_placeholders
            else None
        )
        loader = DataLoader(
            _WithPlaceholder(data, placeholder),
            batch_sampler=sampler,
            collate_fn=self.data_collator,
            num_workers=a.dataloader_num_workers,
            pin_memory=a.dataloader_pin_memory,
            persistent_workers=a.dataloader_persistent_workers,
            multiprocessing_context=a.dataloader_multiprocessing_context,
            prefetch_factor=a.dataloader_prefetch_factor,
            in_order=a.dataloader_in_order,
            worker_init_fn=partial(
                seed_worker, num_workers=a.dataloader_num_workers, rank=a.process_index
            ),
        )
        prepared = self.accelerator.prepare(loader)
        # accelerate deals batches round-robin to the processes (BatchSamplerShard); this
        # sampler already yields this rank's own, so the wrapper passes them all through.
        wrapper = getattr(prepared, "batch_sampler", None)
        if getattr(wrapper, "batch_sampler", None) is sampler:
            wrapper.num_processes, wrapper.process_index = 1, 0  # type: ignore[union-attr]
        if len(prepared) != len(sampler):
            raise RuntimeError(
                f"accelerate re-shards the shard's DataLoader ({len(prepared)} batches of "
                f"{len(sampler)}); this accelerate version is not supported"
            )
        return prepared

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ):
        """The trainer's own loss, times w_c in training (module docstring); evaluation losses
        are not weighted.

        Raises:
            ValueError: a training micro-batch without ``num_items_in_batch`` (the model does
                not take the step's token count, so the loss would not be the product's).
        """
        if not model.training:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if num_items_in_batch is None:
            raise ValueError(
                f"{type(self.model).__name__} does not take num_items_in_batch (its forward has "
                "no **kwargs), so the trainer averages per micro-batch and not over the rank's "
                "step; the shards' weights need the step's token count"
            )
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.clamp(min=1)
        else:
            num_items_in_batch = max(int(num_items_in_batch), 1)
        out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if isinstance(out, tuple):
            loss, outputs = out
            return loss * self.shard_weight, outputs
        return out * self.shard_weight


# The prefix of the selection's keys in a model's config and a tracker's params.
SELECTION_PREFIX = "cluster_selection."


class SelectionCallback(TrainerCallback):
    """A ``transformers.TrainerCallback`` that reports the selection a run trains on (the
    export's card facts: dataset, selector, ratio, K, alpha, weights, seeds, the manifest
    hashes, base model, code commit; this rank's weight and manifest) to whatever trackers the
    run's ``report_to`` names, and into the fine-tuned checkpoint's ``config.json``.

    How: at ``on_init_end`` (before any tracker's setup, which the trackers do at
    ``on_train_begin``) it sets them on the model's config as ``cluster_selection.<key>``
    attributes (lists as JSON text). Every ``transformers`` integration that logs the model's
    config then logs them: MLflow and SwanLab as params, W&B, Trackio and Comet as config,
    TensorBoard as the ``model_config`` text, Neptune and ClearML as the model's
    configuration; ``save_pretrained`` writes them to ``config.json``. Under MLflow (an active
    run at ``on_train_begin``, rank 0) it also logs the selection as the run's dataset input
    (``mlflow.data``, digest: the manifest set hash's first 32 digits, MLflow's limit being
    36) and tags ``cluster_selection.manifest_set_sha256``. :class:`ClusterTrainer` adds it
    itself; with another trainer, pass ``callbacks=[SelectionCallback.from_export(folder)]``
    (added later with ``add_callback``, it runs after the trackers' setup).

    Args:
        shards: the shards of the selection (their ``facts``).
        rank: this process's rank (None: the run trains on the whole selection).
    """

    def __init__(self, shards: ClusterShards, rank: int | None = None):
        self.shards, self.rank = shards, rank

    @classmethod
    def from_export(cls, folder: str | Path, rank: int | None = None) -> SelectionCallback:
        """The callback of an export (:meth:`ClusterShards.from_export`, checked as it checks).

        Raises:
            ValueError (``ExportError``): ``folder`` is not a readable export.
        """
        return cls(ClusterShards.from_export(folder), rank)

    def values(self) -> dict[str, str | int | float | bool | None]:
        """The selection's facts as scalars, by key without the prefix (lists and mappings as
        JSON text)."""
        facts = dict(self.shards.facts)
        if self.rank is not None:
            shard = self.shards.ranks[self.rank]
            facts.update(rank=self.rank, rank_weight=shard.weight, rank_manifest=shard.sha256)
        return {k: json.dumps(v) if isinstance(v, list | dict) else v for k, v in facts.items()}

    def stamp(self, model: Any) -> None:
        """Set the facts on ``model``'s config (a model without one is left as it is)."""
        config = getattr(model, "config", None)
        if config is None:
            return
        for key, value in self.values().items():
            setattr(config, f"{SELECTION_PREFIX}{key}", value)

    def on_init_end(self, args, state, control, model=None, **kwargs):
        """Stamp the model's config before the trackers read it."""
        self.stamp(model)

    def on_train_begin(self, args, state, control, **kwargs):
        """Under an active MLflow run (``report_to`` mlflow), rank 0 logs the selection as the
        run's training dataset and tags it with the manifest set hash."""
        if not state.is_world_process_zero or "mlflow" not in (args.report_to or []):
            return
        import mlflow

        if mlflow.active_run() is None:
            return
        from mlflow.data.dataset_source_registry import resolve_dataset_source
        from mlflow.data.meta_dataset import MetaDataset

        facts = self.shards.facts
        digest = str(facts.get("manifest_set_sha256") or "")
        if not digest:  # manifest files alone: the ranks' manifest hashes name the selection
            digest = hashlib.sha256("".join(r.sha256 for r in self.shards.ranks).encode())
            digest = digest.hexdigest()
        with warnings.catch_warnings():
            # MLflow registers its local-files source twice (URI schemes "" and "file", the
            # same class) and warns that a path "can be interpreted in multiple ways" for
            # every local path: nothing the user can act on.
            warnings.filterwarnings("ignore", "The specified dataset source can be interpreted")
            source = resolve_dataset_source(str(Path(self.shards.source).absolute()))
        dataset = MetaDataset(
            source=source,
            name=f"{facts.get('dataset', 'selection')} selection ({facts.get('selector', '?')})",
            digest=digest[:32],
        )
        mlflow.log_input(dataset, context="training")
        mlflow.set_tags({f"{SELECTION_PREFIX}manifest_set_sha256": digest})

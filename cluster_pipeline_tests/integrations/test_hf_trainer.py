"""integrations/hf_trainer.py: the shards' step order, sampler and weights for a user's own
Hugging Face Trainer / TRL script.

The fast tests check the order, the sampler and the datasets on hand-made shards. The slow one
materializes the cheap chain ``raw_instructions -> shard_manifests`` on the tiny dataset and
model, exports it, runs TRL's ``SFTTrainer`` under torchrun at 2 ranks with the sampler
(``trl_sft.py``) and the product's own trainer on the same manifests, and compares what each rank
was fed and its first step's weighted loss.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest

from cluster_pipeline.data.formats import conversation
from cluster_pipeline.data.tokenization import SequenceSettings, encode_sample
from cluster_pipeline.integrations.hf_trainer import (
    SAMPLE_COLUMNS,
    ClusterShards,
    RankShard,
    ShardBatchSampler,
    placeholder_row,
)
from cluster_pipeline.selection.sharding import ShardManifest, content_sha256
from cluster_pipeline_tests.helpers import build_model, instructions_table, tiny_records

# One xdist worker runs this module: its module-scoped fixture starts once.
pytestmark = pytest.mark.xdist_group("hf_trainer")

datasets = pytest.importorskip("datasets")


def _rows(tmp_path: Path, n: int) -> pl.DataFrame:
    table = instructions_table(tmp_path / "raw", tiny_records(n))
    return pl.read_delta(table.uri).select(SAMPLE_COLUMNS)


def _shards(rows: pl.DataFrame, sizes: list[int], weights: list[float]) -> ClusterShards:
    """Disjoint shards of ``sizes`` samples, in table order, with ``weights``."""
    ids = rows["sample_id"].to_list()
    ranks, start = [], 0
    for r, (n, w) in enumerate(zip(sizes, weights, strict=True)):
        shard = tuple(ids[start : start + n])
        ranks.append(RankShard(r, w, shard, content_sha256(shard, w)))
        start += n
    return ClusterShards(tuple(ranks), "hand-made", rows)


# --- The order ---------------------------------------------------------------------------------


def test_the_steps_are_the_products_padded_plan_with_placeholders_on_the_smaller_rank(tmp_path):
    shards = _shards(_rows(tmp_path, 12), [7, 4], [1.4, 0.6])
    for epoch in (0, 1):
        # Hand-derived: 2 steps of 2 micro-batches of 2 (ceil(7 / 4)); rank 0's seven samples in
        # the epoch's permutation make micro-batches of 2, 2, 2, 1; rank 1's four make 2, 2 and
        # its second step is two placeholders.
        for rank, shape in ((0, [[2, 2], [2, 1]]), (1, [[2, 2], [0, 0]])):
            steps = shards.steps(rank, batch_size=2, accumulation=2, epoch=epoch, seed=3)
            assert [[len(mb) for mb in step] for step in steps] == shape
            ids = shards.ranks[rank].sample_ids
            order = np.random.default_rng([3, epoch]).permutation(len(ids))
            assert [s for step in steps for mb in step for s in mb] == [ids[i] for i in order]
    assert shards.steps(0, 2, 2, 0, 3) != shards.steps(0, 2, 2, 1, 3)
    assert shards.steps(0, 2, 2, 0, 3) != shards.steps(0, 2, 2, 0, 4)
    # Three samples per micro-batch: ceil(7 / 6) = 2 steps; rank 0's 3, 3 then 1; rank 1's 3, 1.
    assert [[len(mb) for mb in s] for s in shards.steps(0, 3, 2)] == [[3, 3], [1]]
    assert [[len(mb) for mb in s] for s in shards.steps(1, 3, 2)] == [[3, 1], [0]]
    with pytest.raises(ValueError, match="rank 2 is not one of the 2 ranks"):
        shards.steps(2, 2, 2)


def test_the_sampler_yields_the_steps_as_row_indices_and_equal_lengths_on_every_rank(tmp_path):
    shards = _shards(_rows(tmp_path, 12), [7, 4], [1.4, 0.6])
    # A dataset holding the samples in another order than the shards, with a duplicate row.
    every = [s for r in shards.ranks for s in r.sample_ids]
    table = list(reversed(every)) + [every[0]]
    rows = {}
    for i, sid in enumerate(table):
        rows.setdefault(sid, i)
    samplers = [ShardBatchSampler(shards, r, rows, 2, 2, seed=5, placeholder=99) for r in (0, 1)]
    assert len(samplers[0]) == len(samplers[1]) == 4
    assert not samplers[0].has_placeholders and samplers[1].has_placeholders
    for epoch in (0, 1):
        for rank, sampler in enumerate(samplers):
            sampler.set_epoch(epoch)
            got = [[table[i] if i != 99 else None for i in mb] for mb in sampler]
            want = [mb or [None] for st in shards.steps(rank, 2, 2, epoch, 5) for mb in st]
            assert got == want
    # Each rank sees its whole shard every epoch and nothing else.
    for rank, sampler in enumerate(samplers):
        seen = Counter(table[i] for mb in sampler for i in mb if i != 99)
        assert seen == Counter(shards.ranks[rank].sample_ids)


def test_the_sampler_refuses_a_dataset_without_the_shard_or_a_placeholder(tmp_path):
    shards = _shards(_rows(tmp_path, 12), [7, 4], [1.4, 0.6])
    some = {s: i for i, s in enumerate(shards.ranks[0].sample_ids[:5])}
    with pytest.raises(ValueError) as e:
        ShardBatchSampler(shards, 0, some, 2, 2)
    assert str(e.value).startswith(
        f"2 sample(s) of rank 0's shard (hand-made), e.g. {shards.ranks[0].sample_ids[5]}, are "
        "not in the trainer's train_dataset (its sample_id column)."
    )
    every = {s: i for i, s in enumerate(s for r in shards.ranks for s in r.sample_ids)}
    with pytest.raises(ValueError, match="has placeholder micro-batches .* no placeholder row"):
        ShardBatchSampler(shards, 1, every, 2, 2)


def test_the_placeholder_row_is_one_padding_token_without_a_target():
    assert placeholder_row(["input_ids", "labels", "attention_mask"], 7) == {
        "input_ids": [7],
        "labels": [-100],
        "attention_mask": [1],
    }
    with pytest.raises(ValueError, match=r"columns \['pixel_values'\] have no placeholder"):
        placeholder_row(["input_ids", "pixel_values"], 7)


# --- Where the shards come from ----------------------------------------------------------------


def test_manifest_files_give_the_shards_and_wrong_sets_are_refused(tmp_path):
    rows = _rows(tmp_path, 12)
    ids = rows["sample_id"].to_list()
    folder = tmp_path / "shards"
    manifests = [
        ShardManifest("t", 0, 2, "peripheral", 1.25, 0, tuple(ids[:5])),
        ShardManifest("t", 1, 2, "peripheral", 0.75, 0, tuple(ids[5:8])),
    ]
    paths = [m.write(folder) for m in manifests]
    for source in (folder, str(folder), paths[::-1]):
        shards = ClusterShards.from_manifests(source)
        assert shards.weights == [1.25, 0.75] and shards.rows is None
        assert [r.sample_ids for r in shards.ranks] == [m.sample_ids for m in manifests]
        assert [r.sha256 for r in shards.ranks] == [m.sha256 for m in manifests]
    with pytest.raises(ValueError, match=r"hold ranks \[1\] of world sizes \[2\]: pass all K"):
        ClusterShards.from_manifests([paths[1]])
    with pytest.raises(ValueError, match="no shard manifest"):
        ClusterShards.from_manifests(tmp_path / "raw")
    with pytest.raises(ValueError, match="hold sample ids only: read them with"):
        ClusterShards.from_manifests(folder).dataset(0)
    edited = json.loads(paths[1].read_text())
    edited["weight"] = 1.0
    paths[1].write_text(json.dumps(edited))
    with pytest.raises(ValueError, match="content hash mismatch"):
        ClusterShards.from_manifests(folder)


def _export(tmp_path: Path, n: int, sizes: list[int], weights: list[float]):
    """``n`` records (two with a system prompt) in a raw_instructions table and disjoint shards
    of ``sizes`` over them, exported as ``cluster-pipeline export`` writes them
    (:func:`~cluster_pipeline.integrations.hf_datasets.export_selection`). Returns (the export
    folder, the shards, the table's rows)."""
    from cluster_pipeline.integrations.hf_datasets import ExportSource, export_selection
    from cluster_pipeline.storage.tables import write_table

    records = tiny_records(n)
    for r in records[:2]:
        r["system"] = "You are terse."
    raw = instructions_table(tmp_path / "raw", records)
    rows = pl.read_delta(raw.uri).select(SAMPLE_COLUMNS)
    shards = _shards(rows, sizes, weights)
    ids = rows["sample_id"].to_list()
    clusters = write_table(
        pl.DataFrame({"sample_id": ids, "cluster": [0] * len(ids)}), tmp_path / "clusters"
    )
    manifests = [
        ShardManifest("hand", r.rank, len(sizes), "peripheral", r.weight, 0, r.sample_ids)
        for r in shards.ranks
    ]
    source = ExportSource(
        dataset="hand",
        selector="peripheral",
        ratio=1.0,
        selection_seed=0,
        num_clusters=len(sizes),
        alpha=1.5,
        cluster_weights=weights,
        balance="samples",
        token_budget=None,
        pool_size=n,
        selected_samples=sum(sizes),
        base_model="/models/tiny",
        manifest_paths=[str(m.write(tmp_path / "shards")) for m in manifests],
        manifest_sha256=[m.sha256 for m in manifests],
        manifest_set_sha256="ab" * 32,
        dropped_for_equal_shards=0,
        tables={"raw_instructions": raw, "balanced_clusters": clusters},
    )
    out = tmp_path / "export"
    export_selection(source, out, tmp_path / "no_raw")
    return out, shards, rows


def test_an_export_gives_the_shards_and_their_samples(tmp_path):
    out, shards, rows = _export(tmp_path, 12, [5, 3], [1.25, 0.75])
    read = ClusterShards.from_export(out)
    assert read.ranks == shards.ranks and read.source == str(out)
    # The samples' text as raw_instructions stores it: "" for no system prompt (the export
    # writes null), the system prompt where there is one.
    assert read.rows is not None and sorted(read.rows.rows()) == sorted(rows.head(8).rows())
    assert sorted(set(read.rows["system"])) == ["", "You are terse."]
    exported = datasets.load_from_disk(str(out / "dataset_dict"))["train"]
    assert sorted(set(exported["system"]), key=str) == [None, "You are terse."]
    data = tmp_path / "data"
    (data / "exports").mkdir(parents=True)
    out.rename(data / "exports" / "hand")
    assert ClusterShards.from_data_dir("hand", data).ranks == shards.ranks
    with pytest.raises(ValueError) as e:
        ClusterShards.from_data_dir("other", data)
    assert str(e.value) == (
        f"no export of dataset 'other' at {data.resolve() / 'exports' / 'other'}: run "
        "`cluster-pipeline export other` first (it writes the shard manifests and their samples "
        "there)"
    )


def _rehash(out: Path) -> None:
    """Record the files' present hashes in export.json: an edit that covers its tracks."""
    from cluster_pipeline.integrations.hf_datasets import file_sha256

    identity = json.loads((out / "export.json").read_text())
    identity["files"] = {rel: file_sha256(out / rel) for rel in identity["files"]}
    (out / "export.json").write_text(json.dumps(identity))


def _edit_split(out: Path, split: str, change) -> None:
    """Rewrite ``split`` of ``dataset_dict/`` with ``change`` (a polars frame -> frame); the
    other splits' files stay as they are."""
    import shutil

    folder = out / "dataset_dict" / split
    ds = datasets.load_from_disk(str(folder))
    edited = datasets.Dataset.from_polars(change(ds.to_polars()), info=ds.info.copy())
    del ds
    edited.save_to_disk(str(out.parent / "edited"))
    shutil.rmtree(folder)
    (out.parent / "edited").rename(folder)


TRUNCATED = "Unterminated string starting at: line 2 column 2"
REDO = "export it again: `cluster-pipeline export {dataset} --out {out} --overwrite`"
# Never "delete it": a folder without a readable record may hold the user's own files.
UNREADABLE = (
    "give the folder an export wrote, or export to a new folder: `cluster-pipeline export "
    "<dataset> --out <new folder>`"
)


def test_a_broken_or_edited_export_is_refused_naming_the_file(tmp_path):
    import shutil

    out, shards, _ = _export(tmp_path, 12, [5, 3], [1.25, 0.75])
    pristine = tmp_path / "pristine"
    shutil.copytree(out, pristine, symlinks=True)
    identity = out / "export.json"
    redo = REDO.format(dataset="hand", out=out)
    unknown = UNREADABLE

    def refused(fragment: str) -> str:
        with pytest.raises(ValueError) as e:
            ClusterShards.from_export(out)
        assert fragment in str(e.value), str(e.value)
        shutil.rmtree(out)
        shutil.copytree(pristine, out, symlinks=True)
        return str(e.value)

    assert ClusterShards.from_export(out).ranks == shards.ranks
    # export.json: gone, truncated, another tool's, a key missing.
    identity.unlink()
    assert refused("") == f"{out} holds no export.json, so it is not an export: {unknown}"
    text = (pristine / "export.json").read_text()
    identity.write_text(text[:12])
    assert refused("") == f"{identity} is not valid JSON ({TRUNCATED}): {unknown}"
    identity.write_text('{"exporter": "my-other-tool"}')
    assert refused("") == (
        f'{identity} has no "exporter": "cluster-pipeline export", so it is not an export: '
        f"{unknown}"
    )
    for key in ("manifest_sha256", "files", "dataset"):
        record = json.loads(text)
        del record[key]
        identity.write_text(json.dumps(record))
        assert refused("") == f'{identity} lacks the key "{key}": {unknown}'
    # dataset_dict/ gone, a split gone, a file of it gone.
    shutil.rmtree(out / "dataset_dict")
    assert refused("") == (
        f"{out}: dataset_dict/, listed in {identity}, is gone; the export is incomplete: {redo}"
    )
    shutil.rmtree(out / "dataset_dict" / "rank_1")
    assert refused("") == (
        f"{out}: dataset_dict/rank_1/, listed in {identity}, is gone; the export is "
        f"incomplete: {redo}"
    )
    (out / "data" / "rank_0" / "rank_0-00000-of-00001.parquet").unlink()
    assert refused("") == (
        f"{out}: data/rank_0/rank_0-00000-of-00001.parquet, listed in {identity}, is gone; the "
        f"export is incomplete: {redo}"
    )
    # The Parquet files the Hub and load_dataset read: a row dropped, a response changed.
    changed = (
        f"{out}: {{n}} file(s) changed since the export wrote them ({{file}}: their SHA-256 is not "
        f"the one {identity} records); {redo}"
    )
    import pyarrow as pa
    import pyarrow.parquet as pq

    def put(name: str, value):
        def change(t: pa.Table) -> pa.Table:
            i = t.schema.get_field_index(name)
            return t.set_column(i, t.schema.field(i), pa.array([value] * t.num_rows))

        return change

    parquet = out / "data" / "rank_0" / "rank_0-00000-of-00001.parquet"
    for edit in (lambda t: t.slice(1), put("response", "HACKED"), put("weight", 2.0)):
        pq.write_table(edit(pq.read_table(parquet)), parquet)
        assert refused("") == changed.format(n=1, file="data/rank_0/rank_0-00000-of-00001.parquet")
    # dataset_dict/, what trains: a response edited to HACKED.
    hacked = pl.col("response").cum_count().eq(3)

    def hack(f):
        return f.with_columns(
            pl.when(hacked).then(pl.lit("HACKED")).otherwise("response").alias("response")
        )

    _edit_split(out, "rank_0", hack)
    # (save_to_disk gives the split a new fingerprint too.)
    arrow = "dataset_dict/rank_0/data-00000-of-00001.arrow, dataset_dict/rank_0/state.json"
    assert refused("") == changed.format(n=2, file=arrow)
    # Even with export.json's hashes forged to match, the text must hash to its sample_id, and
    # each rank's ids and weight to its manifest.
    _edit_split(out, "rank_0", hack)
    _rehash(out)
    third = shards.ranks[0].sample_ids[2]
    msg = refused("")
    assert msg.startswith(
        f"{out / 'dataset_dict'} split rank_0, position 2: the text of sample {third} hashes to "
    )
    assert msg.endswith(f" (its system, prompt, response, messages or tools were edited); {redo}")
    _edit_split(out, "rank_1", lambda f: f.with_columns(pl.lit(0.5).alias("weight")))
    _rehash(out)
    assert refused("") == (
        f"{out / 'dataset_dict'} split rank_1 does not hash to the manifest "
        f"{shards.ranks[1].sha256[:12]} that {identity} records (edited?); {redo}"
    )


def test_the_rank_dataset_holds_the_products_tokens_or_trls_conversation(tmp_path, tiny_tokenizer):
    rows = _rows(tmp_path, 12)
    shards = _shards(rows, [5, 3], [1.25, 0.75])
    settings = SequenceSettings(max_length=36)  # cuts some samples: truncated as the product cuts
    by_id = {r["sample_id"]: r for r in rows.iter_rows(named=True)}
    ds = shards.dataset(1, tiny_tokenizer, settings)
    assert ds.column_names == ["sample_id", "input_ids", "labels"]
    assert [r["sample_id"] for r in ds.to_list()] == list(shards.ranks[1].sample_ids)
    cut = 0
    for row in ds.to_list():
        s = by_id[row["sample_id"]]
        want = encode_sample(tiny_tokenizer, s["system"], s["prompt"], s["response"], 36)
        assert (row["input_ids"], row["labels"]) == (want.input_ids, want.labels)
        cut += want.truncated
    assert cut > 0
    text = shards.dataset(0)
    assert text.column_names == ["sample_id", "prompt", "completion"]
    for row in text.to_list():
        s = by_id[row["sample_id"]]
        messages = conversation(s["system"], s["prompt"], s["response"], s["messages"])
        assert row["prompt"] + row["completion"] == messages
        assert row["completion"] == [{"role": "assistant", "content": s["response"]}]
    with pytest.raises(ValueError, match="keeps no trained token under"):
        shards.dataset(0, tiny_tokenizer, SequenceSettings(max_length=2, truncation="skip"))


# --- The trainer in one process -----------------------------------------------------------------


def _trainer(tmp_path, tok, shards, data, collator: object = "seq2seq", **overrides):
    """A plain transformers Trainer with the shards, on a fresh tiny model, in this process
    (``collator``: "seq2seq" for ``DataCollatorForSeq2Seq``, None for none given, else that
    collator)."""
    from transformers import DataCollatorForSeq2Seq, TrainingArguments

    from cluster_pipeline.integrations.hf_trainer import ClusterTrainer

    args = TrainingArguments(
        str(tmp_path / "out"),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        use_cpu=True,
        **{"average_tokens_across_devices": False, "report_to": "none", **overrides},
    )
    if collator == "seq2seq":
        collator = DataCollatorForSeq2Seq(tok, label_pad_token_id=-100)
    given: dict[str, Any] = {} if collator is None else {"data_collator": collator}
    return ClusterTrainer(
        model=build_model(len(tok), pad_token_id=tok.pad_token_id),
        args=args,
        train_dataset=data,
        processing_class=tok,
        shards=shards,
        **given,
    )


def test_a_plain_trainer_without_a_collator_pads_the_labels_and_trains(tmp_path, tiny_tokenizer):
    """transformers' own fallback (DataCollatorWithPadding) pads input_ids but not labels, so
    the plain Trainer path failed on samples of unequal length; ClusterTrainer pads both."""
    from transformers import DataCollatorForSeq2Seq
    from transformers.data.data_collator import default_data_collator

    rows = _rows(tmp_path, 12)
    shards = _shards(rows, [5], [1.25])
    data = shards.dataset(0, tiny_tokenizer, SequenceSettings(max_length=64))
    trainer = _trainer(tmp_path, tiny_tokenizer, shards, data, collator=None, max_steps=1)
    assert isinstance(trainer.data_collator, DataCollatorForSeq2Seq)
    by_id = {r["sample_id"]: r for r in data.to_list()}
    first = trainer.get_train_dataloader()
    batch = next(iter(first))
    ids = shards.steps(0, 2, 2)[0][0]
    lengths = [len(by_id[s]["input_ids"]) for s in ids]
    assert len(set(lengths)) == 2  # unequal: padding is needed
    longest = max(lengths)
    for row, sid in enumerate(ids):
        labels = by_id[sid]["labels"]
        pad = [-100] * (longest - len(labels))
        assert batch["labels"][row].tolist() == labels + pad  # the tokenizer pads on the right
        mask = [1] * len(labels) + [0] * len(pad)
        assert batch["attention_mask"][row].tolist() == mask
    trainer.train()
    assert trainer.state.global_step == 1
    # A collator given is kept.
    kept = _trainer(tmp_path, tiny_tokenizer, shards, data, collator=default_data_collator)
    assert kept.data_collator is default_data_collator


def test_a_trainer_reads_its_shard_in_the_steps_order_and_weights_its_loss(
    tmp_path, tiny_tokenizer
):
    import torch

    rows = _rows(tmp_path, 12)
    shards = _shards(rows, [5], [1.25])
    data = shards.dataset(0, tiny_tokenizer, SequenceSettings(max_length=64))
    trainer = _trainer(tmp_path, tiny_tokenizer, shards, data.shuffle(seed=1))
    ids = {tuple(r["input_ids"]): r["sample_id"] for r in data.to_list()}
    batches = list(trainer.get_train_dataloader())
    got = []
    for b in batches:
        rows_ = [
            i[m.bool()].tolist() for i, m in zip(b["input_ids"], b["attention_mask"], strict=True)
        ]
        got.append([ids[tuple(r)] for r in rows_])
    assert got == [mb for step in shards.steps(0, 2, 2) for mb in step]  # [2, 2], [1]

    model = trainer.model
    assert isinstance(model, torch.nn.Module)
    model.train()
    batch = {k: v for k, v in batches[0].items()}
    targets = torch.tensor(int((batch["labels"][:, 1:] != -100).sum()))

    def loss(inputs, **kwargs) -> torch.Tensor:
        out = trainer.compute_loss(model, dict(inputs), **kwargs)
        assert isinstance(out, torch.Tensor)
        return out

    plain = model(**batch, num_items_in_batch=targets).loss
    torch.testing.assert_close(loss(batch, num_items_in_batch=targets), 1.25 * plain)
    # A step of placeholders only (no target) gives 0, not 0 / 0.
    empty = {**batch, "labels": torch.full_like(batch["labels"], -100)}
    assert float(loss(empty, num_items_in_batch=torch.tensor(0)).detach()) == 0.0
    model.eval()  # evaluation losses are not weighted
    torch.testing.assert_close(loss(batch), model(**batch).loss)


def test_a_trainer_refuses_settings_that_would_change_the_shards_or_their_weights(
    tmp_path, tiny_tokenizer
):
    rows = _rows(tmp_path, 12)
    one = _shards(rows, [5], [1.25])
    data = one.dataset(0, tiny_tokenizer, SequenceSettings(max_length=64))
    with pytest.raises(ValueError, match="average_tokens_across_devices=True divides every"):
        _trainer(tmp_path, tiny_tokenizer, one, data, average_tokens_across_devices=True)
    two = _shards(rows, [5, 3], [1.25, 0.75])
    with pytest.raises(ValueError) as e:
        _trainer(tmp_path, tiny_tokenizer, two, data)
    assert str(e.value) == (
        "1 process(es) for 2 shards (hand-made): launch torchrun with --nproc_per_node x "
        "--nnodes = 2"
    )
    with pytest.raises(ValueError, match="the train_dataset needs a sample_id column"):
        _trainer(tmp_path, tiny_tokenizer, one, data.remove_columns("sample_id"))
    other = _shards(rows.reverse(), [5], [1.25])  # another rank's samples
    trainer = _trainer(tmp_path, tiny_tokenizer, other, data)
    with pytest.raises(ValueError, match=r"5 sample\(s\) of rank 0's shard .* are not in the"):
        trainer.get_train_dataloader()


# --- TRL's SFTTrainer under torchrun, against the product's trainer -----------------------------

BATCH, ACCUMULATION, MAX_LENGTH, LR = 2, 2, 64, 1e-3


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_model_dir, tiny_embedding_cache) -> dict:
    """``raw_instructions -> shard_manifests`` materialized on the 60-sample dataset ``tiny`` and
    exported to ``data/exports/tiny``; returns the data folder and the two stages' records."""
    import dagster as dg

    from cluster_pipeline.cli.export import export_source
    from cluster_pipeline.defs.partitions import DATASETS
    from cluster_pipeline.integrations.hf_datasets import export_selection
    from cluster_pipeline.storage.layout import DataLayout
    from cluster_pipeline_tests.helpers import (
        materialize_partition,
        meta,
        pipeline_assets,
        resources,
        seed_embeddings,
        write_jsonl,
    )

    root = tmp_path_factory.mktemp("exported")
    data = root / "data"
    write_jsonl(data / "raw" / "tiny" / "samples.jsonl", tiny_records(60))
    seed_embeddings(tiny_embedding_cache, data)
    (root / "home").mkdir()
    layout = DataLayout.at(data)
    with dg.DagsterInstance.from_config(str(root / "home")) as instance:
        instance.add_dynamic_partitions(DATASETS, ["tiny"])
        chain = pipeline_assets()[:5]
        assert materialize_partition(chain, instance, resources(data, tiny_model_dir)).success
        source = export_source(instance, "tiny", layout)
        records = {s: meta(instance, s) for s in ("raw_instructions", "shard_manifests")}
    export_selection(source, layout.exports_dir("tiny"), layout.raw_dir)
    return {"root": root, "data": data, **records}


def _torchrun(module: str, args: list[str], cwd: Path) -> None:
    from cluster_pipeline.launch.torchrun import torchrun_command

    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(cwd / "hf_home"),
    }
    done = subprocess.run(
        torchrun_command(module, 2, args),
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=cwd,
    )
    assert done.returncode == 0, done.stderr[-6000:]


def _products_first_steps(exported: dict, tiny_model_dir: Path, out: Path) -> tuple[list, list]:
    """The product's trainer (``recipes.train``, ``packing: false``) on the same manifests for
    one epoch: (per step the ranks' token-mean losses, the ranks' weights)."""
    from cluster_pipeline.training.checkpointing import TRAINING_INFO, metrics_path
    from cluster_pipeline.training.config import TrainJob, TrainSettings

    raw, shards = exported["raw_instructions"], exported["shard_manifests"]
    job = TrainJob(
        settings=TrainSettings(
            max_length=MAX_LENGTH,
            packing=False,
            per_device_batch_size=BATCH,
            gradient_accumulation_steps=ACCUMULATION,
            learning_rate=LR,
            warmup_ratio=0.0,
            schedule="constant",
            max_grad_norm=1.0,
            grad_cosine_every=None,
            seed=0,
        ),
        model_path=str(tiny_model_dir),
        instructions_uri=str(raw["table_uri"]),
        instructions_version=int(raw["table_version"]),
        manifests=list(shards["manifest_paths"]),
        output_dir=str(out / "ckpt"),
    )
    job.dump(out / "train.json")
    _torchrun("cluster_pipeline.recipes.train", ["--config", str(out / "train.json")], out)
    steps = [json.loads(line) for line in metrics_path(out / "ckpt").read_text().splitlines()]
    info = json.loads((out / "ckpt" / TRAINING_INFO).read_text())
    return [s["loss_per_rank"] for s in steps], info["rank_weights"]


@pytest.mark.slow
def test_trls_sft_trainer_feeds_each_rank_its_shard_in_order_with_the_products_first_step_loss(
    exported, tiny_model_dir, tmp_path
):
    from cluster_pipeline.training.plan import plan_padded

    manifests = [ShardManifest.read(Path(p)) for p in exported["shard_manifests"]["manifest_paths"]]
    sizes = [m.n_samples for m in manifests]
    # What the test exercises: shards of unequal sample counts (token balance), so the smaller
    # rank gets placeholder micro-batches ...
    plans = plan_padded(sizes, BATCH, ACCUMULATION, 1, 0)
    assert any(mb.placeholder for plan in plans for step in plan for mb in step.micro_batches)
    # ... and weights away from 1, so that a loss left unweighted would be told apart.
    assert all(abs(m.weight - 1) > 0.01 for m in manifests)

    trl_out = tmp_path / "trl"
    trl_out.mkdir()
    args = [
        "--data-dir",
        str(exported["data"]),
        "--dataset",
        "tiny",
        "--model",
        str(tiny_model_dir),
    ]
    args += ["--out", str(trl_out), "--batch", str(BATCH), "--accumulation", str(ACCUMULATION)]
    args += ["--max-length", str(MAX_LENGTH), "--learning-rate", str(LR)]
    _torchrun("cluster_pipeline_tests.integrations.trl_sft", args, trl_out)
    fed = [json.loads((trl_out / f"rank_{r}.json").read_text()) for r in range(2)]

    product = tmp_path / "product"
    product.mkdir()
    losses, weights = _products_first_steps(exported, tiny_model_dir, product)
    assert len(losses) == len(plans[0])  # one epoch, same number of steps

    # Each micro-batch's rows, mapped back to samples by the product's own encoding of the
    # pinned raw_instructions version.
    from cluster_pipeline.models.loading import load_tokenizer

    tok = load_tokenizer(str(tiny_model_dir))
    raw = exported["raw_instructions"]
    table = pl.read_delta(str(raw["table_uri"]), version=int(raw["table_version"]))
    by_id = {r["sample_id"]: r for r in table.iter_rows(named=True)}
    for rank, manifest in enumerate(manifests):
        ids = {}
        for sid in set(manifest.sample_ids):
            s = by_id[sid]
            e = encode_sample(tok, s["system"], s["prompt"], s["response"], MAX_LENGTH)
            ids[tuple(e.input_ids)] = sid
        assert len(ids) == len(set(manifest.sample_ids))  # rows identify their samples
        placeholder = (tok.pad_token_id,)
        got = [
            (f["step"], [ids[tuple(row)] for row in f["rows"] if tuple(row) != placeholder])
            for f in fed[rank]["fed"]
        ]
        want = [
            (s, [manifest.sample_ids[i] for i in mb.samples])
            for s, step in enumerate(plans[rank])
            for mb in step.micro_batches
        ]
        # The product's step order, micro-batch by micro-batch, placeholders included ...
        assert got == want
        # ... which is the whole shard, each entry once.
        assert Counter(s for _, mb in got for s in mb) == Counter(manifest.sample_ids)

        # The first optimizer step's weighted loss: TRL's micro-batch losses (each already
        # w_c x summed cross-entropy / the rank's step targets) against the product's. The
        # later steps agree too (both take the same AdamW steps from the same weights; measured
        # within 6e-7 on 2026-12-02), the last step of the smaller rank, all placeholders,
        # at 0 on both sides.
        assert fed[rank]["weight"] == manifest.weight == weights[rank]
        for step, products in enumerate(losses):
            trls = sum(f["loss"] for f in fed[rank]["fed"] if f["step"] == step)
            assert abs(trls - weights[rank] * products[rank]) <= 1e-5, (rank, step, trls)


# --- The selection in the run's trackers -------------------------------------------------------


@pytest.mark.slow  # about 30 s: MLflow creates its SQLite store
def test_the_selection_reaches_the_runs_trackers_and_the_checkpoints_config(
    tmp_path, tiny_tokenizer, monkeypatch, recwarn
):
    """A tiny Trainer run with report_to="mlflow" (transformers' own MLflowCallback): the
    selection's facts as the run's params, its dataset input with the manifest set's digest,
    and in the saved checkpoint's config.json."""
    from mlflow import MlflowClient
    from transformers import AutoConfig, DataCollatorForSeq2Seq, Trainer, TrainingArguments

    from cluster_pipeline.integrations.hf_trainer import SelectionCallback

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "selection")
    out, _, _ = _export(tmp_path, 12, [5], [1.25])
    shards = ClusterShards.from_export(out)
    record = json.loads((out / "export.json").read_text())
    facts = record["selection"]
    data = shards.dataset(0, tiny_tokenizer, SequenceSettings(max_length=64))
    trainer = _trainer(
        tmp_path, tiny_tokenizer, shards, data, collator=None, max_steps=1, report_to="mlflow"
    )
    trainer.train()
    trainer.save_model(str(tmp_path / "tuned"))

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("selection")
    assert experiment is not None
    [run] = client.search_runs([experiment.experiment_id])
    params = run.data.params
    assert params["cluster_selection.manifest_set_sha256"] == "ab" * 32
    assert params["cluster_selection.dataset"] == "hand"
    assert params["cluster_selection.selector"] == facts["selector"] == "peripheral"
    assert params["cluster_selection.rank_weight"] == "1.25"
    assert params["cluster_selection.rank_manifest"] == shards.ranks[0].sha256
    assert json.loads(params["cluster_selection.rank_weights"]) == [1.25]
    assert run.inputs is not None
    [given] = run.inputs.dataset_inputs
    assert given.dataset.digest == ("ab" * 32)[:32]
    assert given.dataset.name == "hand selection (peripheral)"
    assert {t.key: t.value for t in given.tags}["mlflow.data.context"] == "training"
    assert run.data.tags["cluster_selection.manifest_set_sha256"] == "ab" * 32
    # The checkpoint's config.json says what it was tuned on.
    saved = AutoConfig.from_pretrained(tmp_path / "tuned").to_dict()
    assert saved["cluster_selection.manifest_set_sha256"] == "ab" * 32
    assert saved["cluster_selection.rank"] == 0

    # A trainer of another kind (here transformers' own) gets the same with the callback.
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "plain")
    args = TrainingArguments(str(tmp_path / "plain"), max_steps=1, report_to="mlflow", use_cpu=True)
    plain = Trainer(
        model=build_model(len(tiny_tokenizer), pad_token_id=tiny_tokenizer.pad_token_id),
        args=args,
        train_dataset=data.remove_columns("sample_id").select(range(2)),
        processing_class=tiny_tokenizer,
        data_collator=DataCollatorForSeq2Seq(tiny_tokenizer),
        callbacks=[SelectionCallback.from_export(out)],
    )
    plain.train()
    experiment = client.get_experiment_by_name("plain")
    assert experiment is not None
    [run] = client.search_runs([experiment.experiment_id])
    assert run.data.params["cluster_selection.manifest_set_sha256"] == "ab" * 32
    assert "cluster_selection.rank" not in run.data.params  # the whole selection, no rank
    assert run.inputs is not None
    assert run.inputs.dataset_inputs[0].dataset.digest == ("ab" * 32)[:32]
    # Without MLflow's warning that a local path "can be interpreted in multiple ways".
    assert [str(w.message) for w in recwarn if "multiple ways" in str(w.message)] == []


@pytest.mark.slow  # TRL's import and two trainers: about 20 s
def test_trls_padding_free_batches_give_the_padded_batches_weighted_loss(tmp_path, tiny_tokenizer):
    """docs/guide/your-own-trainer.md: ``SFTConfig(..., padding_free=True, max_length=None)``
    feeds the same samples as one flattened row and gives the padded micro-batch's weighted
    loss; with a ``max_length`` TRL refuses it, the condition the guide states."""
    import torch
    from trl.trainer.sft_config import SFTConfig
    from trl.trainer.sft_trainer import SFTTrainer

    from cluster_pipeline.integrations.hf_trainer import ClusterTrainer

    class ClusterSFTTrainer(ClusterTrainer, SFTTrainer):
        """The guide's class."""

    rows = _rows(tmp_path, 12)
    shards = _shards(rows, [5], [1.25])
    data = shards.dataset(0, tiny_tokenizer, SequenceSettings(max_length=64))

    def trainer(**given) -> ClusterSFTTrainer:
        args = SFTConfig(
            str(tmp_path / "out"),
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            num_train_epochs=1,
            average_tokens_across_devices=False,
            bf16=False,
            use_cpu=True,
            report_to="none",
            **given,
        )
        model = build_model(len(tiny_tokenizer), pad_token_id=tiny_tokenizer.pad_token_id)
        return ClusterSFTTrainer(
            model, args=args, train_dataset=data, processing_class=tiny_tokenizer, shards=shards
        )

    with pytest.raises(ValueError, match="max_length"):
        trainer(padding_free=True)  # TRL's default max_length=1024 with padding_free
    padded, flat = trainer(), trainer(padding_free=True, max_length=None)
    first_padded = next(iter(padded.get_train_dataloader()))
    first_flat = next(iter(flat.get_train_dataloader()))
    # The same samples in the same order: the padded rows without padding, end to end.
    mask = first_padded["attention_mask"].bool()
    unpadded = [ids[m].tolist() for ids, m in zip(first_padded["input_ids"], mask, strict=True)]
    assert first_flat["input_ids"].shape[0] == 1
    assert first_flat["input_ids"][0].tolist() == [t for row in unpadded for t in row]
    # position_ids restart at each sample, so each attends to itself alone.
    starts = [0, *torch.cumsum(torch.tensor([len(r) for r in unpadded]), 0).tolist()[:-1]]
    assert [i for i, p in enumerate(first_flat["position_ids"][0].tolist()) if p == 0] == starts

    # The step's target count, as the Trainer hands it to compute_loss.
    targets = torch.tensor(int((first_padded["labels"][:, 1:] != -100).sum()))
    assert int((first_flat["labels"] != -100).sum()) == int((first_padded["labels"] != -100).sum())
    losses = []
    for t, batch in ((padded, first_padded), (flat, first_flat)):
        model = t.model
        assert isinstance(model, torch.nn.Module)
        model.train()
        loss = t.compute_loss(model, dict(batch), num_items_in_batch=targets)
        assert isinstance(loss, torch.Tensor)
        losses.append(float(loss.detach()))
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    # And the weight: 1.25 times the model's own sum of cross-entropies over the targets.
    model = padded.model
    assert isinstance(model, torch.nn.Module)
    plain = float(model(**first_padded, num_items_in_batch=targets).loss.detach())
    assert losses[0] == pytest.approx(1.25 * plain, rel=1e-5)

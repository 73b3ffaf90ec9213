"""A full disk, on a small tmpfs of the test's own: every large write checks the free space
first and names the folder, the bytes it needs and the bytes free; a write that runs out anyway
says the same; what was there before stays readable (issue 43: ``unexpected pos 65792 vs
65684`` and ``rank_0 failed first: (no message)``).

The kind, "a large write": a Delta commit (vectors, checked first; text, which runs out while
writing), the embedding cache's append, a checkpoint (its tensors' size known), FSDP2's sharded
checkpoint (every rank's shards, checked together), torch's own
short write, a launch whose ranks could not even write their error, an export (refused
before writing, or out of room while writing), and the built-in model's converted copy. The
ranks' own reports are tested in launch/test_full_disk_ranks.py."""

import json
import os
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
from deltalake import DeltaTable

from cluster_pipeline.launch.torchrun import failure_summary, rank_failures
from cluster_pipeline.storage.disk import (
    DiskFull,
    format_bytes,
    free_bytes,
    full_disk_note,
    naming_full_disk,
    require_space,
)
from cluster_pipeline.storage.embedding_cache import (
    CACHE_TABLE,
    CHUNK_SCHEMA,
    chunk_path,
    read_cached,
    store_pass,
)
from cluster_pipeline.storage.tables import write_table
from cluster_pipeline.training.checkpointing import (
    CHECKPOINT_OVERHEAD_BYTES,
    read_checkpoint,
    save_checkpoint,
)
from cluster_pipeline_tests.storage.disks import small_disk

MIB = 2**20
ADVICE = (
    " are free there. Free space on that disk (or set CLUSTER_PIPELINE_DATA_DIR to a folder on "
    "a larger one) and run again; what was written before is untouched"
)


def test_bytes_are_given_in_both_forms():
    assert format_bytes(999) == "999 bytes"
    assert format_bytes(1_600_000_000) == "1.60 GB (1,600,000,000 bytes)"
    assert format_bytes(1_048_576) == "1.05 MB (1,048,576 bytes)"


def test_a_write_larger_than_the_free_space_is_refused_before_it_starts(tmp_path):
    with small_disk(tmp_path / "disk", MIB) as disk:
        assert free_bytes(disk / "not" / "yet") == MIB  # a folder still to be made: its disk
        require_space(disk, MIB, "fits exactly")
        with pytest.raises(DiskFull) as e:
            require_space(disk / "sub", 2_000_000, "write a thing")
        assert str(e.value) == (
            f"write a thing: the disk holding {disk / 'sub'} is full: this write needs 2.00 MB "
            "(2,000,000 bytes) and 1.05 MB (1,048,576 bytes)" + ADVICE
        )
        assert e.value.errno == 28 and (e.value.needed, e.value.free) == (2_000_000, MIB)
        assert list(disk.iterdir()) == []


def _vectors(n: int, d: int) -> pl.DataFrame:
    rows = np.ones((n, d), dtype=np.float32)
    return pl.DataFrame({"sample_id": [f"s{i}" for i in range(n)]}).with_columns(
        pl.Series("v", rows).cast(pl.List(pl.Float32))
    )


def test_a_delta_commit_on_a_full_disk_leaves_the_earlier_version(tmp_path):
    with small_disk(tmp_path / "disk", MIB) as disk:
        uri = disk / "tables" / "t"
        first = write_table(pl.DataFrame({"a": ["x"] * 10}), uri)
        free = free_bytes(disk)
        # Vectors: their size is known, refused before anything is written.
        big = _vectors(300, 1024)
        needed = int(big.select("v").estimated_size())
        with pytest.raises(DiskFull) as e:
            write_table(big, uri)
        assert str(e.value) == (
            f"commit a new version of the Delta table {uri}: the disk holding {uri} is full: "
            f"this write needs {format_bytes(needed)} and {format_bytes(free)}" + ADVICE
        )
        # Text (no size known before it is compressed): it runs out while writing.
        text = pl.DataFrame({"a": [os.urandom(500).hex() for _ in range(2000)]})
        with pytest.raises(DiskFull) as e:
            write_table(text, uri)
        assert str(e.value).startswith(
            f"commit a new version of the Delta table {uri}: the disk holding {uri} is full: "
            f"this write needs {format_bytes(int(text.estimated_size()))} and "
        )
        assert "No space left on device" in str(e.value.__cause__)
        assert DeltaTable(str(uri)).version() == first.version == 0
        assert first.read()["a"].to_list() == ["x"] * 10


def _chunks(folder: Path, n: int, d: int, start: int = 0) -> list[str]:
    ids = [f"s{start + i}" for i in range(n)]
    vectors = [[0.5] * d] * n
    frame = pl.DataFrame(
        {
            "sample_id": ids,
            "n_tokens": [10] * n,
            "n_response_tokens": [4] * n,
            "truncated": [False] * n,
            "truncation": [None] * n,
            "skip_reason": [None] * n,
            "mean_loss": [1.0] * n,
            "embedding": vectors,
            "hidden_mean": vectors,
        },
        schema=CHUNK_SCHEMA,
    )
    folder.mkdir(parents=True, exist_ok=True)
    frame.write_parquet(chunk_path(folder, 0))
    (folder / "pass_stats.json").write_text(json.dumps({"samples": n, "seconds": 1.0}))
    return ids


def test_the_embedding_cache_append_on_a_full_disk_keeps_the_cache(tmp_path):
    with small_disk(tmp_path / "disk", MIB) as disk:
        cache = disk / "cache"
        small = _chunks(tmp_path / "pass0", 4, 8)
        store_pass(cache, tmp_path / "pass0", small, chunk_size=4)
        big = _chunks(tmp_path / "pass1", 300, 1024, start=4)
        needed = int(pl.read_parquet(chunk_path(tmp_path / "pass1", 0)).estimated_size())
        free = free_bytes(cache)
        with pytest.raises(DiskFull) as e:
            store_pass(cache, tmp_path / "pass1", big, chunk_size=300)
        assert str(e.value) == (
            f"add the embedding pass to the cache {cache / CACHE_TABLE}: the disk holding "
            f"{cache} is full: this write needs {format_bytes(needed)} and "
            f"{format_bytes(free)}" + ADVICE
        )
        assert read_cached(cache, small)["sample_id"].to_list() == small
        assert (tmp_path / "pass1").is_dir()  # the pass's chunks are kept for the next try


def test_a_checkpoint_that_does_not_fit_leaves_the_earlier_one(
    tmp_path, tiny_model, tiny_tokenizer
):
    with small_disk(tmp_path / "disk", 40 * MIB) as disk:
        out = disk / "checkpoints" / "run"
        save_checkpoint(tiny_model, tiny_tokenizer, out, {"step": 1})
        # What save_pretrained writes: each parameter once (tied ones share a tensor).
        params = sum(p.numel() * p.element_size() for p in tiny_model.parameters())
        needed = params + CHECKPOINT_OVERHEAD_BYTES
        filler = disk / "filler"
        filler.write_bytes(b"\0" * (free_bytes(disk) - 10 * MIB))
        free = free_bytes(disk)
        with pytest.raises(DiskFull) as e:
            save_checkpoint(tiny_model, tiny_tokenizer, out, {"step": 2})
        assert str(e.value) == (
            f"save the checkpoint {out}: the disk holding {out.parent} is full: this write "
            f"needs {format_bytes(needed)} and {format_bytes(free)}" + ADVICE
        )
        earlier = read_checkpoint(out)
        assert earlier is not None and earlier.info == {"step": 1}
        assert sorted(p.name for p in out.parent.iterdir()) == ["run"]  # no temporary left


def test_torchs_short_write_is_named_as_a_full_disk(tmp_path):
    with small_disk(tmp_path / "disk", MIB) as disk:
        with pytest.raises(DiskFull) as e, naming_full_disk(disk, None, "save x.pt"):
            torch.save(torch.zeros(400_000), disk / "x.pt")
        assert str(e.value).startswith(f"save x.pt: the disk holding {disk} is full: ")
        assert str(e.value).endswith(ADVICE)
        assert "unexpected pos" in str(e.value.__cause__)  # what users saw before (issue 43)
        # Any other error passes through as it is.
        with pytest.raises(ValueError, match="not a disk"), naming_full_disk(disk, 1, "w"):
            raise ValueError("not a disk")


def test_a_launch_whose_ranks_could_not_write_names_the_full_disk(tmp_path):
    with small_disk(tmp_path / "disk", MIB) as disk:
        logs = disk / "job.json.logs"
        rank = logs / "run" / "attempt_0" / "0"
        rank.mkdir(parents=True)
        (rank / "error.json").write_text("")  # cut short: no room for the rank's error
        (disk / "filler").write_bytes(b"\0" * (free_bytes(disk) - 8192))
        free = free_bytes(disk)
        assert failure_summary(rank_failures(logs)) == "rank_0 failed first: (no message)"
        assert full_disk_note([logs, disk]) == (
            f"the disk holding {logs} is full ({format_bytes(free)} free)"
        )
        # A rank whose error file is empty but whose output holds the error: its output.
        (rank / "stderr.log").write_text("OSError: [Errno 28] No space left on device\n")
        assert failure_summary(rank_failures(logs)) == (
            "rank_0 failed first: OSError: [Errno 28] No space left on device"
        )
    assert full_disk_note([tmp_path]) is None  # a disk with room says nothing


def _leave_free(disk: Path, free: int) -> None:
    """Fill ``disk`` (a tmpfs) with a file so that about ``free`` bytes stay free (pages)."""
    (disk / "filler").write_bytes(b"\0" * max(0, free_bytes(disk) - free))


def test_an_export_on_a_full_disk_is_named_and_the_earlier_export_reads_back(tmp_path):
    """Both ways an export meets a full disk, each after an earlier export in the same --out:
    refused before writing (less free than the rows' size), and out of room while writing
    (room for the rows, not for the card, parquet files and Arrow files together)."""
    from cluster_pipeline.integrations.hf_datasets import ExportError, export_selection
    from cluster_pipeline_tests.integrations.test_hf_datasets import (
        _assert_reads_back,
        _hand_made,
        _snapshot,
    )

    a, manifests_a = _hand_made(tmp_path / "a", order=1)
    b, _ = _hand_made(tmp_path / "b", order=-1)
    raw_b = tmp_path / "b" / "data" / "raw"
    with small_disk(tmp_path / "disk", 4 * MIB) as disk:
        out = disk / "export"
        export_selection(a, out, tmp_path / "a" / "data" / "raw")
        before = _snapshot(out)
        # 1. Less free than the rows' size: refused before anything is written.
        _leave_free(disk, 4096)
        free = free_bytes(disk)
        with pytest.raises(ExportError) as e:
            export_selection(b, out, raw_b, overwrite=True)
        head = f"export dataset 'hand' to --out {out}: the disk holding {disk} is full: "
        message = str(e.value)
        assert message.startswith(head + "this write needs "), message
        needs, rest = message.removeprefix(head + "this write needs ").split(" and ", 1)
        needed = int(needs.split("(")[1].split(" bytes")[0].replace(",", ""))
        assert needs == format_bytes(needed) and needed > free
        assert rest == f"{format_bytes(free)}" + ADVICE
        assert _snapshot(out) == before
        assert sorted(p.name for p in disk.iterdir()) == ["export", "filler"]
        # 2. Room for the rows (the check passes), not for everything the export writes.
        (disk / "filler").unlink()
        _leave_free(disk, needed + 8192)
        with pytest.raises(ExportError) as e:
            export_selection(b, out, raw_b, overwrite=True)
        message = str(e.value)
        assert message.startswith(
            f"writing the export to --out {out} failed ([Errno 28] No space left on device"
        ), message
        assert message.endswith(
            f"; the export needs at least {format_bytes(needed)} on the disk holding {disk}, "
            f"{format_bytes(free_bytes(disk))} are free there); the folder is as it was. Free "
            "space or fix the cause, then export again, or choose another --out"
        ), message
        assert _snapshot(out) == before
        assert sorted(p.name for p in disk.iterdir()) == ["export", "filler"]
        _assert_reads_back(out, manifests_a, tmp_path / "cache")


def test_the_built_in_models_conversion_checks_its_room_first(tmp_path, tiny_model, tiny_tokenizer):
    """The built-in model's safetensors copy (written once, from its GGUF file): refused before
    writing where its tensors and files do not fit, written where they do."""
    from transformers import AutoModelForCausalLM

    from cluster_pipeline.models.loading import MODEL_FOLDER_OVERHEAD, save_model_folder

    # Each parameter once (tied ones share a tensor), and the files beside them.
    needed = sum(p.numel() * p.element_size() for p in tiny_model.parameters())
    needed += MODEL_FOLDER_OVERHEAD
    with small_disk(tmp_path / "small", 8 * MIB) as disk:
        out = disk / "models" / "smollm2-135m-instruct"
        free = free_bytes(disk)
        with pytest.raises(DiskFull) as e:
            save_model_folder(tiny_model, tiny_tokenizer, out, "convert m.gguf")
        assert str(e.value) == (
            f"convert m.gguf: the disk holding {out.parent} is full: this write needs "
            f"{format_bytes(needed)} and {format_bytes(free)}" + ADVICE
        )
        assert list(out.parent.iterdir()) == []
    with small_disk(tmp_path / "large", 32 * MIB) as disk:
        out = disk / "models" / "smollm2-135m-instruct"
        save_model_folder(tiny_model, tiny_tokenizer, out, "convert m.gguf")
        assert AutoModelForCausalLM.from_pretrained(out).num_parameters() == (
            tiny_model.num_parameters()
        )


def test_an_fsdp_sharded_checkpoint_checks_every_ranks_shards_first(
    tmp_path, tiny_tokenizer, monkeypatch
):
    """FSDP2's resumable checkpoint (``torch.distributed.checkpoint``: every rank writes its
    shards) is the same kind of large write: refused before any rank writes, naming the bytes of
    every rank's shards (here one rank, so its whole state: the parameters, AdamW's two moments
    of each and its step counters) and the least free space any rank sees."""
    import socket

    import torch.distributed as dist

    from cluster_pipeline.training.checkpointing import save_sharded
    from cluster_pipeline_tests.helpers import build_model

    with socket.socket() as sock:  # a free port for this process's one-rank group
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        from torch.distributed.fsdp import fully_shard

        model = build_model(len(tiny_tokenizer))
        params = list(model.parameters())
        param_bytes = sum(p.numel() * p.element_size() for p in params)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        out = model(input_ids=torch.tensor([[1, 2, 3, 4]]), labels=torch.tensor([[1, 2, 3, 4]]))
        out.loss.backward()
        optimizer.step()
        # Each parameter, its exp_avg and exp_avg_sq (float32, its shape), its step (one float32).
        needed = 3 * param_bytes + 4 * len(params) + CHECKPOINT_OVERHEAD_BYTES
        with small_disk(tmp_path / "disk", 20 * MIB) as disk:
            fits = disk / "step_1" / "sharded"
            save_sharded(model, optimizer, fits)
            assert any(fits.iterdir())
            filler = disk / "filler"
            filler.write_bytes(b"\0" * (free_bytes(disk) - 16 * MIB))
            free = free_bytes(disk)
            target = disk / "step_2" / "sharded"
            with pytest.raises(DiskFull) as e:
                save_sharded(model, optimizer, target)
            assert str(e.value) == (
                f"save the sharded checkpoint {target}: the disk holding {target.parent} is "
                f"full: this write needs {format_bytes(needed)} and {format_bytes(free)}" + ADVICE
            )
            assert not (disk / "step_2").exists()  # nothing written
    finally:
        dist.destroy_process_group()

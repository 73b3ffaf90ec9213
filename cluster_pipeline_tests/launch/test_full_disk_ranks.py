"""What torchrun ranks report on a full disk, through the launcher a stage uses (issue 43: the
embedding pass failed with ``rank_0 failed first: (no message)`` and training with ``unexpected
pos 65792 vs 65684``).

The kind, "a rank's write that does not fit": an embedding chunk, the pass's progress counts
(written before any chunk), a training checkpoint, and a launch whose own log folder is on the
full disk (no rank can write its error)."""

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import polars as pl
import pytest

from cluster_pipeline.launch.base import LaunchSpec
from cluster_pipeline.launch.local import Standalone
from cluster_pipeline.launch.torchrun import RECIPES
from cluster_pipeline.storage.disk import free_bytes
from cluster_pipeline.storage.embedding_cache import write_pass_ids
from cluster_pipeline.training.config import EmbedJob, EmbedSettings
from cluster_pipeline_tests.helpers import instructions_table, tiny_records, train_job
from cluster_pipeline_tests.storage.disks import small_disk

pytestmark = pytest.mark.slow

ADVICE = (
    " are free there. Free space on that disk (or set CLUSTER_PIPELINE_DATA_DIR to a folder on "
    "a larger one) and run again; what was written before is untouched"
)


def _launch(module: str, job_file: Path) -> str:
    """The cause of a failed one-rank launch of ``module`` (the launcher the stages use)."""
    launcher, spec = Standalone(), LaunchSpec(module, 1, job_file)
    env = {k: v for k, v in os.environ.items() if k != "CLUSTER_PIPELINE_RUN_GUARD"}
    outcome = launcher.run(spec, launcher.prepare(spec), env, print)
    assert outcome.failure is not None
    return outcome.failure.cause


def _fill(disk: Path, leave: int) -> None:
    (disk / "filler").write_bytes(b"\0" * max(0, free_bytes(disk) - leave))


def _embed_job(tmp_path: Path, model_dir: Path, chunk_dir: Path, job_dir: Path) -> Path:
    table = instructions_table(tmp_path / "raw", tiny_records(16))
    ids = pl.read_delta(table.uri)["sample_id"].to_list()
    ids_file = write_pass_ids(tmp_path / "ids", ids)
    job = EmbedJob(
        settings=EmbedSettings(max_length=64, chunk_size=16),
        model_path=str(model_dir),
        instructions_uri=table.uri,
        instructions_version=table.version,
        chunk_dir=str(chunk_dir),
        sample_ids_file=str(ids_file),
    )
    job_dir.mkdir(parents=True, exist_ok=True)
    return job.dump(job_dir / "embed_job.json")


@contextmanager
def _embed_on_a_full_disk(
    tmp_path: Path, model_dir: Path, leave: int
) -> Iterator[tuple[Path, str]]:
    """One embedding rank whose chunk folder is on a 1 MiB tmpfs with ``leave`` bytes free:
    the chunk folder (still mounted inside the block) and the launch's failure cause."""
    with small_disk(tmp_path / "disk", 1 << 20) as disk:
        chunks = disk / "pass"
        chunks.mkdir()
        job = _embed_job(tmp_path, model_dir, chunks, tmp_path / "job")
        _fill(disk, leave)
        yield chunks, _launch(RECIPES["embed"], job)


def test_an_embedding_rank_names_the_full_disk(tmp_path, tiny_model_dir):
    with _embed_on_a_full_disk(tmp_path, tiny_model_dir, 4096) as (chunks, cause):
        target = chunks / "chunk_000000.parquet"
        assert cause.startswith(
            f"rank_0 failed first: DiskFull: write embedding chunk {target}: the disk holding "
            f"{chunks} is full: this write needs "
        ), cause
        assert cause.endswith(ADVICE), cause
        # No torn chunk left behind (the ranks' progress counts may be there).
        assert [p.name for p in chunks.glob("chunk_*")] == []


def test_an_embedding_rank_names_the_full_disk_at_its_progress_counts(tmp_path, tiny_model_dir):
    # The first batch writes the rank's progress counts (tens of bytes) before any chunk: with
    # no byte free, that write is the one that fails, and it is named like a chunk's.
    with _embed_on_a_full_disk(tmp_path, tiny_model_dir, 0) as (chunks, cause):
        progress = chunks / "progress_rank0.json"
        assert cause.startswith(
            f"rank_0 failed first: DiskFull: write the pass's progress {progress}: the disk "
            f"holding {chunks} is full: 0 bytes are free there."
        ), cause
        assert cause.endswith(ADVICE), cause
        assert sorted(p.name for p in chunks.iterdir()) == []  # no torn file


def test_a_launch_whose_logs_are_on_the_full_disk_names_it(tmp_path, tiny_model_dir):
    with small_disk(tmp_path / "disk", 1 << 20) as disk:
        job = _embed_job(tmp_path, tiny_model_dir, disk / "pass", disk)
        _fill(disk, 0)
        cause = _launch(RECIPES["embed"], job)
        logs = Path(f"{job}.logs")
        assert f"(the disk holding {logs} is full (" in cause, cause


def test_a_training_rank_names_the_full_disk_not_unexpected_pos(tmp_path, tiny_model_dir):
    with small_disk(tmp_path / "disk", 8 << 20) as disk:
        cfg, _ = train_job(tmp_path, tiny_model_dir, [1.0], per_rank=4, per_device_batch_size=2)
        out = disk / "ckpt"
        cfg = cfg.model_copy(update={"output_dir": str(out)})
        job = cfg.dump(tmp_path / "train_full.json")
        cause = _launch(RECIPES["train"], job)
        assert cause.startswith(
            f"rank_0 failed first: DiskFull: save the checkpoint {out}: the disk holding {disk} "
            "is full: this write needs "
        ), cause
        assert "unexpected pos" not in cause
        assert sorted(p.name for p in disk.iterdir()) == ["ckpt.metrics.jsonl"]

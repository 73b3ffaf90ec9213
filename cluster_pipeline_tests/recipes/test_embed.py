"""The torchrun embedding pass: the same result on 1 or 2 ranks, and resume after a kill."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from cluster_pipeline.data.datasets import read_train_split
from cluster_pipeline.storage.embedding_cache import chunk_path, gather_chunks
from cluster_pipeline.storage.tables import series_to_matrix
from cluster_pipeline.training.config import EmbedJob, EmbedSettings
from cluster_pipeline_tests.helpers import instructions_table, tiny_records, torchrun

pytestmark = pytest.mark.slow


def _config(tmp_path, model_dir, table, name, **kw) -> tuple[EmbedJob, str]:
    job = EmbedJob(
        settings=EmbedSettings(max_length=64, **kw),
        model_path=str(model_dir),
        instructions_uri=table.uri,
        instructions_version=table.version,
        chunk_dir=str(tmp_path / name),
    )
    path = tmp_path / f"{name}.json"
    job.dump(path)
    return job, str(path)


def _matrix(job, ids):
    frame = gather_chunks(Path(job.chunk_dir), ids, job.settings.chunk_size)
    ok = frame.filter(frame["skip_reason"].is_null())
    return frame, series_to_matrix(ok["embedding"])


def test_one_and_two_ranks_give_the_same_table(tmp_path, tiny_model_dir):
    table = instructions_table(tmp_path / "raw", tiny_records(40))
    ids = read_train_split(table.uri, table.version)["sample_id"].to_list()
    one, one_path = _config(tmp_path, tiny_model_dir, table, "w1", chunk_size=7)
    two, two_path = _config(tmp_path, tiny_model_dir, table, "w2", chunk_size=7)
    for path, nproc in ((one_path, 1), (two_path, 2)):
        done = torchrun("cluster_pipeline.recipes.embed", nproc, ["--config", path])
        assert done.returncode == 0, done.stderr[-3000:]
    f1, m1 = _matrix(one, ids)
    f2, m2 = _matrix(two, ids)
    assert f1["sample_id"].to_list() == f2["sample_id"].to_list() == ids
    np.testing.assert_allclose(m1, m2, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(f1["mean_loss"].to_numpy(), f2["mean_loss"].to_numpy(), rtol=1e-5)


def test_a_killed_run_resumes_with_only_the_missing_chunks(tmp_path, tiny_model_dir):
    # 60 chunks of 2: the kill lands after chunk 3 with dozens still to go.
    table = instructions_table(tmp_path / "raw", tiny_records(120))
    ids = read_train_split(table.uri, table.version)["sample_id"].to_list()
    ref, ref_path = _config(tmp_path, tiny_model_dir, table, "ref", chunk_size=2, max_batch_size=1)
    cut, cut_path = _config(tmp_path, tiny_model_dir, table, "cut", chunk_size=2, max_batch_size=1)
    assert torchrun("cluster_pipeline.recipes.embed", 1, ["--config", ref_path]).returncode == 0

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=1",
        "-m",
        "cluster_pipeline.recipes.embed",
        "--config",
        cut_path,
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    n_chunks = -(-len(ids) // 2)
    deadline = time.time() + 120
    while time.time() < deadline and not chunk_path(tmp_path / "cut", 3).exists():
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its rank, mid-pass
    proc.wait()
    done_before = {i for i in range(n_chunks) if chunk_path(tmp_path / "cut", i).exists()}
    assert 4 <= len(done_before) < n_chunks, "the kill must land mid-pass"
    mtimes = {i: chunk_path(tmp_path / "cut", i).stat().st_mtime_ns for i in done_before}

    again = torchrun("cluster_pipeline.recipes.embed", 1, ["--config", cut_path])
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"{len(done_before)} chunk(s) already done" in again.stdout
    # Chunks finished before the kill were not recomputed.
    assert all(chunk_path(tmp_path / "cut", i).stat().st_mtime_ns == t for i, t in mtimes.items())
    f_ref, m_ref = _matrix(ref, ids)
    f_cut, m_cut = _matrix(cut, ids)
    assert f_cut["sample_id"].to_list() == ids
    np.testing.assert_allclose(m_cut, m_ref, rtol=1e-6, atol=1e-8)
    assert not list((tmp_path / "cut").glob(".chunk_*.tmp-*"))  # no half-written chunk left


class _Capture:
    """A Reporter of rank 0 that keeps the warnings it is given."""

    def __init__(self):
        self.warnings: list[str] = []

    def info(self, message: str) -> None:
        pass

    def doing(self, what: str, say: bool = True) -> None:
        pass

    def warning(self, message: str) -> None:
        self.warnings.append(message)


@pytest.mark.parametrize("refused", [False, True])
def test_the_pass_records_whether_it_packed_and_why_not(
    tmp_path, tiny_model_dir, monkeypatch, refused
):
    """A pass whose model the packing gate refuses embeds with padded batches, and says so in
    its figures (``packed: false`` and the refusal in ``warnings``, which proxy_embeddings'
    metadata shows), not only in the log (issue 39: a bf16-held model failed the gate silently).
    The gate's verdict is given here (its own tests: data/test_packing.py); the pass is real."""
    from cluster_pipeline.data.packing import PackCheck
    from cluster_pipeline.storage.embedding_cache import read_pass_stats
    from cluster_pipeline.training import embedding_pass
    from cluster_pipeline.training.distributed import DistEnv

    if refused:
        verdict = PackCheck(False, 0.134, 0.0253, 0.244, 0.0982, "torch.bfloat16", 0.389)
        monkeypatch.setattr(embedding_pass, "pack_check_cached", lambda model: verdict)
    table = instructions_table(tmp_path / "raw", tiny_records(8))
    job, _ = _config(tmp_path, tiny_model_dir, table, "pass")
    report = _Capture()
    embedding_pass.run_pass(job, DistEnv(0, 0, 1), report)  # pyright: ignore[reportArgumentType]
    stats = read_pass_stats(Path(job.chunk_dir))
    want = (
        "LlamaForCausalLM attends across packed samples: a sample's logits moved by 0.134 when "
        "the sample before it in the row changed (bound 0.0253 for torch.bfloat16) "
        "(data/packing.pack_check): embedding with padded batches"
    )
    assert stats["packed"] is (not refused)
    assert stats["warnings"] == ([want] if refused else [])
    assert report.warnings == stats["warnings"]

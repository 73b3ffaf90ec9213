"""Issue 43's full disk, before any rank starts: ``trained_checkpoint`` knows its checkpoint's
size from the model's files (4 bytes a parameter, plus the next resumable checkpoint's
4 P + 8 T when ``save_every_steps`` is set, each with 16 MiB for the tokenizer and headers) and
refuses a data folder whose disk cannot hold it, naming the folder and both byte counts, with
nothing launched and the selection's tables readable. The ranks' own reports of a disk that runs
out while writing are tested in launch/test_full_disk_ranks.py, the check's parts in
storage/test_disk_full.py."""

import re
import shutil

import dagster as dg
import pytest
from safetensors import safe_open

from cluster_pipeline.storage.disk import format_bytes, free_bytes
from cluster_pipeline.storage.layout import DataLayout
from cluster_pipeline_tests.helpers import (
    materialize_partition,
    pipeline_assets,
    read,
    resources,
    run_config_for,
    seed_embeddings,
    step_failure,
)
from cluster_pipeline_tests.storage.disks import small_disk

pytestmark = pytest.mark.slow

ASSETS = pipeline_assets()
SELECTION, TRAINED = ASSETS[:5], ASSETS[5]
MIB = 2**20
OVERHEAD = 16 * MIB


def _parameters(model_dir) -> int:
    """The model's parameters, counted from its safetensors file's tensors."""
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return sum(_numel(f, k) for k in f.keys())


def _numel(f, key: str) -> int:
    n = 1
    for d in f.get_slice(key).get_shape():
        n *= d
    return n


@pytest.mark.parametrize("save_every_steps", [None, 1])
def test_training_that_cannot_fit_its_checkpoint_is_refused_before_any_rank_starts(
    tmp_path, tiny_data_dir, tiny_model_dir, tiny_embedding_cache, save_every_steps
):
    n = _parameters(tiny_model_dir)
    needed = 4 * n + OVERHEAD + (4 * n + 8 * n + OVERHEAD if save_every_steps else 0)
    with small_disk(tmp_path / "disk", 12 * MIB) as disk:
        data = disk / "data"
        shutil.copytree(tiny_data_dir, data)
        seed_embeddings(tiny_embedding_cache, data)
        res = resources(data, tiny_model_dir)
        with dg.instance_for_test() as instance:
            instance.add_dynamic_partitions("datasets", ["tiny"])
            assert materialize_partition(SELECTION, instance, res).success
            config = run_config_for(
                [TRAINED], trained_checkpoint={"save_every_steps": save_every_steps}
            )
            result = materialize_partition(
                [TRAINED], instance, res, run_config=config, raise_on_error=False
            )
            assert not result.success
            description, _ = step_failure(result)
            run_dir = DataLayout.at(data).checkpoints_dir("tiny")
            pattern = (
                rf"dataset 'tiny': train (\S+): the disk holding {re.escape(str(run_dir))} is "
                rf"full: this write needs {re.escape(format_bytes(needed))} and .+ are free "
                "there. Free space on that disk"
            )
            assert re.fullmatch(pattern + ".*", description, re.S), description
            # Nothing launched: no checkpoint, job file or rank log in the run folder.
            assert not run_dir.exists() or list(run_dir.iterdir()) == []
            # The selection stays readable.
            assert read(instance, "shard_manifests").height > 0


def test_an_embedding_pass_that_cannot_fit_its_chunks_is_refused_before_any_rank_starts(
    tmp_path, tiny_data_dir, tiny_model_dir
):
    """The pass's room: its chunks and their copy into the cache, two rows of two float32
    vectors of the model's width (32 here) and 64 bytes of scalars per sample to embed."""
    with small_disk(tmp_path / "disk", 12 * MIB) as disk:
        data = disk / "data"
        shutil.copytree(tiny_data_dir, data)
        res = resources(data, tiny_model_dir)
        with dg.instance_for_test() as instance:
            instance.add_dynamic_partitions("datasets", ["tiny"])
            assert materialize_partition(ASSETS[:1], instance, res).success
            raw = read(instance, "raw_instructions")
            n = raw.filter(raw["split"] == "train").height
            needed = 2 * n * (2 * 4 * 32 + 64)
            # Leave half of what the pass needs free.
            (disk / "filler").write_bytes(b"\0" * (free_bytes(disk) - needed // 2))
            result = materialize_partition(ASSETS[1:2], instance, res, raise_on_error=False)
            assert not result.success
            event = next(e for e in result.all_events if e.is_step_failure)
            error = event.step_failure_data.error
            assert error is not None
            message = error.message if error.cause is None else error.cause.message
            cache = DataLayout.at(data).embeddings_dir("tiny")
            pattern = (
                rf"DiskFull: embed {n} samples: the disk holding {re.escape(str(cache))}\S* is "
                rf"full: this write needs {re.escape(format_bytes(needed))} and "
            )
            assert re.search(pattern, message), message
            # No rank ran: no chunk (the pass folder holds only its list of samples to embed).
            assert not list(cache.rglob("chunk_*.parquet"))

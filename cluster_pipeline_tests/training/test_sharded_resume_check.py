import re
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict_saver import save

from cluster_pipeline.training.checkpointing import check_sharded_keys


def _saved(tmp_path: Path, keys: list[str]) -> Path:
    folder = tmp_path / "checkpoints" / "step_0000004" / "sharded"
    save({"model": {k: torch.zeros(2) for k in keys}}, checkpoint_id=str(folder))
    return folder


def test_a_sharded_checkpoint_holding_every_tensor_is_accepted(tmp_path):
    folder = _saved(tmp_path, ["model.layers.0.weight", "model.norm.weight"])
    check_sharded_keys(folder, {"model.layers.0.weight": 0, "model.norm.weight": 0})


def test_a_checkpoint_of_the_loop_before_the_loss_module_is_refused_with_what_to_do(tmp_path):
    # Written when the HF model itself was FSDP's root: its tensors lack the loss module's
    # "model." prefix, which the model's state dict now has.
    folder = _saved(tmp_path, ["layers.0.weight", "norm.weight"])
    wanted = {"model.layers.0.weight": 0, "model.norm.weight": 0}
    message = (
        f"{folder} does not hold this model's weights: 2 of 2 tensors are missing "
        "(e.g. 'model.model.layers.0.weight'); it was written for another model or by an "
        "earlier version of the training loop. Set resume: false to train from the start, or "
        f"move {tmp_path / 'checkpoints'} aside to keep it."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        check_sharded_keys(folder, wanted)

"""A user's TRL script, as docs/guide/your-own-trainer.md shows it, run by
test_hf_trainer.py under torchrun: ``SFTTrainer`` with the shards' sampler and weights, each
rank recording what its model was fed.

    torchrun --standalone --nproc_per_node=2 -m cluster_pipeline_tests.integrations.trl_sft \
        --data-dir DATA --dataset NAME --model MODEL --out OUT [--batch 2 ...]

Rank r writes ``OUT/rank_<r>.json``: per training micro-batch the global step it belongs to,
its rows' token ids without padding, and the loss ``compute_loss`` returned (weighted).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl.trainer.sft_config import SFTConfig
from trl.trainer.sft_trainer import SFTTrainer

from cluster_pipeline.data.tokenization import SequenceSettings
from cluster_pipeline.integrations.hf_trainer import ClusterShards, ClusterTrainer


class ClusterSFTTrainer(ClusterTrainer, SFTTrainer):
    """SFTTrainer fed by the shards."""


class Recording(ClusterSFTTrainer):
    """Records every training micro-batch the model receives."""

    fed: list[dict]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if model.training and isinstance(loss, torch.Tensor):
            mask = inputs["attention_mask"].bool()
            rows = [ids[m].tolist() for ids, m in zip(inputs["input_ids"], mask, strict=True)]
            step = self.state.global_step
            self.fed.append({"step": step, "rows": rows, "loss": float(loss.detach())})
        return loss


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", required=True)
    p.add_argument("--dataset", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--accumulation", type=int, default=2)
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=1)
    args = p.parse_args()
    torch.manual_seed(0)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    config = SFTConfig(
        args.out,
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.accumulation,
        average_tokens_across_devices=False,
        num_train_epochs=args.epochs,
        # As the product's trainer runs on CPU: float32, AdamW at a constant rate, clipping at 1.
        bf16=False,
        gradient_checkpointing=False,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        use_cpu=True,
    )
    # The lines docs/guide/your-own-trainer.md shows.
    shards = ClusterShards.from_data_dir(args.dataset, args.data_dir)  # its export
    rank = config.process_index
    train = shards.dataset(rank, tokenizer, SequenceSettings(max_length=args.max_length))
    trainer = Recording(
        model, args=config, train_dataset=train, processing_class=tokenizer, shards=shards
    )
    trainer.fed = []
    trainer.train()
    out = Path(args.out) / f"rank_{rank}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"weight": trainer.shard_weight, "fed": trainer.fed}))


if __name__ == "__main__":
    main()

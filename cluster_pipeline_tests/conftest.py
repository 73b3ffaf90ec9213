"""Shared fixtures: a tiny tokenizer and causal LM built offline, and tiny datasets."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
SHARED_DATASETS = Path(__file__).resolve().parents[1].parent / "shared" / "datasets"

_WORDS = (
    "add subtract multiply reverse sort list string number python function return value "
    "sum product word letters apple banana cherry dog cat bird tree river mountain code data "
    "write explain describe translate compute the a of and to in is for with"
).split()


def _corpus() -> list[str]:
    rng = random.Random(0)
    lines = [" ".join(rng.choice(_WORDS) for _ in range(12)) for _ in range(300)]
    lines += ["0123456789 +-*/=()[]{}:;,.!?'\"\n def return if else for while"] * 5
    return lines


def build_tokenizer(chat_template: str | None = CHATML, pad: str | None = "<pad>"):
    """A byte-level BPE tokenizer (vocab ~400) trained on a fixed corpus; no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>" if chat_template else "<|endoftext|>",
        bos_token="<|endoftext|>" if not chat_template else None,
        pad_token=pad,
    )
    if chat_template:
        fast.chat_template = chat_template
    return fast


def build_model(vocab_size: int, seed: int = 0, pad_token_id: int | None = None):
    """A 2-layer Llama with hidden size 32, random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=False, pad_token_id=pad_token_id,
    )
    model = LlamaForCausalLM(config)
    model.eval()
    return model


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def tiny_model(tiny_tokenizer):
    return build_model(len(tiny_tokenizer), pad_token_id=tiny_tokenizer.pad_token_id)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_model, tiny_tokenizer) -> Path:
    """The tiny model and tokenizer as a save_pretrained folder."""
    path = tmp_path_factory.mktemp("tiny_model")
    tiny_model.save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


def tiny_records(n: int = 60) -> list[dict]:
    """n Alpaca-form records on two topics (arithmetic, word reversal), all distinct."""
    rng = random.Random(1)
    out = []
    for i in range(n):
        if i % 2 == 0:
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            out.append({"instruction": f"Add {a} and {b}.", "input": "", "output": f"The sum is {a + b}."})
        else:
            word = rng.choice(_WORDS) + rng.choice(_WORDS)
            out.append({"instruction": "Reverse the letters of the word.", "input": f"{word} {i}",
                        "output": f"{word[::-1]} {i}"})
    return out


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture
def tiny_data_dir(tmp_path) -> Path:
    """A data folder with one dataset partition ``tiny`` of 60 samples."""
    data = tmp_path / "data"
    write_jsonl(data / "raw" / "tiny" / "samples.jsonl", tiny_records(60))
    return data


def instructions_table(path: Path, records: list[dict], heldout_fraction: float = 0.0):
    """A raw_instructions Delta table at ``path`` built from Alpaca records."""
    from cluster_pipeline.core.datasets import build_instruction_table
    from cluster_pipeline.core.formats import normalise_record
    from cluster_pipeline.core.tables import write_table

    samples = [normalise_record(r, "mem.jsonl", i + 1) for i, r in enumerate(records)]
    frame, _ = build_instruction_table(samples, heldout_fraction, None, None, seed=0)
    return write_table(frame, path)


def torchrun(module: str, nproc: int, args: list[str], **kwargs):
    """Launch ``module`` under torchrun --standalone and wait; returns CompletedProcess."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", "-m", module, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kwargs)

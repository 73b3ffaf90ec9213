"""Response masking through the chat template, truncation, padding and length batching."""

import pytest

from cluster_pipeline.core.tokenization import (
    IGNORE_INDEX,
    collate,
    encode_sample,
    length_batches,
)
from cluster_pipeline_tests.helpers import build_tokenizer


def _response_ids(sample):
    pairs = zip(sample.input_ids, sample.labels, strict=True)
    return [t for t, lab in pairs if lab != IGNORE_INDEX]


def test_chat_template_masks_exactly_the_assistant_turn(tiny_tokenizer):
    s = encode_sample(tiny_tokenizer, "Be brief.", "Add 3 and 4.", "The sum is 7.", 256)
    # The masked span decodes to the answer plus the template's end-of-turn marker.
    assert tiny_tokenizer.decode(_response_ids(s)) == "The sum is 7.<|im_end|>\n"
    prompt_part = [t for t, lab in zip(s.input_ids, s.labels, strict=True) if lab == IGNORE_INDEX]
    assert tiny_tokenizer.decode(prompt_part) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nAdd 3 and 4.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # Response tokens form one contiguous block at the end.
    first = s.labels.index(next(lab for lab in s.labels if lab != IGNORE_INDEX))
    assert all(lab != IGNORE_INDEX for lab in s.labels[first:])
    assert s.n_response_tokens == len(s.input_ids) - first


def test_without_chat_template_prompt_and_response_are_concatenated():
    tok = build_tokenizer(chat_template=None)
    s = encode_sample(tok, "", "Add 3 and 4.", "The sum is 7.", 256)
    assert s.input_ids[0] == tok.bos_token_id
    assert tok.decode(_response_ids(s)) == "The sum is 7.<|endoftext|>"
    assert s.input_ids[-1] == tok.eos_token_id


def test_truncation_keeps_the_prompt_start_and_cuts_the_response_end(tiny_tokenizer):
    full = encode_sample(tiny_tokenizer, "", "Add 3 and 4.", "word " * 50, 10_000)
    n_prompt = len(full) - full.n_response_tokens
    cut = encode_sample(tiny_tokenizer, "", "Add 3 and 4.", "word " * 50, n_prompt + 5)
    assert cut.truncated and cut.n_response_tokens == 5
    assert cut.input_ids == full.input_ids[: n_prompt + 5]
    assert cut.labels == full.labels[: n_prompt + 5]


def test_prompt_filling_max_length_leaves_no_response_tokens(tiny_tokenizer):
    s = encode_sample(tiny_tokenizer, "", "river " * 100, "yes", 20)
    assert s.skip_reason == "no_response_tokens" and s.n_response_tokens == 0
    assert len(s.input_ids) == 20


def test_empty_response_is_flagged(tiny_tokenizer):
    assert encode_sample(tiny_tokenizer, "", "hi", "  \n", 64).skip_reason == "empty_response"


@pytest.mark.parametrize("side", ["left", "right"])
def test_collate_pads_and_counts_positions_over_real_tokens(tiny_tokenizer, side):
    a = encode_sample(tiny_tokenizer, "", "hi", "yes", 64)
    b = encode_sample(tiny_tokenizer, "", "Add 3 and 4 and explain.", "The sum is 7.", 64)
    batch = collate([a, b], pad_token_id=-1, padding_side=side)
    width = max(len(a), len(b))
    assert batch["input_ids"].shape == (2, width)
    row = batch["attention_mask"][0].tolist()
    n_pad = width - len(a)
    assert row == ([1] * len(a) + [0] * n_pad if side == "right" else [0] * n_pad + [1] * len(a))
    real_positions = batch["position_ids"][0][batch["attention_mask"][0] == 1].tolist()
    assert real_positions == list(range(len(a)))
    assert (batch["labels"][0][batch["attention_mask"][0] == 0] == IGNORE_INDEX).all()


def test_length_batches_cover_every_index_once_and_respect_limits():
    lengths = [5, 100, 7, 6, 90, 3, 50, 51]
    batches = length_batches(lengths, max_batch_size=3, max_batch_tokens=160)
    flat = sorted(i for b in batches for i in b)
    assert flat == list(range(len(lengths)))
    for b in batches:
        assert len(b) <= 3
        assert len(b) == 1 or max(lengths[i] for i in b) * len(b) <= 160
    # Sorted by length: the first batch holds the three shortest.
    assert sorted(batches[0]) == [0, 3, 5]

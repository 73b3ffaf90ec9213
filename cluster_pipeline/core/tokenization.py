"""Turning a (system, prompt, response) sample into token ids and a response-only label mask.

The response is masked through the tokenizer's chat template when it has one: the prompt text is
the template rendered with ``add_generation_prompt=True``, the response text is what the full
conversation adds after it (the answer plus the template's end-of-turn marker). Without a chat
template, the prompt is ``prompt + "\\n"`` after the tokenizer's BOS and the response is
``response`` followed by EOS. Prompt and response are tokenized separately and concatenated, so
the label mask is exactly the response tokens.

Truncation to ``max_length`` keeps the start of the prompt and cuts the end of the response.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

IGNORE_INDEX = -100

SKIP_EMPTY_RESPONSE = "empty_response"
SKIP_NO_RESPONSE_TOKENS = "no_response_tokens"


class ChatTemplateError(ValueError):
    """The chat template renders the prompt in a way that is not a prefix of the conversation."""


@dataclass(frozen=True)
class EncodedSample:
    """Token ids of one sample. ``labels[i] == IGNORE_INDEX`` outside the response.

    ``skip_reason`` is set (and the sample must not be embedded or trained on) when no response
    token survives: ``"empty_response"`` or ``"no_response_tokens"`` (the prompt alone fills
    ``max_length``).
    """

    input_ids: list[int]
    labels: list[int]
    n_response_tokens: int
    truncated: bool
    skip_reason: str | None = None

    def __len__(self) -> int:
        return len(self.input_ids)


def render_texts(tokenizer, system: str, prompt: str, response: str) -> tuple[str, str]:
    """Split one conversation into (prompt text, response text) as the model sees them.

    Raises:
        ChatTemplateError: the template's generation prompt is not a prefix of the rendered
            conversation, so the response cannot be masked exactly.
    """
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": prompt})
        prompt_text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        full_text = tokenizer.apply_chat_template(
            [*messages, {"role": "assistant", "content": response}], tokenize=False
        )
        if not full_text.startswith(prompt_text):
            raise ChatTemplateError(
                "the chat template's generation prompt is not a prefix of the full conversation; "
                "response tokens cannot be masked exactly. Use a model whose template renders "
                "the assistant turn after add_generation_prompt output."
            )
        return prompt_text, full_text[len(prompt_text) :]
    head = f"{system}\n\n" if system else ""
    return f"{head}{prompt}\n", response


def encode_sample(
    tokenizer, system: str, prompt: str, response: str, max_length: int
) -> EncodedSample:
    """Token ids and labels for one sample (see the module docstring for the masking rules)."""
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2, got {max_length}")
    if not response.strip():
        return EncodedSample([], [], 0, False, SKIP_EMPTY_RESPONSE)
    prompt_text, response_text = render_texts(tokenizer, system, prompt, response)
    return encode_texts(tokenizer, prompt_text, response_text, max_length)


def encode_texts(tokenizer, prompt_text: str, response_text: str, max_length: int) -> EncodedSample:
    """Token ids and labels of an already rendered (prompt text, response text) pair: the two
    are tokenized separately and concatenated, labels cover the response only. Without a chat
    template, BOS opens the prompt and EOS closes the response. Truncation cuts the response's
    end."""
    prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(response_text, add_special_tokens=False)["input_ids"]
    if not getattr(tokenizer, "chat_template", None):
        if tokenizer.bos_token_id is not None:
            prompt_ids = [tokenizer.bos_token_id, *prompt_ids]
        if tokenizer.eos_token_id is not None:
            response_ids = [*response_ids, tokenizer.eos_token_id]
    total = len(prompt_ids) + len(response_ids)
    truncated = total > max_length
    if len(prompt_ids) >= max_length:
        return EncodedSample(
            prompt_ids[:max_length], [IGNORE_INDEX] * max_length, 0, True, SKIP_NO_RESPONSE_TOKENS
        )
    response_ids = response_ids[: max_length - len(prompt_ids)]
    return EncodedSample(
        input_ids=prompt_ids + response_ids,
        labels=[IGNORE_INDEX] * len(prompt_ids) + response_ids,
        n_response_tokens=len(response_ids),
        truncated=truncated,
    )


def collate(
    batch: Sequence[EncodedSample], pad_token_id: int, padding_side: str = "right"
) -> dict[str, torch.Tensor]:
    """Pad a batch to its longest sample.

    Returns ``input_ids``, ``labels``, ``attention_mask`` and ``position_ids``, each (B, L)
    int64. Position ids count real tokens only, so left padding does not shift positions and a
    sample's outputs do not depend on its batch.
    """
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    width = max(len(s) for s in batch)
    ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, s in enumerate(batch):
        n = len(s)
        span = slice(0, n) if padding_side == "right" else slice(width - n, width)
        ids[i, span] = torch.tensor(s.input_ids, dtype=torch.long)
        labels[i, span] = torch.tensor(s.labels, dtype=torch.long)
        mask[i, span] = 1
    position_ids = (mask.cumsum(dim=1) - 1).clamp(min=0)
    return {
        "input_ids": ids,
        "labels": labels,
        "attention_mask": mask,
        "position_ids": position_ids,
    }


def length_batches(
    lengths: Sequence[int], max_batch_size: int, max_batch_tokens: int
) -> list[list[int]]:
    """Group sample indices into batches of similar length to cut padding.

    Samples are sorted by length (stable, so ties keep input order); a batch closes when it
    holds ``max_batch_size`` samples or its padded size (count x longest) would pass
    ``max_batch_tokens``. A single sample longer than ``max_batch_tokens`` gets its own batch.
    """
    if max_batch_size < 1 or max_batch_tokens < 1:
        raise ValueError("max_batch_size and max_batch_tokens must be >= 1")
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        # Sorted ascending, so sample i is the longest of the batch it would join.
        padded = lengths[i] * (len(current) + 1)
        if current and (len(current) >= max_batch_size or padded > max_batch_tokens):
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches

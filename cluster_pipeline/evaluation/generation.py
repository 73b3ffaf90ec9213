"""Greedy generation for the code suites: left-padded batches with stop strings
(:func:`generate`) and the progress lines a long generation logs (:class:`GenerationProgress`)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

from cluster_pipeline.data.tokenization import prompt_ids


class GenerationProgress:
    """Progress of one benchmark's generation: a line when a batch of completions is done, and
    between those, at most one line every ``every_s`` seconds with the new tokens of the batch
    and an ETA. The ETA counts every batch as running to ``max_new_tokens`` at the rate seen so
    far, so it says "about": stop strings end completions early, while each new token of a
    batch costs a little more than the one before it (its attention reads every earlier
    position), and other work on the machine changes the rate (issue 44: an "at most 125 s"
    took 189 s)."""

    def __init__(
        self,
        name: str,
        total: int,
        batch_size: int,
        max_new_tokens: int,
        log: Callable[[str], None],
        every_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.name, self.total, self.log, self.every_s, self.clock = name, total, log, every_s, clock
        self.batches = max(1, math.ceil(total / batch_size))
        self.max_new_tokens = max_new_tokens
        self.done, self.batch, self.steps, self.steps_total = 0, 0, 0, 0
        self.start = self.last = clock()

    def token(self) -> None:
        """One new token of the running batch (called by ``generate``)."""
        self.steps += 1
        self.steps_total += 1
        now = self.clock()
        if now - self.last < self.every_s:
            return
        self.last = now
        rate = self.steps_total / (now - self.start)  # token steps per second
        left = (self.max_new_tokens - self.steps) + (
            self.batches - self.batch - 1
        ) * self.max_new_tokens
        self.log(
            f"{self.name}: batch {self.batch + 1}/{self.batches}, "
            f"{self.steps}/{self.max_new_tokens} new tokens, ETA about {left / rate:.0f} s"
        )

    def batch_done(self, n: int) -> None:
        """``n`` more completions finished (one batch)."""
        self.done += n
        self.batch += 1
        self.steps = 0
        self.last = self.clock()
        self.log(f"{self.name}: generated {self.done}/{self.total}")


def generate(
    model,
    tokenizer,
    prompts: Sequence[str],
    max_new_tokens: int,
    batch_size: int = 8,
    stop_strings: Sequence[str] | None = None,
    progress: GenerationProgress | None = None,
) -> list[str]:
    """Greedy completions of ``prompts`` (left-padded batches); returns the new text only.
    Each prompt is tokenized as training inputs begin (:func:`prompt_ids`: BOS first without a
    chat template). ``progress`` is told of every new token and finished batch."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    class _Observe(StoppingCriteria):
        # A stopping criterion that never stops: generate() calls it once per new token.
        def __call__(self, input_ids, scores, **kwargs):
            if progress is not None:
                progress.token()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    device = next(model.parameters()).device
    outputs: list[str] = [""] * len(prompts)
    original_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    kwargs = {"stop_strings": list(stop_strings), "tokenizer": tokenizer} if stop_strings else {}
    if progress is not None:
        kwargs["stopping_criteria"] = StoppingCriteriaList([_Observe()])
    with torch.inference_mode():
        try:
            order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
            for start in range(0, len(order), batch_size):
                idx = order[start : start + batch_size]
                ids = [prompt_ids(tokenizer, prompts[i]) for i in idx]
                enc = tokenizer.pad({"input_ids": ids}, return_tensors="pt", padding=True)
                enc = enc.to(device)
                out = model.generate(
                    **enc,
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    pad_token_id=tokenizer.pad_token_id,
                    **kwargs,
                )
                new = out[:, enc["input_ids"].shape[1] :]
                texts = tokenizer.batch_decode(new, skip_special_tokens=True)
                for i, text in zip(idx, texts, strict=True):
                    outputs[i] = text
                if progress is not None:
                    progress.batch_done(len(idx))
        finally:
            tokenizer.padding_side = original_side
    return outputs

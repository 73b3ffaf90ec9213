r"""Turning a conversation into token ids and a label mask that covers the assistant turns.

**Rendering.** With a chat template, the conversation (system, user, assistant and tool turns)
is rendered by ``tokenizer.apply_chat_template``. Each trained assistant turn's span is what
rendering the conversation through that turn adds after rendering the turns before it with
``add_generation_prompt=True``: the answer plus the template's end-of-turn marker. Every span is
checked to be a prefix of the next rendering; a template for which that fails raises
:class:`ChatTemplateError`. Without a chat template the plain format is::

    BOS [system "\n\n"] user "\n" assistant EOS user "\n" assistant EOS ...

(tool turns are written like user turns) and each assistant text plus its EOS is trained. A
conversation without a user turn (a ``text`` record) is language modelling: BOS, the text and
EOS, all trained, with or without a template. Which assistant turns are trained is
``response_turns``: ``"all"`` (default) or ``"last"``; tool turns and the template's own
markers are never trained. Context and trained spans are tokenized separately and concatenated,
so the label mask is exact.

**Tools.** A sample's function schemas (the ``tools`` column) are passed to
``apply_chat_template(..., tools=...)`` (transformers' API; TRL's SFTTrainer does the same) in
every rendering, so they are context and never trained. A template that ignores them (its
output is the same with and without them, e.g. SmolLM2's) or raises on them is a
:class:`ChatTemplateError`: the model would otherwise learn calls to functions it never sees.
Without a template the schemas are written as JSON after the system message.

**Special-token text.** Message content is plain text: when a message holds the text of one of
the tokenizer's added tokens (``<|im_end|>``, ``<|endoftext|>``, ...), the content is tokenized
with ``split_special_tokens=True``, so only the template's own markers become special ids (the
content's position inside the rendering is found by rendering placeholders in its place).

**Truncation** to ``max_length`` tokens (``truncation``): the *prompt* is everything before
the first trained token, the *response* everything from it on.

* ``skip``: a prompt that fills the window skips the sample; otherwise the response's end is
  cut.
* ``left`` (default): the response keeps ``min(len(response), max_length // 2)`` tokens at
  least; if the prompt leaves less, the start of the user text is dropped (the oldest user and
  tool turns first, the system message and the template's head kept, so the end of the
  question survives), then the response's end is cut. If the prompt cannot get within its
  budget even with all that text gone, it is kept whole when it fits the window (the
  response's end is cut, as under ``skip``) and the sample is skipped (``prompt_too_long``)
  when it does not. ``left`` and ``proportional`` therefore keep every sample ``skip`` keeps.
* ``proportional``: the window is split between prompt and response as LLaMA-Factory's
  ``infer_seqlen`` does (a part shorter than half the window is kept whole; otherwise each gets
  a share in proportion to its length); the prompt is shortened as under ``left`` (LLaMA-Factory
  cuts its end instead, which would drop the template's generation prompt).

A sample is skipped (``skip_reason``) when its trained turns are empty (``empty_response``),
when no trained token fits (``no_response_tokens``), or when even the template head and system
message leave no room (``prompt_too_long``).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

# Defined beside the batch layout (torch-only); tokenization and the loss share it.
from cluster_pipeline.data.packing import IGNORE_INDEX as IGNORE_INDEX

# Batching by length lives with the other batch layouts (torch-only callers import it there).
from cluster_pipeline.data.packing import length_batches as length_batches

if TYPE_CHECKING:  # imported where a tensor is made: loading the Definitions needs no torch
    import torch

SKIP_EMPTY_RESPONSE = "empty_response"
SKIP_NO_RESPONSE_TOKENS = "no_response_tokens"
SKIP_PROMPT_TOO_LONG = "prompt_too_long"

Truncation = Literal["skip", "left", "proportional"]
ResponseTurns = Literal["all", "last"]
TRUNCATIONS: tuple[str, ...] = ("skip", "left", "proportional")


class SequenceSettings(BaseModel):
    """How a sample becomes one training sequence; the same in embedding, training and
    held-out loss (module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_length: int = Field(default=256, ge=2, description="Max tokens per sample.")
    truncation: Truncation = Field(
        default="left",
        description="When a sample passes max_length: skip (drop it if the prompt fills the "
        "window), left (drop the start of the user text, keep the template head and the end "
        "of the question) or proportional (split the window between prompt and response as "
        "LLaMA-Factory's cutoff does). The response's end is cut in every case.",
    )
    response_turns: ResponseTurns = Field(
        default="all",
        description="Which assistant turns of a multi-turn conversation are trained and "
        "scored: all, or only the last.",
    )


class PackingSettings(BaseModel):
    """Whether and how batches are packed; the same knobs in the embedding pass, training and
    the held-out loss (module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    packing: bool = Field(
        default=True,
        description="Padding-free batches: samples concatenated into rows (position ids "
        "restart per sample, attention never crosses a sample). Off = one sample per row, "
        "padded to the longest. Models that cannot pack fall back to padding (one log line "
        "says so).",
    )
    max_packed_length: int = Field(
        default=512,
        ge=1,
        description="Tokens per packed row (a batch holds several rows). On CPU attention costs "
        "the square of a row's length, so rows are kept short: 512 was the fastest bound "
        "measured at the make-run shape (benchmarks/RESULTS.md, 'The row bound'); GPUs with "
        "flash-attention can take longer rows.",
    )


class ChatTemplateError(ValueError):
    """The chat template cannot be split into exact context and assistant spans."""


@dataclass(frozen=True)
class EncodedSample:
    """Token ids of one sample. ``labels[i] == IGNORE_INDEX`` outside the trained turns.

    ``skip_reason`` is set (and the sample must not be embedded or trained on) when no trained
    token survives (module docstring). ``prompt_tokens_cut`` / ``response_tokens_cut`` count the
    tokens truncation removed from the start of the user text and from the end.
    """

    input_ids: list[int]
    labels: list[int]
    n_response_tokens: int
    truncated: bool
    skip_reason: str | None = None
    prompt_tokens_cut: int = 0
    response_tokens_cut: int = 0

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def truncation_kind(self) -> str | None:
        """``"prompt_start"``, ``"response_end"``, both joined by ``+``, or None."""
        parts = [
            name
            for name, n in (
                ("prompt_start", self.prompt_tokens_cut),
                ("response_end", self.response_tokens_cut),
            )
            if n
        ]
        return "+".join(parts) or None


@dataclass(frozen=True)
class Piece:
    """A run of rendered text: ``label`` if trained; ``plain`` if it is message content that
    must stay text (special-token strings split); ``end_ids`` are appended after its tokens."""

    text: str
    label: bool
    plain: bool = False
    end_ids: tuple[int, ...] = ()


def sequence_start(tokenizer) -> list[int]:
    """The ids every input opens with: none with a chat template (the template writes its own
    head), else ``[BOS]`` when the tokenizer has one. Training, held-out loss and generation
    prompts all begin this way."""
    if getattr(tokenizer, "chat_template", None) or tokenizer.bos_token_id is None:
        return []
    return [tokenizer.bos_token_id]


def prompt_ids(tokenizer, text: str) -> list[int]:
    """Ids of a rendered prompt as a model input (generation): :func:`sequence_start`, then
    ``text`` with the template's markers parsed as special tokens, exactly as training and
    held-out inputs begin."""
    return [*sequence_start(tokenizer), *tokenizer(text, add_special_tokens=False)["input_ids"]]


def _eos(tokenizer) -> tuple[int, ...]:
    return () if tokenizer.eos_token_id is None else (tokenizer.eos_token_id,)


def _special_texts(tokenizer) -> list[str]:
    return [t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()]


def _trained(messages: list[dict], response_turns: str) -> list[int]:
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    return turns[-1:] if response_turns == "last" else turns


def _render(tokenizer, messages: list[dict], tools: list[dict] | None = None, **kwargs) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **kwargs)
    except Exception as e:  # jinja2 TemplateError, or a template raising on a role
        roles = [m["role"] for m in messages]
        what = f"roles {roles}" + (" with tools" if tools else "")
        raise ChatTemplateError(
            f"the chat template cannot render {what}: {e}. Use a model whose template "
            "accepts these turns, or map the tool turns away."
        ) from e


def _check_tools_rendered(tokenizer, messages: list[dict], tools: list[dict] | None) -> None:
    """Refuse tools the chat template does not write: rendered with and without them, the
    conversation must differ (else the model would learn calls to functions it never sees)."""
    if tools and _render(tokenizer, messages, tools) == _render(tokenizer, messages):
        raise ChatTemplateError(
            "the chat template does not render tools (its output is the same with and without "
            "the sample's function schemas), so the model would learn calls to functions it "
            "never sees. Use a base model whose chat template writes `tools` (e.g. Qwen2.5 or "
            "Llama 3.1 Instruct), or remove the `tools` field from these records."
        )


def _template_spans(
    tokenizer, messages: list[dict], trained: list[int], tools: list[dict] | None = None
) -> tuple[str, list]:
    """The rendered conversation and the (start, end) character span of each trained turn."""
    full = _render(tokenizer, messages, tools)
    spans = []
    for j in trained:
        before = _render(tokenizer, messages[:j], tools, add_generation_prompt=True)
        through = full if j == len(messages) - 1 else _render(tokenizer, messages[: j + 1], tools)
        if not (through.startswith(before) and full.startswith(through)):
            raise ChatTemplateError(
                f"the chat template does not render assistant turn {j} after the turns before "
                "it (add_generation_prompt output is not a prefix of the conversation), so its "
                "tokens cannot be masked exactly. Use response_turns='last' or a model whose "
                "template renders each turn after the previous ones."
            )
        spans.append((len(before), len(through)))
    return full, spans


def _split(text: str, spans: list[tuple[int, int]]) -> list[Piece]:
    pieces, pos = [], 0
    for start, end in spans:
        if start > pos:
            pieces.append(Piece(text[pos:start], False))
        pieces.append(Piece(text[start:end], True))
        pos = end
    if pos < len(text):
        pieces.append(Piece(text[pos:], False))
    return pieces


def _placeholder(i: int) -> str:
    return f"\ue000{i}\ue001"


def _plain_content_pieces(
    tokenizer, messages: list[dict], trained: list[int], tools: list[dict] | None
) -> list[Piece]:
    """Pieces with each message's content as its own ``plain`` piece: the template is rendered
    with placeholders in place of the contents, which are then put back."""
    masked = [{**m, "content": _placeholder(i)} for i, m in enumerate(messages)]
    full, spans = _template_spans(tokenizer, masked, trained, tools)
    pieces: list[Piece] = []
    for piece in _split(full, spans):
        rest = piece.text
        while rest:
            start = rest.find("\ue000")
            if start < 0:
                pieces.append(Piece(rest, piece.label))
                break
            stop = rest.index("\ue001", start)
            if start:
                pieces.append(Piece(rest[:start], piece.label))
            index = int(rest[start + 1 : stop])
            pieces.append(Piece(messages[index]["content"], piece.label, plain=True))
            rest = rest[stop + 1 :]
    if "".join(p.text for p in pieces) != _render(tokenizer, messages, tools):
        raise ChatTemplateError(
            "a message holds special-token text and the chat template changes message content "
            "(e.g. trims it), so that text cannot be kept as plain text. Remove the special-"
            "token text from the sample."
        )
    return pieces


def render_pieces(
    tokenizer, messages: list[dict], response_turns: str = "all", tools: list[dict] | None = None
) -> list[Piece]:
    """The conversation as context and trained pieces (module docstring), without the
    :func:`sequence_start` ids. ``tools`` (function schemas) go to the chat template's
    ``tools``; without a template they are written as JSON after the system message.

    Raises:
        ChatTemplateError: the template cannot render the turns or the tools (it ignores
            them), or an assistant turn cannot be located (message names the turn and what to
            do).
    """
    if not any(m["role"] in ("user", "tool") for m in messages):  # plain text
        text = "\n\n".join(m["content"] for m in messages)
        eos = _eos(tokenizer)
        return [Piece(text, True, plain=True, end_ids=eos)]
    trained = _trained(messages, response_turns)
    if getattr(tokenizer, "chat_template", None):
        _check_tools_rendered(tokenizer, messages, tools)
        specials = _special_texts(tokenizer)
        if any(t in m["content"] for m in messages for t in specials):
            return _plain_content_pieces(tokenizer, messages, trained, tools)
        return _split(*_template_spans(tokenizer, messages, trained, tools))
    eos = _eos(tokenizer)
    pieces = []
    for i, m in enumerate(messages):
        if m["role"] == "system":
            pieces.append(Piece(f"{m['content']}\n\n", False, plain=True))
        elif m["role"] == "assistant":
            pieces.append(Piece(m["content"], i in trained, plain=True, end_ids=eos))
        else:
            pieces.append(Piece(f"{m['content']}\n", False, plain=True))
    if tools:
        head = sum(m["role"] == "system" for m in messages[:1])
        pieces.insert(head, Piece(f"{json.dumps(tools, ensure_ascii=False)}\n\n", False, True))
    return pieces


def _tokenize(tokenizer, pieces: list[Piece]) -> tuple[list[int], list[bool]]:
    """Ids and trained flags; adjacent pieces of one kind are tokenized together."""
    ids: list[int] = list(sequence_start(tokenizer))
    flags: list[bool] = [False] * len(ids)
    run: list[Piece] = []

    def flush():
        if not run:
            return
        text = "".join(p.text for p in run)
        kwargs = {"split_special_tokens": True} if run[0].plain else {}
        got = tokenizer(text, add_special_tokens=False, **kwargs)["input_ids"] if text else []
        ids.extend(got)
        flags.extend([run[0].label] * len(got))
        run.clear()

    for piece in pieces:
        if run and (run[0].label, run[0].plain) != (piece.label, piece.plain):
            flush()
        run.append(piece)
        if piece.end_ids:
            flush()
            ids.extend(piece.end_ids)
            flags.extend([piece.label] * len(piece.end_ids))
    flush()
    return ids, flags


def infer_seqlen(source_len: int, target_len: int, cutoff_len: int) -> tuple[int, int]:
    """(prompt tokens, response tokens) kept under ``proportional`` truncation; LLaMA-Factory's
    ``infer_seqlen`` (src/llamafactory/data/processor/processor_utils.py)."""
    if target_len * 2 < cutoff_len:
        max_target_len = cutoff_len
    elif source_len * 2 < cutoff_len:
        max_target_len = cutoff_len - source_len
    else:
        max_target_len = int(cutoff_len * (target_len / (source_len + target_len)))
    new_target_len = min(max_target_len, target_len)
    max_source_len = max(cutoff_len - new_target_len, 0)
    return min(max_source_len, source_len), new_target_len


def _prompt_budget(truncation: str, prompt: int, response: int, max_length: int) -> int:
    if truncation == "left":
        return max_length - min(response, max_length // 2)
    return infer_seqlen(prompt, response, max_length)[0]


def _drop_start(tokenizer, content: str, n_tokens: int) -> str:
    """``content`` without the text of its first ``n_tokens`` tokens (cut at a token
    boundary, so no character is split)."""
    enc = tokenizer(content, add_special_tokens=False, return_offsets_mapping=True)
    offsets = enc["offset_mapping"]
    if n_tokens >= len(offsets):
        return ""
    return content[offsets[n_tokens][0] :]


def _encode(tokenizer, messages, response_turns, tools=None):
    pieces = render_pieces(tokenizer, messages, response_turns, tools)
    ids, flags = _tokenize(tokenizer, pieces)
    return ids, flags, _first_label(flags)


def encode_conversation(
    tokenizer,
    messages: list[dict],
    max_length: int,
    truncation: str = "left",
    response_turns: str = "all",
    tools: list[dict] | None = None,
) -> EncodedSample:
    """Token ids and labels of one conversation (module docstring: rendering, special-token
    text, truncation). ``messages`` is a list of ``{"role", "content"}`` with roles system,
    user, assistant, tool; ``tools`` the function schemas the template is given (context,
    never trained).

    Raises:
        ValueError: ``max_length < 2`` or an unknown ``truncation``/``response_turns``.
        ChatTemplateError: see :func:`render_pieces`.
    """
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2, got {max_length}")
    if truncation not in TRUNCATIONS:
        raise ValueError(f"truncation must be one of {TRUNCATIONS}, got {truncation!r}")
    if response_turns not in ("all", "last"):
        raise ValueError(f"response_turns must be 'all' or 'last', got {response_turns!r}")
    trained = _trained(messages, response_turns)
    if not any(messages[i]["content"].strip() for i in trained):
        return EncodedSample([], [], 0, False, SKIP_EMPTY_RESPONSE)
    ids, flags, first = _encode(tokenizer, messages, response_turns, tools)
    prompt_cut = 0
    if len(ids) > max_length and truncation != "skip" and first > 0:
        budget = _prompt_budget(truncation, first, len(ids) - first, max_length)
        shortenable = [
            i
            for i, m in enumerate(messages)
            if m["role"] in ("user", "tool") and (not trained or i < trained[0])
        ]
        short = copy.deepcopy(messages)
        s_ids, s_flags, s_first = ids, flags, first
        for i in shortenable:
            while s_first > budget and short[i]["content"]:
                content = short[i]["content"]
                shorter = _drop_start(tokenizer, content, s_first - budget)
                short[i]["content"] = shorter if shorter != content else content[1:]
                s_ids, s_flags, s_first = _encode(tokenizer, short, response_turns, tools)
            if s_first <= budget:
                break
        if s_first <= budget:
            prompt_cut = first - s_first
            ids, flags, first = s_ids, s_flags, s_first
        elif first >= max_length:
            # The template head and system message alone pass the budget: no question is left
            # to keep, so the sample is skipped rather than trained without one.
            return EncodedSample(
                ids[:max_length], [IGNORE_INDEX] * max_length, 0, True, SKIP_PROMPT_TOO_LONG
            )
        # else: the prompt fits as it is; cut only the response's end (as under ``skip``).
    return _fit(ids, flags, max_length, prompt_cut)


def min_prompted_length(tokenizer) -> int:
    """The smallest ``max_length`` at which a sample with a question keeps one trained token:
    what the template writes before the answer when the question is empty (its head, a default
    system message if it adds one, the generation prompt), plus one. Under every truncation the
    template around the question is kept, so a shorter ``max_length`` skips every such sample
    (only prompt-less ``text`` records could fit)."""
    messages = [{"role": "user", "content": ""}, {"role": "assistant", "content": "x"}]
    _, _, first = _encode(tokenizer, messages, "all")
    return first + 1


def _fit(ids: list[int], flags: list[bool], max_length: int, prompt_cut: int = 0) -> EncodedSample:
    """The sample cut to ``max_length`` at the end, or skipped when no trained token fits."""
    if _first_label(flags) >= max_length:
        return EncodedSample(
            ids[:max_length], [IGNORE_INDEX] * max_length, 0, True, SKIP_NO_RESPONSE_TOKENS
        )
    response_cut = max(0, len(ids) - max_length)
    ids, flags = ids[:max_length], flags[:max_length]
    return EncodedSample(
        input_ids=ids,
        labels=[t if f else IGNORE_INDEX for t, f in zip(ids, flags, strict=True)],
        n_response_tokens=sum(flags),
        truncated=bool(prompt_cut or response_cut),
        prompt_tokens_cut=prompt_cut,
        response_tokens_cut=response_cut,
    )


def _first_label(flags: list[bool]) -> int:
    return flags.index(True) if True in flags else len(flags)


def encode_sample(
    tokenizer,
    system: str,
    prompt: str,
    response: str,
    max_length: int,
    truncation: str = "left",
    response_turns: str = "all",
    messages: str | None = None,
    tools: str | None = None,
) -> EncodedSample:
    """:func:`encode_conversation` of a table row (columns system, prompt, response,
    messages, tools; :func:`cluster_pipeline.data.formats.conversation`)."""
    from cluster_pipeline.data.formats import conversation

    return encode_conversation(
        tokenizer,
        conversation(system, prompt, response, messages),
        max_length,
        truncation,
        response_turns,
        json.loads(tools) if tools else None,
    )


def encode_rows(tokenizer, frame, settings: SequenceSettings) -> list[EncodedSample]:
    """:func:`encode_sample` of every row of a table with columns system, prompt, response and
    (optionally) sample_id, messages, tools, source_file and source_line, under ``settings``.

    Raises:
        ChatTemplateError: naming the sample_id (and its ``file:line`` when the frame has the
            source columns) whose conversation the template cannot render or split.
    """
    n = frame.height
    columns = frame.columns
    messages = frame["messages"] if "messages" in columns else [None] * n
    tools = frame["tools"] if "tools" in columns else [None] * n
    ids = frame["sample_id"] if "sample_id" in columns else range(n)
    has_source = "source_file" in columns and "source_line" in columns
    out = []
    for row, (sid, s, p, r, m, t) in enumerate(
        zip(ids, frame["system"], frame["prompt"], frame["response"], messages, tools, strict=True)
    ):
        try:
            out.append(
                encode_sample(
                    tokenizer,
                    s,
                    p,
                    r,
                    settings.max_length,
                    settings.truncation,
                    settings.response_turns,
                    m,
                    t,
                )
            )
        except ChatTemplateError as e:
            where = (
                f" ({frame['source_file'][row]}:{frame['source_line'][row]})" if has_source else ""
            )
            raise ChatTemplateError(f"sample {sid}{where}: {e}") from e
    return out


def generation_header(tokenizer) -> list[int]:
    """The ids a chat template writes to open an assistant turn (its generation prompt, e.g.
    ChatML's ``<|im_start|>assistant`` and a newline): what rendering a user turn with
    ``add_generation_prompt=True`` adds to rendering it without. [] without a chat template.

    Raises:
        ChatTemplateError: the rendering with the generation prompt does not extend the one
            without.
    """
    if not getattr(tokenizer, "chat_template", None):
        return []
    turn = [{"role": "user", "content": "x"}]
    opened = _render(tokenizer, turn, add_generation_prompt=True)
    closed = _render(tokenizer, turn, add_generation_prompt=False)
    if not opened.startswith(closed):
        raise ChatTemplateError(
            "the chat template's generation prompt does not extend the conversation, so the "
            "assistant turn's opening cannot be found"
        )
    return tokenizer(opened[len(closed) :], add_special_tokens=False)["input_ids"]


def response_only(sample: EncodedSample, tokenizer, header: list[int]) -> EncodedSample:
    """The sample's trained tokens without their prompt: the unconditioned input of IFD (Li et
    al. 2024; ``selection/selectors/ifd.py``). The response tokens are exactly those of
    ``sample`` (same truncation, same T; the trained turns concatenated for a multi-turn
    sample), preceded by the sample's BOS when it opens with one and by ``header`` (the
    template's assistant opening, :func:`generation_header`), so the first response token is
    predicted from the assistant part of the template, as in the prompted sample, with no
    question before it. Without BOS and header (a template-less tokenizer with no BOS), EOS
    opens the input, as GPT-2 style models begin a document. A sample with a ``skip_reason``,
    or with no prompt at all (a ``text`` record: its first token is trained), is returned as it
    is: it has no instruction to leave out (its IFD is 1).
    """
    if sample.skip_reason is not None or sample.labels[0] != IGNORE_INDEX:
        return sample
    bos = tokenizer.bos_token_id
    start = [sample.input_ids[0]] if bos is not None and sample.input_ids[0] == bos else []
    prefix = [*start, *header]
    if not prefix and tokenizer.eos_token_id is not None:
        prefix = [tokenizer.eos_token_id]
    trained = [t for t in sample.labels if t != IGNORE_INDEX]
    return EncodedSample(
        input_ids=[*prefix, *trained],
        labels=[IGNORE_INDEX] * len(prefix) + trained,
        n_response_tokens=len(trained),
        truncated=sample.truncated,
        prompt_tokens_cut=sample.prompt_tokens_cut,
        response_tokens_cut=sample.response_tokens_cut,
    )


def end_of_turn_ids(tokenizer) -> list[int]:
    """The ids that close a trained assistant turn after its text: what the chat template writes
    after an assistant message's content (ChatML's ``<|im_end|>`` and newline), found by
    rendering a one-exchange conversation around a placeholder answer; without a template, EOS
    (the plain format's ``end_ids``). [] when there are none.

    Raises:
        ChatTemplateError: the template does not render the placeholder answer.
    """
    if not getattr(tokenizer, "chat_template", None):
        return list(_eos(tokenizer))
    answer = _placeholder(0)
    turns = [{"role": "user", "content": "x"}, {"role": "assistant", "content": answer}]
    full = _render(tokenizer, turns)
    at = full.rfind(answer)
    if at < 0:
        raise ChatTemplateError("the chat template does not render the assistant's answer")
    return tokenizer(full[at + len(answer) :], add_special_tokens=False)["input_ids"]


def without_end_of_turn(sample: EncodedSample, closing: Sequence[int]) -> EncodedSample:
    """``sample`` with the end-of-turn tokens of its trained turns left out of the labels: each
    run of trained tokens that ends with ``closing`` (:func:`end_of_turn_ids`) stops before it
    (a turn whose end truncation cut keeps what is left). The answer text alone is scored, as
    Cherry LLM's IFD scores ``tokenizer.encode(output)``, which for a Llama tokenizer holds no
    EOS (Li et al. 2024; ``cherry_seletion/data_analysis.py:59-84``). A sample left with no
    trained token is skipped (``no_response_tokens``).
    """
    closing = list(closing)
    if sample.skip_reason is not None or not closing:
        return sample
    labels = list(sample.labels)
    c, i, n = len(closing), 0, len(labels)
    while i < n:
        if labels[i] == IGNORE_INDEX:
            i += 1
            continue
        end = i
        while end < n and labels[end] != IGNORE_INDEX:
            end += 1
        if end - i >= c and labels[end - c : end] == closing:
            labels[end - c : end] = [IGNORE_INDEX] * c
        i = end
    kept = sum(t != IGNORE_INDEX for t in labels)
    return EncodedSample(
        input_ids=sample.input_ids,
        labels=labels,
        n_response_tokens=kept,
        truncated=sample.truncated,
        skip_reason=None if kept else SKIP_NO_RESPONSE_TOKENS,
        prompt_tokens_cut=sample.prompt_tokens_cut,
        response_tokens_cut=sample.response_tokens_cut,
    )


def encode_texts(tokenizer, prompt_text: str, response_text: str, max_length: int) -> EncodedSample:
    """Token ids and labels of an already rendered (prompt text, response text) pair: the two
    are tokenized separately and concatenated after the :func:`sequence_start` ids, labels
    cover the response only; without a chat template EOS closes the response. Truncation cuts
    the response's end; a prompt that fills the window skips the pair."""
    eos = () if getattr(tokenizer, "chat_template", None) else _eos(tokenizer)
    ids, flags = _tokenize(
        tokenizer, [Piece(prompt_text, False), Piece(response_text, True, end_ids=eos)]
    )
    return _fit(ids, flags, max_length)


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
    import torch

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

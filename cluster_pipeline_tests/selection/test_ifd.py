"""ifd (Cherry LLM, Li et al. 2024): IFD = s(A|Q) / s(A) on samples whose two losses are known,
and the unconditioned input it is computed on."""

import numpy as np
import pytest

from cluster_pipeline.data.tokenization import (
    IGNORE_INDEX,
    encode_sample,
    end_of_turn_ids,
    generation_header,
    response_only,
    without_end_of_turn,
)
from cluster_pipeline.selection.selectors import SelectionInputs, SelectionParams, run_selector
from cluster_pipeline.selection.selectors.ifd import ifd_scores

# s(A|Q) and s(A) in nats/token, and their IFD by hand:
CONDITIONED = np.array([1.0, 0.5, 2.0, 0.9, 0.3, np.nan], dtype=np.float32)
ALONE = np.array([2.0, 0.5, 1.0, 1.0, 1.2, 1.0], dtype=np.float32)
#   0.5, 1.0 (kept: Cherry drops only IFD > 1), 2.0 (dropped), 0.9, 0.25, nan (no loss)


def _inputs(k=1, labels=None):
    labels = np.zeros(6, dtype=np.int64) if labels is None else labels
    return SelectionInputs(labels, k, mean_loss=CONDITIONED, unconditioned_loss=ALONE)


def test_ifd_of_samples_whose_two_losses_are_known():
    np.testing.assert_allclose(
        ifd_scores(CONDITIONED, ALONE), [0.5, 1.0, 2.0, 0.9, 0.25, np.nan], rtol=1e-6
    )
    # K = 1, r = 0.34 of m = 6: a budget of floor(2.04) = 2; samples 0, 1, 3, 4 have IFD <= 1,
    # highest first: 1 (1.0), 3 (0.9), 0 (0.5), 4 (0.25).
    result = run_selector("ifd", _inputs(), SelectionParams(r=0.34))
    assert np.flatnonzero(result.selected).tolist() == [1, 3]
    assert result.selection_rank[[1, 3, 0, 4]].tolist() == [0, 1, 2, 3]
    # The rest follow: IFD > 1 highest first (2.0), then no IFD.
    assert result.selection_rank[[2, 5]].tolist() == [4, 5]
    assert result.score is not None and result.score[3] == pytest.approx(0.9)
    assert (result.weight == 1).all() and result.per_cluster == 2


def test_ifd_keeps_every_eligible_sample_when_the_budget_holds_more():
    result = run_selector("ifd", _inputs(), SelectionParams(r=0.5))  # budget 3 of 4 eligible
    assert np.flatnonzero(result.selected).tolist() == [0, 1, 3] and result.per_cluster == 3
    result = run_selector("ifd", _inputs(), SelectionParams(r=1.0))  # budget 6: those 4
    assert np.flatnonzero(result.selected).tolist() == [0, 1, 3, 4] and result.per_cluster == 4


def test_ifd_refuses_a_pool_without_an_eligible_sample():
    inputs = SelectionInputs(
        np.zeros(2, dtype=np.int64), 1, mean_loss=2 * np.ones(2), unconditioned_loss=np.ones(2)
    )
    with pytest.raises(ValueError, match="no sample has IFD <= 1"):
        run_selector("ifd", inputs, SelectionParams(r=1.0))


def _cherry_selection(loss_1, loss_2, instruct_len, len_1, max_length, sample_number):
    """cherry_seletion/data_by_IFD.py:46-122, transcribed: per sample the token losses of the
    answer alone (loss_1) and given the instruction (loss_2); skip when the instruction fills
    the window (line 92) or instruction + answer exceed it (line 100); mean_rate = mean_2 /
    mean_1, skipped when > 1 (line 106); sorted ascending and the last sample_number kept."""
    mean_rate_list = []
    for i in range(len(loss_1)):
        if not max_length - instruct_len[i] > 0:
            continue
        if instruct_len[i] + len_1[i] > max_length:
            continue
        mean_rate = np.array(loss_2[i]).mean() / np.array(loss_1[i]).mean()
        if mean_rate > 1:
            continue
        mean_rate_list.append((mean_rate, i))
    mean_rate_list = sorted(mean_rate_list)
    return sorted(i for _, i in mean_rate_list[-sample_number:])


@pytest.mark.parametrize("seed", range(5))
def test_ifd_selects_what_cherrys_data_by_ifd_selects(seed):
    rng = np.random.default_rng(seed)
    n, max_length = 12, 64
    len_1 = rng.integers(2, 9, n)
    loss_1 = [rng.uniform(0.5, 3.0, t) for t in len_1]
    loss_2 = [x * rng.uniform(0.4, 1.3, len(x)) for x in loss_1]
    instruct_len = rng.integers(10, 62, n)
    truncated = instruct_len + len_1 > max_length
    want = _cherry_selection(loss_1, loss_2, instruct_len, len_1, max_length, 4)
    inputs = SelectionInputs(
        np.zeros(n, dtype=np.int64),
        1,
        mean_loss=np.array([x.mean() for x in loss_2]),
        unconditioned_loss=np.array([x.mean() for x in loss_1]),
        extra={"ifd_excluded": truncated},
    )
    result = run_selector("ifd", inputs, SelectionParams(r=4 / 12))
    assert np.flatnonzero(result.selected).tolist() == want


def test_the_answer_is_scored_without_the_templates_end_of_turn_tokens(tiny_tokenizer):
    """Cherry scores tokenizer.encode(output) after the prompt (data_analysis.py:59-84), which
    for its Llama tokenizer holds no EOS: the trained tokens without the closing marker are the
    answer text's own tokens."""
    closing = end_of_turn_ids(tiny_tokenizer)
    assert tiny_tokenizer.decode(closing) == "<|im_end|>\n"
    sample = encode_sample(tiny_tokenizer, "Be brief.", "Add 2 and 3.", "The sum is 5.", 64)
    text_only = without_end_of_turn(sample, closing)
    trained = [t for t in text_only.labels if t != IGNORE_INDEX]
    assert trained == tiny_tokenizer("The sum is 5.", add_special_tokens=False)["input_ids"]
    assert text_only.input_ids == sample.input_ids
    assert text_only.n_response_tokens == sample.n_response_tokens - len(closing)
    alone = response_only(text_only, tiny_tokenizer, generation_header(tiny_tokenizer))
    assert tiny_tokenizer.decode([t for t in alone.labels if t != IGNORE_INDEX]) == "The sum is 5."
    # Without a template, EOS closes the answer and is left out; a turn whose end truncation cut
    # (no closing marker) keeps every trained token.
    from cluster_pipeline_tests.helpers import build_tokenizer

    plain = build_tokenizer(chat_template=None)
    assert end_of_turn_ids(plain) == [plain.eos_token_id]
    sample = encode_sample(plain, "", "Add 2 and 3.", "The sum is 5.", 64)
    trained = [t for t in without_end_of_turn(sample, [plain.eos_token_id]).labels if t >= 0]
    assert trained == plain("The sum is 5.", add_special_tokens=False)["input_ids"]
    cut = encode_sample(plain, "", "Add 2 and 3.", "The sum is five hundred and five.", 12)
    assert cut.response_tokens_cut > 0
    assert without_end_of_turn(cut, [plain.eos_token_id]).labels == cut.labels


def test_the_unconditioned_input_is_the_assistant_part_with_the_same_response_tokens(
    tiny_tokenizer,
):
    sample = encode_sample(tiny_tokenizer, "Be brief.", "Add 2 and 3.", "The sum is 5.", 64)
    alone = response_only(sample, tiny_tokenizer, generation_header(tiny_tokenizer))
    header = tiny_tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    trained = [t for t in sample.labels if t != IGNORE_INDEX]
    assert alone.input_ids == header + trained
    assert alone.labels == [IGNORE_INDEX] * len(header) + trained
    assert alone.n_response_tokens == sample.n_response_tokens == len(trained)
    assert tiny_tokenizer.decode(trained) == "The sum is 5.<|im_end|>\n"


def test_without_a_template_it_is_bos_and_the_plain_response(tiny_tokenizer):
    from cluster_pipeline_tests.helpers import build_tokenizer

    plain = build_tokenizer(chat_template=None)
    sample = encode_sample(plain, "", "Add 2 and 3.", "The sum is 5.", 64)
    alone = response_only(sample, plain, generation_header(plain))
    assert alone.input_ids[0] == plain.bos_token_id
    assert plain.decode(alone.input_ids[1:]) == "The sum is 5.<|endoftext|>"
    assert alone.n_response_tokens == sample.n_response_tokens


def test_a_budget_the_eligible_samples_cannot_fill_is_a_warning_with_the_counts():
    """Samples 0, 1, 3, 4 have IFD <= 1 (4 of 6): a budget they cannot fill keeps all 4 and
    says so (the asset logs each note as a warning); one they fill says nothing."""
    full = run_selector("ifd", _inputs(), SelectionParams(r=1.0))  # K floor(1.0 x 6) = 6
    assert full.notes == (
        "ifd: only 4 of the 6 samples have IFD <= 1, the only ones Cherry keeps "
        "(data_by_IFD.py:106), holding 4 samples, fewer than the budget of 6 samples that "
        "ratio 1.0 gives; all 4 are kept, a data fraction of 0.667",
    )
    assert run_selector("ifd", _inputs(), SelectionParams(r=0.5)).notes == ()  # budget 3
    # Token balance, lengths 10..60 (210 tokens, K = 1): the eligible hold 10+20+40+50 = 120.
    tokens = SelectionInputs(
        np.zeros(6, dtype=np.int64),
        1,
        lengths=np.array([10, 20, 30, 40, 50, 60]),
        response_tokens=np.array([5, 10, 15, 20, 25, 30]),
        mean_loss=CONDITIONED,
        unconditioned_loss=ALONE,
    )
    short = run_selector("ifd", tokens, SelectionParams(r=1.0, balance="tokens"))
    assert short.notes == (
        "ifd: only 4 of the 6 samples have IFD <= 1, the only ones Cherry keeps "
        "(data_by_IFD.py:106), holding 120 tokens, fewer than the budget of 210 tokens that "
        "ratio 1.0 gives; all 4 are kept, a data fraction of 0.667",
    )
    assert np.flatnonzero(short.selected).tolist() == [0, 1, 3, 4]
    filled = run_selector("ifd", tokens, SelectionParams(r=0.5, balance="tokens"))  # 105
    assert filled.notes == () and np.flatnonzero(filled.selected).tolist() == [0, 1, 3]

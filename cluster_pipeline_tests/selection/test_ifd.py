"""ifd (Cherry LLM, Li et al. 2024): IFD = s(A|Q) / s(A) on samples whose two losses are known,
and the unconditioned input it is computed on."""

import numpy as np
import pytest

from cluster_pipeline.data.tokenization import (
    IGNORE_INDEX,
    encode_sample,
    generation_header,
    response_only,
)
from cluster_pipeline.selection.selectors import SelectionInputs, SelectionParams, run_selector
from cluster_pipeline.selection.selectors.ifd import ifd_scores

# s(A|Q) and s(A) in nats/token, and their IFD by hand:
CONDITIONED = np.array([1.0, 0.5, 2.0, 0.9, 0.3, np.nan], dtype=np.float32)
ALONE = np.array([2.0, 0.5, 1.0, 1.0, 1.2, 1.0], dtype=np.float32)
#   0.5, 1.0 (not < 1: dropped), 2.0 (dropped), 0.9, 0.25, nan (no conditioned loss)


def _inputs(k=1, labels=None):
    labels = np.zeros(6, dtype=np.int64) if labels is None else labels
    return SelectionInputs(labels, k, mean_loss=CONDITIONED, unconditioned_loss=ALONE)


def test_ifd_of_samples_whose_two_losses_are_known():
    np.testing.assert_allclose(
        ifd_scores(CONDITIONED, ALONE), [0.5, 1.0, 2.0, 0.9, 0.25, np.nan], rtol=1e-6
    )
    # K = 1, r = 0.34 of m = 6: a budget of floor(2.04) = 2; samples 0, 3, 4 have IFD < 1,
    # highest first: 3 (0.9), 0 (0.5); 4 (0.25) is the least difficult.
    result = run_selector("ifd", _inputs(), SelectionParams(r=0.34))
    assert np.flatnonzero(result.selected).tolist() == [0, 3]
    assert result.selection_rank[[3, 0, 4]].tolist() == [0, 1, 2]
    # The rest follow: IFD >= 1 highest first (2.0, 1.0), then no IFD.
    assert result.selection_rank[[2, 1, 5]].tolist() == [3, 4, 5]
    assert result.score is not None and result.score[3] == pytest.approx(0.9)
    assert (result.weight == 1).all() and result.per_cluster == 2


def test_ifd_keeps_every_eligible_sample_when_the_budget_holds_more():
    result = run_selector("ifd", _inputs(), SelectionParams(r=0.5))  # budget 3, 3 eligible
    assert np.flatnonzero(result.selected).tolist() == [0, 3, 4] and result.per_cluster == 3
    result = run_selector("ifd", _inputs(), SelectionParams(r=1.0))  # budget 6: still those 3
    assert np.flatnonzero(result.selected).tolist() == [0, 3, 4] and result.per_cluster == 3


def test_ifd_refuses_a_pool_without_an_eligible_sample():
    inputs = SelectionInputs(
        np.zeros(2, dtype=np.int64), 1, mean_loss=np.ones(2), unconditioned_loss=np.ones(2)
    )
    with pytest.raises(ValueError, match="no sample has IFD < 1"):
        run_selector("ifd", inputs, SelectionParams(r=1.0))


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

"""``longest``: the samples with the longest responses, the token-length baseline of Xia et al.
2024, *Rethinking Data Selection at Scale: Random Selection is Almost All You Need*
(arXiv 2410.09335): on million-sample pools almost no self-scoring selector beat random
selection, and selecting by token length was the one cheap, stable gain.

The order is the samples' response tokens T (the tokens trained on, within ``max_length``, from
the embedding pass), longest first, ties to the lower index; ``longest_by: sample`` orders by
the sample's whole length (prompt and response, as trained) instead. The budget is the
unclustered one (``base``: K floor(r m) samples, or K B tokens under token balance, where the
order is cut at its longest prefix within the budget: under token balance long samples fill
the budget with fewer of them), so it is compared with ``peripheral`` at equal data; weights
are 1 and the subset is dealt into random balanced shards. The score is the length ordered by.

Cost: no model pass of its own: the lengths are the embedding pass's token counts.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import BaseModel, Field

from cluster_pipeline.selection.selectors.base import (
    SelectionInputs,
    SelectionParams,
    SelectionResult,
    SelectorSpec,
    global_budget,
    global_selection,
)


class LongestKnobs(BaseModel):
    """longest's knob: which length it orders by."""

    longest_by: Literal["response", "sample"] = Field(
        default="response",
        description="longest only: response = the response tokens T (the tokens trained on); "
        "sample = prompt and response tokens together.",
    )


def longest(inputs: SelectionInputs, params: SelectionParams) -> SelectionResult:
    """The longest samples first (module docstring), up to the global budget; score = the
    length ordered by (tokens).

    Raises:
        ValueError: no lengths of the kind ordered by.
    """
    knobs = params.knobs if isinstance(params.knobs, LongestKnobs) else LongestKnobs()
    lengths = inputs.response_tokens if knobs.longest_by == "response" else inputs.lengths
    if lengths is None or len(lengths) != inputs.n:
        raise ValueError(f"longest: needs the samples' {knobs.longest_by} token counts")
    length = np.asarray(lengths, dtype=np.int64)
    index = np.arange(inputs.n)
    order = index[np.lexsort((index, -length))]
    budget = global_budget(inputs, params)
    return global_selection("longest", order, inputs, params, budget, length.astype(np.float64))


SELECTORS = (
    SelectorSpec(
        "longest",
        "the same budget of the samples with the longest responses (token length, arXiv "
        "2410.09335)",
        longest,
        order=71,
        source="Xia et al. 2024, Rethinking Data Selection at Scale: Random Selection is "
        "Almost All You Need (arXiv 2410.09335), token-length selection",
        knobs=LongestKnobs,
    ),
)

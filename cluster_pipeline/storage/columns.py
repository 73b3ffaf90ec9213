"""What each column of every table the stages write means, once: the Dagster UI shows these as
the column descriptions of an asset's table (``dagster/column_schema``), and
``docs/design.md`` ("Stages") names the same columns.

A table is keyed by its name in :mod:`cluster_pipeline.storage.names`; a column a stage writes
must have an entry here (:func:`describe` refuses one that has none, so a new column without a
description fails every test that writes its table).
"""

from collections.abc import Iterable

from cluster_pipeline.storage.names import (
    BALANCED_CLUSTERS,
    CLUSTER_CENTROIDS,
    EVAL_ITEM_SCORES,
    LESS_GRADIENTS,
    PERIPHERAL_SUBSETS,
    PROXY_EMBEDDINGS,
    RAW_INSTRUCTIONS,
    S2L_TRAJECTORIES,
    SAMPLE_LINEAGE,
    SELECTION_TARGETS,
    SHARD_MANIFESTS,
)

# Columns several tables share mean the same everywhere.
_SAMPLE_ID = "The sample's stable id: the first 16 hex digits of sha256 over its content."
_CLUSTER = "Cluster c after the capacity step (trained on rank c)."
_SQ_DISTANCE = "Squared L2 distance to the cluster's centroid, in the clustered representation."
_N_RESPONSE = "T: response tokens within max_length (the tokens trained on and averaged over)."
_N_TOKENS = "Tokens of the sample after truncation to max_length (prompt and response)."
_WEIGHT = (
    "Loss weight w_c of the sample's rank (n_c K / N, or by response tokens under token "
    "balance); 1 for selectors without weights."
)

_INSTRUCTIONS = {
    "sample_id": _SAMPLE_ID,
    "split": "train (the pool selection draws from) or heldout (set aside for evaluation).",
    "system": "The system message, empty when the record has none.",
    "prompt": "The prompt (user turns) as the chat template receives it.",
    "response": "The response trained on (the assistant turns).",
    "form": "Which input form the record was read as (alpaca, sharegpt, openai, ...).",
    "source_file": "The file the sample was read from.",
    "source_line": "1-based line (JSONL, JSON) or row (Parquet, Arrow) in source_file.",
    "source_index": (
        "0-based place of the record among those of source_file (tells apart records on one "
        "line, as in a one-line JSON array); null for python_stdlib."
    ),
    "messages": "The kept conversation as a JSON list of {role, content}; null for one exchange.",
    "tools": "The function schemas (JSON list) the record gives the model; null when none.",
}

COLUMN_DESCRIPTIONS: dict[str, dict[str, str]] = {
    RAW_INSTRUCTIONS: _INSTRUCTIONS,
    SELECTION_TARGETS: {
        **_INSTRUCTIONS,
        "source_file": "The benchmark or target folder file the sample was read from.",
    },
    PROXY_EMBEDDINGS: {
        "sample_id": _SAMPLE_ID,
        "n_tokens": _N_TOKENS,
        "n_response_tokens": _N_RESPONSE,
        "truncated": "Whether the sample was longer than max_length and cut.",
        "truncation": "What was cut: prompt_start, response_end, both joined by +, or null.",
        "skip_reason": "Why the sample was not embedded (e.g. no_response_tokens); null if it was.",
        "mean_loss": "Mean loss of the base model over the response tokens, nats/token.",
        "embedding": "Gradient proxy e = (1/T) sum_t (p_t - 1) h_t, float32, hidden size long.",
        "hidden_mean": "Mean final hidden state (1/T) sum_t h_t over the response, float32.",
        "embedding_normalised": "embedding / its L2 norm (what k-means clusters by default).",
        "hidden_mean_normalised": "hidden_mean / its L2 norm (representation: hidden_mean).",
    },
    BALANCED_CLUSTERS: {
        "sample_id": _SAMPLE_ID,
        "cluster": _CLUSTER,
        "kmeans_cluster": "The nearest centroid's cluster, before the capacity step.",
        "sq_distance": _SQ_DISTANCE,
    },
    CLUSTER_CENTROIDS: {
        "cluster": "Cluster c (trained on rank c).",
        "centroid": "The cluster's k-means centroid, float32, in the clustered representation.",
        "size": "n_c: samples in the cluster after the capacity step.",
        "kmeans_size": "Samples whose nearest centroid is the cluster's.",
    },
    PERIPHERAL_SUBSETS: {
        "sample_id": _SAMPLE_ID,
        "cluster": _CLUSTER,
        "sq_distance": _SQ_DISTANCE,
        "n_tokens": _N_TOKENS,
        "n_response_tokens": _N_RESPONSE,
        "selection_rank": "0-based place in the selector's order within the cluster (or pool).",
        "selected": "Whether the selector keeps the sample for training.",
        "copies": "Times the sample is trained per epoch (0 when not selected).",
        "weight": _WEIGHT,
        "score": "What the selector's order sorts by (sq_distance for peripheral); null if random.",
    },
    S2L_TRAJECTORIES: {
        "sample_id": _SAMPLE_ID,
        "loss_trajectory": "s2l: the sample's mean loss (nats/token) at each proxy checkpoint.",
    },
    LESS_GRADIENTS: {
        "sample_id": _SAMPLE_ID,
        "gradients": "less: projected LoRA gradients, one block per warm-up checkpoint, float32.",
    },
    SHARD_MANIFESTS: {
        "rank": "The DP rank that trains the entry (= its cluster for clustered selectors).",
        "position": "0-based place in the rank's shard (its order within an epoch).",
        "sample_id": _SAMPLE_ID,
        "weight": "Loss weight w_c of the rank.",
        "manifest_sha256": "sha256 of the rank's JSON manifest; checkpoints name it.",
    },
    EVAL_ITEM_SCORES: {
        "model": "The model evaluated: base, or a run named by group and seeds.",
        "group": "What seeds are averaged over (selector r=ratio), or base.",
        "path": "The model's folder.",
        "metric": "The metric (heldout_loss, humaneval_solution_nll, mbpp_pass@1, ...).",
        "item": "The scored item: held-out sample id, problem id or question number.",
        "weight": "The item's weight in the metric: response tokens, or 1.",
        "value": "The item's score: mean loss in nats/token, 1/0 solved, 1/0 right.",
    },
    SAMPLE_LINEAGE: {
        "sample_id": _SAMPLE_ID,
        "split": "train or heldout (held-out samples stop after raw_instructions).",
        "source_file": "The file the sample was read from.",
        "source_line": "1-based line or row in source_file.",
        "source_index": (
            "0-based place of the record among those of source_file; null for python_stdlib "
            "(its samples are functions of a module, not records of a file)."
        ),
        "n_response_tokens": _N_RESPONSE,
        "mean_loss": "Base model's mean loss over the response tokens, nats/token.",
        "skip_reason": "Why the sample was not embedded; null if it was.",
        "cluster": _CLUSTER,
        "sq_distance": _SQ_DISTANCE,
        "selection_rank": "0-based place in the selector's order.",
        "selected": "Whether the sample was selected for training.",
        "copies": "Times trained per epoch.",
        "weight": _WEIGHT,
        "rank": "The DP rank whose shard holds the sample.",
        "shard_positions": "The sample's positions in that shard (several with copies).",
        "manifest_sha256": "sha256 of that rank's manifest.",
        "checkpoints": "Finished checkpoints trained on that manifest.",
    },
}


def describe(table: str, columns: Iterable[str]) -> dict[str, str]:
    """Column -> description for ``columns`` of ``table``.

    Args:
        table: a table's name (:mod:`cluster_pipeline.storage.names`).
        columns: the columns the table was written with.

    Raises:
        KeyError: ``table`` has no descriptions, or some of ``columns`` none; the message names
            them and this module.
    """
    known = COLUMN_DESCRIPTIONS.get(table)
    if known is None:
        raise KeyError(f"table {table!r} has no column descriptions in {__name__}")
    columns = list(columns)
    missing = [c for c in columns if c not in known]
    if missing:
        raise KeyError(
            f"columns {missing} of table {table!r} have no description: add them to {__name__}"
        )
    return {c: known[c] for c in columns}

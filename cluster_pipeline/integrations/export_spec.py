"""What an export is: the facts of the selection it is made of (:class:`ExportSource`, with the
:class:`Provenance` that repeats it), the columns of its rows (:data:`FEATURES`) and the names
in its folder. The export's file handling (:mod:`~cluster_pipeline.integrations.hf_datasets`)
and its dataset card (:mod:`~cluster_pipeline.integrations.dataset_card`) both read them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cluster_pipeline.storage.tables import TableRef

# One row of an export: name -> (kind, what it holds). Kinds: string, int64, float64 (a
# datasets.Value), messages (a list of {role, content}: TRL's conversational form, what
# apply_chat_template takes) and json_list (a list of JSON objects: datasets.Json).
FEATURES: dict[str, tuple[str, str]] = {
    "sample_id": ("string", "content hash of the sample (raw_instructions)"),
    "rank": ("int64", "data-parallel rank whose shard holds the entry"),
    "position": ("int64", "0-based position in that rank's shard: the order it trains in"),
    "weight": ("float64", "the rank's loss weight w_c (docs/design.md, step 5)"),
    "cluster": ("int64", "the sample's balanced cluster (balanced_clusters)"),
    "system": ("string", "the system prompt; null where the sample has none"),
    "prompt": ("string", "the normalised prompt (earlier turns of a conversation included)"),
    "response": ("string", "the normalised response: the last assistant turn"),
    "messages": (
        "messages",
        "the whole conversation as a list of {role, content} (system, user, assistant, tool): "
        "what the product's trainer renders with the chat template, the response last",
    ),
    "tools": ("json_list", "the function schemas (a list of JSON objects), or null"),
    "tools_json": (
        "string",
        "the same schemas as JSON text, or null (for tools that read them as text, such as "
        "LLaMA-Factory's `tools` column)",
    ),
    "form": ("string", "the input form the record was read in"),
    "source_file": (
        "string",
        "the file the record was read from, relative to the source dataset's folder (the "
        "standard library's folder for python_stdlib)",
    ),
    "source_line": ("int64", "its line (record number for Parquet and Arrow)"),
    "source_index": ("int64", "0-based place among its file's records; null for python_stdlib"),
    "manifest_sha256": ("string", "content hash of the rank's shard manifest"),
}

# The export folder's parts: the save_to_disk folder, the folder of the Parquet files (one
# folder per split, so a tool pointed at a folder reads one split), LLaMA-Factory's dataset
# registry beside them, the card.
DATASET_DICT = "dataset_dict"
DATA_DIR = "data"
LLAMA_FACTORY_INFO = f"{DATA_DIR}/dataset_info.json"
CARD = "README.md"


def split_dir(split: str) -> str:
    """The folder of a split's Parquet files, relative to the export folder: ``data/<split>``."""
    return f"{DATA_DIR}/{split}"


def hf_features(datasets: Any) -> Any:
    """:data:`FEATURES` as ``datasets.Features`` (``datasets``: the imported module)."""
    kinds = {
        "messages": lambda: datasets.List(
            {"role": datasets.Value("string"), "content": datasets.Value("string")}
        ),
        "json_list": lambda: datasets.List(datasets.Json()),
    }
    return datasets.Features(
        {
            name: kinds[kind]() if kind in kinds else datasets.Value(kind)
            for name, (kind, _) in FEATURES.items()
        }
    )


def feature_type(kind: str) -> str:
    """A :data:`FEATURES` kind as the card's column table writes it."""
    return {"messages": "list of {role, content}", "json_list": "list of JSON"}.get(kind, kind)


@dataclass(frozen=True)
class StageSettings:
    """One stage of the selection as it ran: ``settings``, the run-config knobs that shaped the
    selection (names and values as the stage's config takes them); ``outcome``, what it did
    that the selection depends on (samples cut by truncation, the k-means inertia); ``code``,
    the code that ran it (:func:`~cluster_pipeline.storage.provenance.code_identity`; empty:
    not recorded)."""

    settings: dict[str, Any]
    outcome: dict[str, Any] = field(default_factory=dict)
    code: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Provenance:
    """What repeats the selection, from the records of the stages that made it (the CLI gathers
    them): ``stages``, each stage's :class:`StageSettings` in pipeline order; ``source_files``,
    every source file read (relative to the dataset's folder) -> SHA-256; ``source``, what the
    built-in dataset is read from (else ""); ``pool``, what raw_instructions read and kept
    (records read, duplicates, training samples available, the pool N, held out);
    ``base_model``, the model's portable identity (:func:`~cluster_pipeline.models.loading.
    model_identity`); ``run_config``, the Dagster run config of those settings (``ops:
    <stage>: config:``) and the base model, which repeats the selection. Empty where the
    records predate them."""

    stages: dict[str, StageSettings] = field(default_factory=dict)
    source_files: dict[str, str] = field(default_factory=dict)
    source: str = ""
    pool: dict[str, Any] = field(default_factory=dict)
    base_model: dict[str, Any] = field(default_factory=dict)
    run_config: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ExportSource:
    """What an export is made of: the shard manifests as recorded and the facts of the
    selection that made them, with every table at the version the manifests were built from.

    ``tables``: stage -> Delta table version, in pipeline order; must hold ``raw_instructions``
    and ``balanced_clusters`` (rows are read from them); the card lists them all.
    ``lineage_table``: the ``sample_lineage`` version built from these manifests, or None if
    none was. ``cluster_weights``: w_c per cluster; ``manifest_sha256`` and ``manifest_paths``
    per rank, in rank order. ``provenance``: what repeats the selection (empty: not gathered).
    """

    dataset: str
    selector: str
    ratio: float
    selection_seed: int
    num_clusters: int
    alpha: float
    cluster_weights: list[float]
    balance: str
    token_budget: int | None
    pool_size: int
    selected_samples: int
    base_model: str
    manifest_paths: list[str]
    manifest_sha256: list[str]
    manifest_set_sha256: str
    dropped_for_equal_shards: int
    tables: dict[str, TableRef]
    lineage_table: TableRef | None = None
    provenance: Provenance = field(default_factory=Provenance)

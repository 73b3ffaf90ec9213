"""The dataset card of an export (its ``README.md``): the Hub's YAML header (built with
``huggingface_hub.DatasetCardData`` and ``datasets``' own ``dataset_info``: configs, features,
splits and row counts, license, task, size and language) and, in Markdown, the selection, its
splits and columns, a Provenance section with everything needed to repeat it (the code by git
commit, the source files by SHA-256, the pool draw, every stage's settings, the base model's
portable identity, the table versions by number and content hash, the run config), how to load
it in ``datasets``, TRL and LLaMA-Factory, the method's citation and the license. Built from
one typed input (:class:`CardFacts`) by :func:`build_card`; the same facts fill the saved
splits' ``DatasetInfo`` (:func:`dataset_info_fields`) and ``export.json``'s ``selection``
(:func:`card_fields`). Nothing here touches a file, and nothing names a path of this machine:
the export (:mod:`~cluster_pipeline.integrations.hf_datasets`) gathers the facts, with paths
made relative, and writes the text.

What the card says grows here: a new fact is a field of :class:`CardFacts` (or of the
:class:`~cluster_pipeline.integrations.export_spec.ExportSource` and
:class:`~cluster_pipeline.integrations.export_spec.Provenance` it carries) and the lines that
render it.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from typing import Any

from cluster_pipeline.data.datasets import SourceLicense
from cluster_pipeline.data.stdlib_dataset import DATASET_NAME as STDLIB_DATASET
from cluster_pipeline.integrations.export_spec import (
    DATASET_DICT,
    FEATURES,
    LLAMA_FACTORY_INFO,
    ExportSource,
    StageSettings,
    feature_type,
    hf_features,
    split_dir,
)
from cluster_pipeline.models.loading import describe_model
from cluster_pipeline.selection.sharding import ShardManifest
from cluster_pipeline.storage.provenance import describe_code
from cluster_pipeline.storage.tables import markdown_table

METHOD = (
    "CluSTER: Clustering-Based Balanced Sampling and Allocation with Data Parallelism for "
    "High-Performance Fine-Tuning"
)
# The method's citation, from the authors' repository (github.com/kaist-dmlab/CluSTER, README:
# "accepted at EMNLP 2026"). Its README leaves the BibTeX block empty and names no authors, so
# the first author is DESIGN.md's "Kim et al., KAIST" and BibTeX's "and others" stands for the
# co-authors; the code's address is the stable identifier until the proceedings are out.
CITATION = f"""@inproceedings{{kim2026cluster,
  title = {{{{CluSTER}}: {METHOD.removeprefix("CluSTER: ")}}},
  author = {{Kim and others}},
  booktitle = {{Proceedings of EMNLP 2026}},
  year = {{2026}},
  note = {{KAIST}},
  url = {{https://github.com/kaist-dmlab/CluSTER}}
}}"""
# The Hub's size_categories, by row count (huggingface.co/docs/hub/datasets-cards).
_SIZES = [
    (1_000, "n<1K"),
    (10_000, "1K<n<10K"),
    (100_000, "10K<n<100K"),
    (1_000_000, "100K<n<1M"),
    (10_000_000, "1M<n<10M"),
    (100_000_000, "10M<n<100M"),
    (1_000_000_000, "100M<n<1B"),
]
# What a card says of the built-in dataset, which has no card of its own.
STDLIB_METADATA = {"language": ["en"], "source_datasets": ["original"]}
# Keys of the source folder's own card (README.md front matter) that this card carries over.
CARRIED_METADATA = ("language", "source_datasets", "task_categories", "task_ids")


def size_category(rows: int) -> str:
    """The Hub's ``size_categories`` value for ``rows`` examples (``n<1K`` ... ``n>1B``)."""
    return next((name for bound, name in _SIZES if rows < bound), "n>1B")


@dataclass(frozen=True)
class SplitFiles:
    """One split as the export wrote it: ``rows``, ``num_bytes`` (its Arrow data, as
    ``datasets`` counts it) and its Parquet ``files`` (paths relative to the export folder)."""

    rows: int
    num_bytes: int
    files: list[str]


@dataclass(frozen=True)
class CardFacts:
    """Everything a card says.

    Attributes:
        source: the selection's facts, its provenance and the table versions the rows were read
            at.
        manifests: the shard manifests, in rank order (weights, tokens, hashes, seed).
        splits: split -> what was written, ``train`` first, then ``rank_<c>`` for every rank.
        license: the source's declared license, or None (none declared); its ``declared_by``
            already without a local path.
        download_size: bytes of all the Parquet files (what the Hub downloads).
        table_hashes: stage -> SHA-256 of its table version's rows
            (:func:`~cluster_pipeline.storage.provenance.rows_sha256`; vectors left out).
        manifest_files: the manifest files, relative to the data folder.
        metadata: the Hub keys the source's own card declares (:data:`CARRIED_METADATA`).
        exporter: the code that wrote the export
            (:func:`~cluster_pipeline.storage.provenance.code_identity`).
    """

    source: ExportSource
    manifests: list[ShardManifest]
    splits: dict[str, SplitFiles]
    license: SourceLicense | None
    download_size: int
    table_hashes: dict[str, str] = field(default_factory=dict)
    manifest_files: list[str] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    exporter: dict[str, Any] = field(default_factory=dict)


def build_card(facts: CardFacts) -> str:
    """The card's text: ``---``, the YAML header (:func:`card_header`), ``---``, a blank line
    and the Markdown (:func:`card_body`)."""
    import yaml

    header = yaml.safe_dump(card_header(facts), sort_keys=False, allow_unicode=True)
    return f"---\n{header}---\n\n{card_body(facts)}"


def _license_text(license: SourceLicense | None) -> str:
    if license is None:
        return "unknown"
    lic = license.license if isinstance(license.license, str) else ", ".join(license.license)
    return lic + (f" ({license.license_name})" if license.license_name else "")


def card_header(facts: CardFacts) -> dict[str, Any]:
    """The card's YAML header, in the Hub's keys: ``license`` (and ``license_name``,
    ``license_link``), ``language``, ``task_categories``, ``size_categories``,
    ``source_datasets`` (where the source's card or the built-in dataset says them),
    ``pretty_name``, ``tags``, ``configs`` with each split's folder, and ``dataset_info`` with
    features, splits' ``num_examples`` and sizes, as ``huggingface_hub.DatasetCardData`` and
    ``datasets.DatasetInfosDict`` write them for ``push_to_hub``."""
    import datasets
    from datasets.info import DatasetInfosDict
    from datasets.splits import SplitDict, SplitInfo
    from huggingface_hub import DatasetCardData

    source, splits, license = facts.source, facts.splits, facts.license
    meta = {"task_categories": ["text-generation"], **facts.metadata}
    extra: dict[str, Any] = {}
    if license is not None:
        if license.license_name:
            extra["license_name"] = license.license_name
        if license.license_link:
            extra["license_link"] = license.license_link
    data = DatasetCardData(
        license=license.license if license is not None else None,
        language=meta.get("language"),
        task_categories=meta["task_categories"],
        task_ids=meta.get("task_ids"),
        size_categories=[size_category(splits["train"].rows)],
        source_datasets=meta.get("source_datasets"),
        pretty_name=f"{source.dataset}: {source.selector} selection, K = {source.num_clusters}",
        tags=["cluster-pipeline", "data-selection", "sft"],
        configs=[
            {
                "config_name": "default",
                "data_files": [
                    {"split": name, "path": f"{split_dir(name)}/*.parquet"} for name in splits
                ],
            }
        ],
        **extra,
    )
    split_dict = SplitDict()
    for name, s in splits.items():
        split_dict.add(SplitInfo(name, num_bytes=s.num_bytes, num_examples=s.rows))
    info = datasets.DatasetInfo(
        features=hf_features(datasets),
        splits=split_dict,
        download_size=facts.download_size,
        dataset_size=sum(s.num_bytes for s in splits.values()),
    )
    DatasetInfosDict({"default": info}).to_dataset_card_data(data)
    return data.to_dict()


def dataset_info_fields(source: ExportSource, license: SourceLicense | None) -> dict[str, str]:
    """``description``, ``citation`` and ``license`` for the saved splits' ``DatasetInfo``
    (what ``ds.info`` shows after ``load_from_disk``): the card's opening paragraph with the
    selection's facts, the method's BibTeX, the license id."""
    description = (
        f"The samples of dataset {source.dataset!r} selected with {METHOD} (Kim et al., "
        f"KAIST) by cluster_pipeline: selector {source.selector}, ratio r = {source.ratio:g}, "
        f"K = {source.num_clusters} clusters = data-parallel ranks, capacity alpha = "
        f"{source.alpha:g}, balance by {source.balance}; {source.selected_samples:,} of a pool "
        f"of {source.pool_size:,} training samples; manifest set "
        f"{source.manifest_set_sha256}. Split rank_<c> is rank c's shard in training order, "
        "its loss multiplied by the row's weight w_c; train is every shard entry. The card "
        "(README.md) holds the provenance."
    )
    return {"description": description, "citation": CITATION, "license": _license_text(license)}


def card_fields(facts: CardFacts) -> dict[str, Any]:
    """The card's facts as a flat mapping (JSON values), for ``export.json``'s ``selection``
    and for a training run's trackers (:class:`~cluster_pipeline.integrations.hf_trainer.
    SelectionCallback`): dataset, selector, ratio, K, alpha, balance, the weights, pool and
    subset sizes, the seeds, the manifest hashes, the base model, the code and the license."""
    source, manifests = facts.source, facts.manifests
    prov = source.provenance
    selection_code = prov.stages.get("peripheral_subsets", StageSettings({})).code
    return {
        "dataset": source.dataset,
        "selector": source.selector,
        "ratio": source.ratio,
        "num_clusters": source.num_clusters,
        "alpha": source.alpha,
        "balance": source.balance,
        "token_budget": source.token_budget,
        "cluster_weights": list(source.cluster_weights),
        "rank_weights": [m.weight for m in manifests],
        "pool_size": source.pool_size,
        "selected_samples": source.selected_samples,
        "selection_seed": source.selection_seed,
        "shard_order_seed": manifests[0].seed,
        "manifest_set_sha256": source.manifest_set_sha256,
        "manifest_sha256": [m.sha256 for m in manifests],
        "base_model": describe_model(prov.base_model).replace("`", ""),
        "code": describe_code(selection_code),
        "git_commit": selection_code.get("git_commit"),
        "license": _license_text(facts.license),
    }


def _weights(values: list[float]) -> str:
    return ", ".join(f"{w:.4f}" for w in values)


def _value(value: Any) -> str:
    """A setting's value as the run config writes it (null, true, JSON lists), in code marks."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return f"`{text}`"


def _provenance(facts: CardFacts) -> str:
    """The Provenance section's Markdown (module docstring)."""
    import yaml

    source, prov = facts.source, facts.source.provenance
    d = source.dataset
    parts = []
    selection_code = prov.stages.get("peripheral_subsets", StageSettings({})).code
    parts.append(
        f"**Code.** Selected by {describe_code(selection_code)}; exported by "
        f"{describe_code(facts.exporter)}."
    )
    if prov.source:
        parts.append(f"**Source.** `{d}` is read from the {prov.source}.")
    elif prov.source_files:
        rows = [(f"`{name}`", f"`{sha}`") for name, sha in prov.source_files.items()]
        parts.append(
            f"**Source.** The files read from the dataset's folder (`data/raw/{d}/`):\n\n"
            + markdown_table(["file", "sha256"], rows)
        )
    else:
        parts.append("**Source.** Not recorded (the selection predates source hashes).")
    pool, raw = prov.pool, prov.stages.get("raw_instructions")
    if pool and raw is not None:
        s = raw.settings
        cap = s.get("max_train_samples")
        n, left = pool.get("train_samples", source.pool_size), pool.get("train_available")
        if cap is None:
            drawn = "all of them (`max_train_samples: null`)"
        elif left is not None and n == left:  # the cap drew nothing
            drawn = f"all of them (no more than `max_train_samples: {cap}`)"
        else:
            drawn = f"a seeded draw (`seed: {s.get('seed')}`) of `max_train_samples: {cap}`"
        if source.pool_size != n:  # the embedding pass skipped some (its outcome says why)
            drawn += (
                f"; {source.pool_size:,} of them were embedded and clustered, the pool the "
                "selection drew from (`proxy_embeddings` below says why the others were not)"
            )
        parts.append(
            f"**Pool.** {pool.get('records_read', '?'):,} records read, "
            f"{pool.get('duplicates_dropped', 0):,} duplicates dropped; a held-out split of "
            f"{pool.get('heldout_samples', '?'):,} samples set aside first "
            f"(`heldout_fraction: {s.get('heldout_fraction')}`, `max_heldout: "
            f"{s.get('max_heldout')}`, `seed: {s.get('seed')}`), never selected from; of the "
            f"{'?' if left is None else f'{left:,}'} training samples left, the pool N = "
            f"{n:,} is {drawn}."
        )
    parts.append(f"**Base model** (embedding pass): {describe_model(prov.base_model)}.")
    stage_tables = []
    for stage, st in prov.stages.items():
        rows = [(f"`{k}`", _value(v)) for k, v in st.settings.items()]
        rows += [(k, "none" if v == {} else _value(v)) for k, v in st.outcome.items()]
        stage_tables.append(f"`{stage}`:\n\n" + markdown_table(["setting", "value"], rows))
    if stage_tables:
        parts.append(
            "**Settings.** Every stage's settings that shaped the selection, as its run config "
            "names them (below them, what the stage did):\n\n" + "\n\n".join(stage_tables)
        )
    tables = [
        (
            stage,
            str(t.version),
            f"`{facts.table_hashes[stage]}`" if stage in facts.table_hashes else "-",
        )
        for stage, t in source.tables.items()
    ]
    if source.lineage_table is not None:
        tables.append(("sample_lineage", str(source.lineage_table.version), "-"))
    else:
        tables.append(("sample_lineage", "not built from these manifests", "-"))
    parts.append(
        "**Tables.** Every row was read at these Delta table versions, the ones the shard "
        "manifests were built from (content sha256: of the version's rows sorted, one line of "
        "JSON each, the embedding vectors left out; storage/provenance.py `rows_sha256`):\n\n"
        + markdown_table(["stage", "version", "content sha256"], tables)
    )
    if facts.manifest_files:
        files = ", ".join(f"`{p}`" for p in facts.manifest_files)
        parts.append(f"**Manifests**, by content hash in the Splits table: {files}.")
    if prov.run_config:
        config = yaml.safe_dump(prov.run_config, sort_keys=False, allow_unicode=True)
        stages = ",".join(prov.run_config.get("ops", {}))
        # As a shell reads it: a name with spaces or quotes stays one word.
        again = shlex.join(["cluster-pipeline", "rerun", "run_config.yaml", "--dataset", d])
        # The built-in dataset is read from the running interpreter's standard library, not
        # from a folder (data/stdlib_dataset.py): the same Python version gives the same pool.
        sources = (
            "the same Python version (the pool is its standard library)"
            if d == STDLIB_DATASET
            else f"the source files above in `data/raw/{d}/`"
        )
        parts.append(
            f"**Repeat it.** With the code at that commit and {sources}, this run config "
            "repeats the selection: save it as "
            f"`run_config.yaml` and run `{again}` "
            f"(it materializes {stages} for partition `{d}`).\n\n```yaml\n{config}```"
        )
    return "\n\n".join(parts)


def card_body(facts: CardFacts) -> str:
    """The card's Markdown: the selection's knobs and facts, the splits, the columns, the
    provenance, how to load it (``datasets``, TRL, LLaMA-Factory), the citation and the
    license."""
    source, manifests, splits, license = facts.source, facts.manifests, facts.splits, facts.license
    d, k = source.dataset, source.num_clusters
    export = shlex.join(["cluster-pipeline", "export", d])
    budget = f" (budget {source.token_budget:,} tokens per cluster)" if source.token_budget else ""
    selection = [
        ("selector", f"`{source.selector}`"),
        ("ratio r", f"{source.ratio:g}"),
        ("balance", f"{source.balance}{budget}"),
        ("K (clusters = data-parallel ranks)", str(source.num_clusters)),
        ("capacity alpha", f"{source.alpha:g}"),
        (
            "cluster weights w_c = K R_c / R (R_c: the cluster's response tokens)"
            if source.balance == "tokens"
            else "cluster weights w_c = n_c K / N",
            _weights(source.cluster_weights),
        ),
        ("rank weights (loss multipliers)", _weights([m.weight for m in manifests])),
        (
            "selected",
            f"{source.selected_samples:,} of a pool of {source.pool_size:,} training samples",
        ),
        ("base model (proxy embeddings)", describe_model(source.provenance.base_model)),
        ("selection seed, shard order seed", f"{source.selection_seed}, {manifests[0].seed}"),
    ]
    if source.dropped_for_equal_shards:
        selection.append(("dropped to make shards equal", str(source.dropped_for_equal_shards)))
    known = any(m.tokens for m in manifests)

    def tokens(n: int) -> str:
        return f"{n:,}" if known else "-"

    split_rows_ = [
        (
            "train",
            f"`{split_dir('train')}/`",
            f"{splits['train'].rows:,}",
            tokens(sum(m.tokens for m in manifests)),
            "per row",
            f"set `{source.manifest_set_sha256}`",
        )
    ] + [
        (
            f"rank_{m.rank}",
            f"`{split_dir(f'rank_{m.rank}')}/`",
            f"{splits[f'rank_{m.rank}'].rows:,}",
            tokens(m.tokens),
            f"{m.weight:.4f}",
            f"`{m.sha256}`",
        )
        for m in manifests
    ]
    if license is None:
        license_text = (
            f"The source declares no license (no `license:` in the front matter of "
            f"`data/raw/{d}/README.md`, no `LICENSE` file there). Check the source's terms "
            "before sharing this dataset."
        )
    else:
        shipped = f" Its text is in `{license.file.name}` beside this card." if license.file else ""
        license_text = (
            f"`{license.license}`"
            + (f" ({license.license_name})" if license.license_name else "")
            + f", as declared by {license.declared_by}.{shipped}"
        )
    splits_doc = ", ".join(f"`{name}`" for name in splits)
    title = f"{d}: the selected subset ({source.selector}, r = {source.ratio:g}, K = {k})"
    columns = [(f"`{n}`", feature_type(t), w) for n, (t, w) in FEATURES.items()]
    return f"""# {title}

The samples of dataset `{d}` that cluster_pipeline selected with CluSTER (*{METHOD}*, Kim et
al., KAIST) and allocated to {k} data-parallel ranks, exported by `{export}`
from its shard manifests.

Splits: {splits_doc}. `rank_<c>` is rank c's shard in the order rank c trains on it;
`train` is every shard entry, rank by rank (a sample selected with copies appears once per
copy). To train the way the pipeline does, rank c trains on `rank_<c>` in order with its loss
multiplied by the rank's `weight` w_c: under data-parallel averaging the update is then the
stratified estimate of the whole pool's gradient (docs/design.md, steps 4 and 5).

## Selection

{markdown_table(["", ""], selection)}

## Splits

{markdown_table(["split", "files", "rows", "tokens", "weight", "manifest sha256"], split_rows_)}

Tokens: each sample as the embedding pass encoded it (chat template included, after
truncation), summed; `-` where the manifests do not record them. Each split's Parquet files
sit in a folder of their own, so a tool pointed at one folder reads one split.

## Columns

{markdown_table(["column", "type", "what"], columns)}

## Provenance

{_provenance(facts)}

## Load it

```python
from datasets import load_dataset, load_from_disk

export = "path/to/this/folder"
splits = load_from_disk(f"{{export}}/{DATASET_DICT}")  # a DatasetDict: {splits_doc}
splits = load_dataset(export)  # the same, from the Parquet files this card's header names
rank_0 = load_dataset("parquet", data_dir=f"{{export}}/{split_dir("rank_0")}")["train"]
```

`messages` is TRL's conversational form: `SFTTrainer` trains on
`splits["train"].select_columns(["messages"])` (add `"tools"` where samples have function
schemas) as it is. To train rank by rank with the weights, as the pipeline does:
cluster_pipeline's `ClusterShards.from_export` and `ClusterTrainer` (docs/guide/
your-own-trainer.md). LLaMA-Factory reads `{LLAMA_FACTORY_INFO}`: with `dataset_dir:
<export>/data`, `dataset: {d}` trains on `train` in its sharegpt form (`messages`), `{d}_alpaca`
in its alpaca form (`prompt`, `response`, `system`); it trains on the subset without the
rank allocation and weights.

To publish it on the Hub, upload `README.md`, `data/` and the license file, if any;
`{DATASET_DICT}/` and `export.json` serve this machine. `{DATASET_DICT}/` and `data/` hold the
same rows, and `export.json` records the SHA-256 of every file; `ClusterShards.from_export`
trains from `{DATASET_DICT}/` after checking them all. `system` is null where a sample has no
system prompt.

## Citation

The selection method:

```bibtex
{CITATION}
```

## License

{license_text}
"""

"""The dataset card built from its typed input alone, no file written: the Hub's header (read
back by ``huggingface_hub.DatasetCard`` and ``datasets``' own parser), and the selection's
facts, splits, provenance, citation and license in the Markdown."""

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster_pipeline.data.datasets import SourceLicense
from cluster_pipeline.integrations.dataset_card import (
    CITATION,
    CardFacts,
    SplitFiles,
    build_card,
    card_fields,
    dataset_info_fields,
    size_category,
)
from cluster_pipeline.integrations.export_spec import (
    FEATURES,
    ExportSource,
    Provenance,
    StageSettings,
)
from cluster_pipeline.selection.sharding import ShardManifest, content_sha256
from cluster_pipeline.storage.tables import TableRef

COMMIT = "1e3e7ca" + "0" * 33
RUN_CONFIG = {
    "ops": {
        "raw_instructions": {"config": {"heldout_fraction": 0.1, "seed": 4}},
        "balanced_clusters": {"config": {"num_clusters": 2, "restarts": 10}},
    },
    "resources": {"base_model": {"config": {"model": "HuggingFaceTB/SmolLM2-135M-Instruct"}}},
}


def _provenance() -> Provenance:
    code = {"package": "cluster_pipeline", "version": "0.1.0", "git_commit": COMMIT}
    return Provenance(
        stages={
            "raw_instructions": StageSettings(
                {"heldout_fraction": 0.1, "max_heldout": 100, "max_train_samples": 8, "seed": 4}
            ),
            "proxy_embeddings": StageSettings(
                {"max_length": 64, "truncation": "left"},
                {"samples cut by truncation": {"response_end": 3}},
            ),
            "balanced_clusters": StageSettings(
                {"num_clusters": 2, "seed": 0, "niter": 300, "restarts": 10}
            ),
            "peripheral_subsets": StageSettings(
                {"selector": "peripheral", "ratio": 0.5}, code={**code, "git_dirty": True}
            ),
        },
        source_files={"samples.jsonl": "ab" * 32},
        pool={
            "records_read": 12,
            "duplicates_dropped": 1,
            "heldout_samples": 1,
            "train_available": 10,
            "train_samples": 8,
        },
        base_model={"hub_id": "HuggingFaceTB/SmolLM2-135M-Instruct", "revision": "c" * 40},
        run_config=RUN_CONFIG,
    )


def _facts(license: SourceLicense | None, balance: str = "tokens", train_rows: int = 4):
    manifests = [
        ShardManifest("tiny", rank, 2, "peripheral", weight, 7, ids, tokens)
        for rank, weight, ids, tokens in (
            (0, 0.75, ("a", "b"), 300),
            (1, 1.25, ("c", "d"), 500),
        )
    ]
    source = ExportSource(
        dataset="tiny",
        selector="peripheral",
        ratio=0.5,
        selection_seed=3,
        num_clusters=2,
        alpha=1.5,
        cluster_weights=[0.75, 1.25],
        balance=balance,
        token_budget=400 if balance == "tokens" else None,
        pool_size=8,
        selected_samples=4,
        base_model="tiny-model",
        manifest_paths=["/m/rank_0.json", "/m/rank_1.json"],
        manifest_sha256=[m.sha256 for m in manifests],
        manifest_set_sha256="set123",
        dropped_for_equal_shards=1,
        tables={
            "raw_instructions": TableRef("/t/raw", 4),
            "balanced_clusters": TableRef("/t/bc", 2),
        },
        lineage_table=None,
        provenance=_provenance(),
    )
    splits = {
        "train": SplitFiles(train_rows, 1000, ["data/train/train-00000-of-00001.parquet"]),
        "rank_0": SplitFiles(2, 480, ["data/rank_0/rank_0-00000-of-00001.parquet"]),
        "rank_1": SplitFiles(2, 520, ["data/rank_1/rank_1-00000-of-00001.parquet"]),
    }
    return CardFacts(
        source,
        manifests,
        splits,
        license,
        download_size=4321,
        table_hashes={"raw_instructions": "f" * 64},
        manifest_files=["data/shards/tiny/set/rank_0.json", "data/shards/tiny/set/rank_1.json"],
        metadata={"language": ["de"]},
        exporter={"package": "cluster_pipeline", "version": "0.1.0", "git_commit": COMMIT},
    )


def _split(card: str) -> tuple[dict, str]:
    assert card.startswith("---\n")
    header, body = card[4:].split("\n---\n\n", 1)
    return yaml.safe_load(header), body


@pytest.mark.parametrize(
    ("rows", "category"),
    [(0, "n<1K"), (999, "n<1K"), (1000, "1K<n<10K"), (99_999, "10K<n<100K"), (10**9, "n>1B")],
)
def test_the_size_category_is_the_hubs_bucket_of_the_row_count(rows, category):
    assert size_category(rows) == category


def test_the_header_says_what_the_hub_reads():
    import datasets
    from datasets.info import DatasetInfosDict
    from huggingface_hub import DatasetCard

    from cluster_pipeline.integrations.export_spec import hf_features

    mit = SourceLicense("mit", None, None, Path("/raw/tiny/LICENSE"), "`data/raw/tiny/LICENSE`")
    text = build_card(_facts(mit, train_rows=1500))
    header, _ = _split(text)
    assert header["license"] == "mit" and "license_name" not in header
    assert header["pretty_name"] == "tiny: peripheral selection, K = 2"
    assert header["task_categories"] == ["text-generation"]
    assert header["size_categories"] == ["1K<n<10K"]  # the train split's 1,500 rows
    assert header["language"] == ["de"]  # the source's card said so
    assert header["configs"] == [
        {
            "config_name": "default",
            "data_files": [
                {"split": "train", "path": "data/train/*.parquet"},
                {"split": "rank_0", "path": "data/rank_0/*.parquet"},
                {"split": "rank_1", "path": "data/rank_1/*.parquet"},
            ],
        }
    ]
    info = header["dataset_info"]
    assert [f["name"] for f in info["features"]] == list(FEATURES)
    messages = next(f for f in info["features"] if f["name"] == "messages")
    assert messages["list"] == [
        {"name": "role", "dtype": "string"},
        {"name": "content", "dtype": "string"},
    ]
    assert next(f for f in info["features"] if f["name"] == "tools")["list"] == "json"
    assert info["splits"] == [
        {"name": "train", "num_bytes": 1000, "num_examples": 1500},
        {"name": "rank_0", "num_bytes": 480, "num_examples": 2},
        {"name": "rank_1", "num_bytes": 520, "num_examples": 2},
    ]
    assert info["download_size"] == 4321 and info["dataset_size"] == 1000 + 480 + 520

    # The Hub's own parser reads the header (huggingface_hub, offline) ...
    card = DatasetCard(text)
    data: Any = card.data  # huggingface_hub types it as its class attribute
    assert data.license == "mit" and data.task_categories == ["text-generation"]
    assert data.size_categories == ["1K<n<10K"]
    assert data.configs == header["configs"]
    assert card.text.lstrip().startswith("# tiny: the selected subset")
    # ... and datasets' own reads back its features and row counts.
    infos = DatasetInfosDict.from_dataset_card_data(data)
    assert infos["default"].features == hf_features(datasets)
    splits = infos["default"].splits
    assert splits is not None
    assert {n: s.num_examples for n, s in splits.items()} == {
        "train": 1500,
        "rank_0": 2,
        "rank_1": 2,
    }


def test_the_body_tells_the_selection_its_splits_and_license():
    _, body = _split(build_card(_facts(None)))
    assert body.startswith("# tiny: the selected subset (peripheral, r = 0.5, K = 2)\n")
    assert "| balance | tokens (budget 400 tokens per cluster) |" in body
    assert "| cluster weights w_c = K R_c / R (R_c: the cluster's response tokens) | 0.7500, " in (
        body
    )
    assert "| selected | 4 of a pool of 8 training samples |" in body
    assert "| selection seed, shard order seed | 3, 7 |" in body
    assert "| dropped to make shards equal | 1 |" in body
    assert "| train | `data/train/` | 4 | 800 | per row | set `set123` |" in body
    sha = content_sha256(("c", "d"), 1.25)
    assert f"| rank_1 | `data/rank_1/` | 2 | 500 | 1.2500 | `{sha}` |" in body
    assert "The source declares no license" in body
    _, sample_body = _split(build_card(_facts(None, balance="samples")))
    assert "| cluster weights w_c = n_c K / N | 0.7500, 1.2500 |" in sample_body


def test_the_provenance_repeats_the_selection():
    _, body = _split(build_card(_facts(None)))
    provenance = body.split("## Provenance\n", 1)[1].split("\n## ", 1)[0]
    assert (
        f"**Code.** Selected by cluster_pipeline 0.1.0, git commit {COMMIT} with uncommitted "
        f"changes; exported by cluster_pipeline 0.1.0, git commit {COMMIT}."
    ) in provenance
    assert f"| `samples.jsonl` | `{'ab' * 32}` |" in provenance
    assert (
        "**Pool.** 12 records read, 1 duplicates dropped; a held-out split of 1 samples set "
        "aside first (`heldout_fraction: 0.1`, `max_heldout: 100`, `seed: 4`), never selected "
        "from; of the 10 training samples left, the pool N = 8 is a seeded draw (`seed: 4`) of "
        "`max_train_samples: 8`."
    ) in provenance
    assert (
        f"**Base model** (embedding pass): `HuggingFaceTB/SmolLM2-135M-Instruct` at revision "
        f"`{'c' * 40}`."
    ) in provenance
    for line in (
        "| `max_length` | `64` |",
        "| `truncation` | `left` |",
        '| samples cut by truncation | `{"response_end": 3}` |',
        "| `restarts` | `10` |",
        "| `niter` | `300` |",
        f"| raw_instructions | 4 | `{'f' * 64}` |",
        "| balanced_clusters | 2 | - |",
        "| sample_lineage | not built from these manifests | - |",
    ):
        assert line in provenance, line
    assert "`data/shards/tiny/set/rank_0.json`" in provenance
    assert "cluster-pipeline rerun run_config.yaml --dataset tiny" in provenance
    assert "With the code at that commit and the source files above in `data/raw/tiny/`" in (
        provenance
    )
    config = provenance.split("```yaml\n", 1)[1].split("```", 1)[0]
    assert yaml.safe_load(config) == RUN_CONFIG
    # The built-in dataset is no folder: the same Python version gives its pool (issue 44's
    # trial: the card told a user to put its files in data/raw/python_stdlib/).
    facts = _facts(None)
    stdlib = replace(facts, source=replace(facts.source, dataset="python_stdlib"))
    _, body = _split(build_card(stdlib))
    assert (
        "**Repeat it.** With the code at that commit and the same Python version (the pool is "
        "its standard library), this run config repeats the selection"
    ) in body
    repeat = body.split("**Repeat it.**", 1)[1].split("```", 1)[0]
    assert "data/raw/" not in repeat
    # No URI of a table: they name folders of the machine that made them.
    assert "/t/raw" not in body and "/m/rank_0.json" not in body


def test_the_citation_and_the_info_fields_name_the_method():
    _, body = _split(build_card(_facts(None)))
    assert f"## Citation\n\nThe selection method:\n\n```bibtex\n{CITATION}\n```" in body
    assert CITATION.startswith("@inproceedings{kim2026cluster,")
    assert "author = {Kim and others}" in CITATION and "note = {KAIST}" in CITATION
    assert "year = {2026}" in CITATION and "booktitle = {Proceedings of EMNLP 2026}" in CITATION
    assert "url = {https://github.com/kaist-dmlab/CluSTER}" in CITATION
    assert "Clustering-Based Balanced Sampling and Allocation" in CITATION
    cc = SourceLicense("cc-by-4.0", None, None, None, "the front matter")
    fields = dataset_info_fields(_facts(cc).source, cc)
    assert fields["citation"] == CITATION and fields["license"] == "cc-by-4.0"
    assert fields["description"].startswith(
        "The samples of dataset 'tiny' selected with CluSTER: Clustering-Based Balanced "
        "Sampling and Allocation with Data Parallelism for High-Performance Fine-Tuning (Kim "
        "et al., KAIST) by cluster_pipeline: selector peripheral, ratio r = 0.5, K = 2"
    )
    assert "manifest set set123" in fields["description"]
    assert dataset_info_fields(_facts(None).source, None)["license"] == "unknown"


def test_the_card_fields_are_flat_json_values():
    import json

    fields = card_fields(_facts(None))
    assert json.loads(json.dumps(fields)) == fields
    assert fields["manifest_set_sha256"] == "set123"
    assert fields["rank_weights"] == [0.75, 1.25]
    assert fields["git_commit"] == COMMIT
    assert fields["base_model"] == (f"HuggingFaceTB/SmolLM2-135M-Instruct at revision {'c' * 40}")


@pytest.mark.parametrize(
    ("available", "drawn", "embedded", "says"),
    [
        (10, 8, 8, "is a seeded draw (`seed: 4`) of `max_train_samples: 8`."),
        (8, 8, 8, "is all of them (no more than `max_train_samples: 8`)."),
        (
            8,
            8,
            7,
            "is all of them (no more than `max_train_samples: 8`); 7 of them were embedded and "
            "clustered, the pool the selection drew from (`proxy_embeddings` below says why the "
            "others were not).",
        ),
    ],
)
def test_the_pool_sentence_says_whether_the_cap_drew_and_what_was_clustered(
    available, drawn, embedded, says
):
    facts = _facts(None)
    pool = {**facts.source.provenance.pool, "train_available": available, "train_samples": drawn}
    provenance = replace(facts.source.provenance, pool=pool)
    facts = replace(facts, source=replace(facts.source, pool_size=embedded, provenance=provenance))
    _, body = _split(build_card(facts))
    assert f"of the {available} training samples left, the pool N = {drawn} {says}" in body


def test_an_empty_count_reads_none():
    facts = _facts(None)
    stages = dict(facts.source.provenance.stages)
    stages["proxy_embeddings"] = replace(
        stages["proxy_embeddings"], outcome={"samples cut by truncation": {}}
    )
    provenance = replace(facts.source.provenance, stages=stages)
    _, body = _split(
        build_card(replace(facts, source=replace(facts.source, provenance=provenance)))
    )
    assert "| samples cut by truncation | none |" in body
    assert "| `max_length` | `64` |" in body  # settings as the run config writes them

"""Stage 0: read one dataset partition into a Delta table and set aside the held-out split."""

import time
from pathlib import Path

import dagster as dg

from cluster_pipeline.data.datasets import (
    STDLIB_DATASET,
    build_instruction_table,
    load_samples,
    source_fingerprint,
)
from cluster_pipeline.data.formats import FIELDS_CONFIG_NAME, DatasetFormatError, not_read_warning
from cluster_pipeline.data.stdlib_dataset import source_description
from cluster_pipeline.defs.configs import RawInstructionsConfig
from cluster_pipeline.defs.metadata import table_display
from cluster_pipeline.defs.records import RawInstructionsRecord
from cluster_pipeline.defs.resources import StorageResource
from cluster_pipeline.defs.stages import stage_asset
from cluster_pipeline.evaluation.suites import dataset_benchmarks
from cluster_pipeline.storage.names import RAW_INSTRUCTIONS
from cluster_pipeline.storage.provenance import code_identity, files_sha256
from cluster_pipeline.storage.tables import content_digest, mean_of, write_table


def _relative(path: str, folder: Path) -> str:
    try:
        return str(Path(path).relative_to(folder))
    except ValueError:
        return path


@stage_asset("ingest", kinds={"polars", "deltalake"})
def raw_instructions(
    context: dg.AssetExecutionContext, config: RawInstructionsConfig, storage: StorageResource
) -> dg.MaterializeResult:
    """One row per distinct sample of the dataset: ``sample_id`` (content hash), ``split``
    (``train`` or ``heldout``), ``system``/``prompt``/``response``, ``messages`` (the kept
    conversation, JSON) and ``tools`` (function schemas, JSON; null when none), and the
    ``source_file``, 1-based ``source_line`` and 0-based ``source_index`` (its place among the
    file's records) it was read from. Duplicates (same content)
    keep their first source. Metadata counts the turns and fields the reader did not keep
    (``dropped_turns``, ``dropped_fields``) and names the files of the folder it did not read
    (``files_not_read``: other formats, logged as a warning).
    """
    dataset, layout = context.partition_key, storage.layout
    start = time.perf_counter()
    try:
        # Fail here, not after training, on a dataset's bad eval.json.
        benchmarks = dataset_benchmarks(dataset, layout.raw_dir)
        frame, stats = build_instruction_table(
            load_samples(dataset, layout.raw_dir),
            heldout_fraction=config.heldout_fraction,
            max_heldout=config.max_heldout,
            max_train=config.max_train_samples,
            seed=config.seed,
        )
    except (DatasetFormatError, FileNotFoundError, ValueError) as e:
        raise dg.Failure(description=f"dataset {dataset!r}: {e}") from e
    table = write_table(frame, layout.table_uri(RAW_INSTRUCTIONS, dataset), guard=storage.guard)
    folder = layout.raw_dir / dataset
    not_read, warning = not_read_warning(dataset, folder)
    if warning:
        context.log.warning(warning)
    # The source's identity: the interpreter for the built-in dataset, else every file read and
    # the field mapping that shaped the reading, by SHA-256.
    stdlib = dataset == STDLIB_DATASET
    fields = [f for f in (folder / FIELDS_CONFIG_NAME,) if f.is_file()]
    source_files = {} if stdlib else files_sha256([*stats.records_per_file, *fields], folder)
    forms = frame.group_by("form").len().sort("form")
    context.log.info(
        f"{dataset}: {stats.records} records, {stats.duplicates} duplicates, "
        f"{stats.train} train (of {stats.train_available}), {stats.heldout} held out; not "
        f"kept: turns {stats.dropped_turns or 'none'}; fields not in the table (s2l and "
        f"balanced_random read `source`/`dataset` from the files): {stats.dropped_fields or 'none'}"
    )
    record = RawInstructionsRecord(
        table=table,
        seconds=round(time.perf_counter() - start, 3),
        source_fingerprint=source_fingerprint(dataset, layout.raw_dir),
        records_read=stats.records,
        duplicates_dropped=stats.duplicates,
        train_samples=stats.train,
        train_available=stats.train_available,
        heldout_samples=stats.heldout,
        forms=dict(zip(forms["form"], forms["len"], strict=True)),
        benchmarks=list(benchmarks),
        mean_response_chars=round(mean_of(frame["response"].str.len_chars()), 1),
        records_per_file={
            _relative(f, layout.raw_dir / dataset): n for f, n in stats.records_per_file.items()
        },
        dropped_turns=stats.dropped_turns,
        dropped_fields=stats.dropped_fields,
        samples_with_tools=int(frame["tools"].is_not_null().sum()),
        files_not_read=not_read,
        config=config.model_dump(mode="json"),
        code=code_identity(),
        source_files=source_files,
        source=source_description() if stdlib else "",
    )
    return dg.MaterializeResult(
        metadata={
            **record.to_metadata(),
            **table_display(
                frame,
                RAW_INSTRUCTIONS,
                ["sample_id", "split", "prompt", "source_file", "source_line"],
            ),
        },
        # The same rows read again (unchanged files) are no update for the selection chain.
        data_version=dg.DataVersion(content_digest(frame, frame.columns)),
    )

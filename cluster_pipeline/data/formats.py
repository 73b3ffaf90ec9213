"""Reading instruction datasets in the common public forms into samples: the names the rest of
the project imports, from the modules that hold them (docs/design.md, "Reading datasets").

- :mod:`cluster_pipeline.data.samples`: the normalised :class:`Sample`, its content hash and
  :class:`DatasetFormatError`;
- :mod:`cluster_pipeline.data.forms`: the record forms (Alpaca, instruction/response,
  Magicoder, TRL prompt/completion, ShareGPT, OpenAI messages, text), one class each, and
  :func:`normalise_record`;
- :mod:`cluster_pipeline.data.readers`: the file readers (JSON, JSON Lines, Parquet, Arrow),
  one class each, :func:`iter_file_records` and :func:`empty_file_reason`;
- :mod:`cluster_pipeline.data.folders`: which files of a dataset folder are read, its
  ``fields.json``, and :func:`read_dataset_folder`.
"""

from cluster_pipeline.data.folders import (
    CARD_NAME,
    EVAL_CONFIG_NAME,
    HF_METADATA_NAMES,
    LICENSE_NAMES,
    compressed_files,
    compressed_note,
    data_files,
    ignored_files,
    not_read_warning,
    read_dataset_folder,
    read_fields,
)
from cluster_pipeline.data.forms import (
    FIELD_NAMES,
    FIELDS_CONFIG_NAME,
    FORMS,
    normalise_record,
    rename_fields,
)
from cluster_pipeline.data.readers import (
    SUPPORTED_SUFFIXES,
    empty_file_reason,
    iter_file_records,
)
from cluster_pipeline.data.samples import (
    DatasetFormatError,
    Sample,
    conversation,
    json_type,
    sample_id,
)

__all__ = [
    "CARD_NAME",
    "EVAL_CONFIG_NAME",
    "FIELDS_CONFIG_NAME",
    "FIELD_NAMES",
    "FORMS",
    "HF_METADATA_NAMES",
    "LICENSE_NAMES",
    "SUPPORTED_SUFFIXES",
    "DatasetFormatError",
    "Sample",
    "compressed_files",
    "compressed_note",
    "conversation",
    "data_files",
    "empty_file_reason",
    "ignored_files",
    "not_read_warning",
    "iter_file_records",
    "json_type",
    "normalise_record",
    "read_dataset_folder",
    "read_fields",
    "rename_fields",
    "sample_id",
]

r"""JSON Lines files: one JSON object per non-blank line (lines end at ``\n`` only)."""

from __future__ import annotations

from cluster_pipeline.data import json_text
from cluster_pipeline.data.readers.base import JsonTextReader


class JsonLinesReader(JsonTextReader):
    """Every non-blank line, numbered from 1."""

    name = "JSON Lines"
    suffix = ".jsonl"
    listed = 20
    parse = json_text.iter_lines
    hint = (
        "Each line of a .jsonl file must be one JSON object (a pretty-printed JSON array "
        "belongs in a .json file)."
    )
    arrays = False

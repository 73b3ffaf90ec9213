"""JSON files: one record, an array of records, or several such values in a row separated by
whitespace (what ``cat a.json b.json`` makes, and JSON Lines in a ``.json`` file)."""

from __future__ import annotations

from cluster_pipeline.data import json_text
from cluster_pipeline.data.readers.base import JsonTextReader


class JsonReader(JsonTextReader):
    """Every top-level value; an array's elements are records, each at the line it starts."""

    name = "JSON"
    suffix = ".json"
    listed = 10
    parse = json_text.iter_values
    hint = (
        "A .json file holds one JSON value (an array of records or one record) or several in "
        "a row separated by whitespace; fix or split the file."
    )
    arrays = True

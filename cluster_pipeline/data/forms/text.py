"""Plain text for language modelling: ``text``, trained whole."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

from cluster_pipeline.data.forms.base import Read, RecordForm, field_text
from cluster_pipeline.data.samples import DatasetFormatError


class Text(RecordForm):
    """The response is the text, the prompt and system empty; a ``system`` or ``tools`` field
    is not read (counted as dropped). Tried last: any other form's fields win."""

    name = "text"
    fields = ("text",)
    accepted = "text"
    listed = 80
    tried = 80
    common = ()

    def matches(self, record: Mapping[str, Any]) -> bool:
        """A ``text`` field."""
        return "text" in record

    def read(self, record: Mapping[str, Any], where: str, dropped: Counter) -> Read:
        """The text as the response.

        Raises:
            DatasetFormatError: the text is not text, or blank.
        """
        text = field_text(record["text"], "text", where)
        if not text.strip():
            raise DatasetFormatError(
                f"{where}: the text is empty; remove the record or fill it in."
            )
        return Read("", "", text)

"""Sample ids computed here by hand from their documented formula (data/samples.py,
``sample_id``), so the tests check the product's hash against an independent one."""

import hashlib
import json


def _hash(parts: list[str]) -> str:
    h = hashlib.sha256()
    for part in parts:
        data = part.encode("utf-8")
        h.update(len(data).to_bytes(8, "little") + data)
    return h.hexdigest()[:16]


def plain_id(system: str, prompt: str, response: str, tools: str | None = None) -> str:
    """A plain exchange's id: what every sample's id was before issue 43 (system, prompt,
    response and, when given, tools)."""
    return _hash([system, prompt, response, *([] if tools is None else [tools])])


def structural_id(turns: list[dict], tools: str | None = None) -> str:
    """Any other conversation's id: the tag, the turns as canonical JSON, the tools ("")."""
    canonical = json.dumps(turns, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return _hash(["cluster_pipeline.sample.messages.v1", canonical, tools or ""])

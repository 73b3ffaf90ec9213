"""The JSON round trip shared by the entry points' config dataclasses."""

import json
from dataclasses import asdict, fields
from pathlib import Path
from typing import Self


class JsonConfig:
    """Mixin for a dataclass config written by an asset and read by every rank.

    Subclasses define ``validate()``, raising ValueError that names the bad option.
    """

    def validate(self) -> None:  # pragma: no cover - overridden
        pass

    @classmethod
    def load(cls, path: str | Path) -> Self:
        """Read and validate a config file.

        Raises:
            ValueError: unknown options (named) or an invalid value.
        """
        raw = json.loads(Path(path).read_text())
        unknown = set(raw) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"{path}: unknown {cls.__name__} options {sorted(unknown)}")
        cfg = cls(**raw)
        cfg.validate()
        return cfg

    def dump(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1))

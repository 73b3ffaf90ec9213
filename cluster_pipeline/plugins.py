"""Registries that grow by a file: every concrete class of a kind defined in a package's modules.

The project's extension points that are plain classes (record forms, file readers, evaluation
suites; docs/design.md, "Code layout") are found here rather than listed by hand: adding one is
adding its module to the package. A class counts when it is a subclass of the registry's base,
defined in that module (not imported into it) and concrete, i.e. it sets ``name`` itself;
abstract helpers (a shared base for chat forms, say) set none. The order of a registry is the
registry's business (each kind declares its own sort key), never the order files are found in.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType
from typing import TypeVar

T = TypeVar("T")


def discover(package: ModuleType, base: type[T]) -> list[T]:
    """An instance of every concrete subclass of ``base`` defined in a module of ``package``
    (its direct modules, in file-name order; sort the result by the kind's own key).

    Raises:
        ImportError: a module of the package cannot be imported (the import's own error).
        ValueError: two classes share one ``name``.
    """
    found: list[T] = []
    names: dict[str, str] = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for cls in vars(module).values():
            if not (
                isinstance(cls, type)
                and issubclass(cls, base)
                and cls.__module__ == module.__name__
                and "name" in vars(cls)
            ):
                continue
            name = vars(cls)["name"]
            if name in names:
                raise ValueError(
                    f"{base.__name__} {name!r} is defined twice: in {names[name]} and in "
                    f"{module.__name__}; give one of them another name"
                )
            names[name] = module.__name__
            found.append(cls())
    return found

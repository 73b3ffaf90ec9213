"""Registries that grow by a file: a class in a new module of the package is found, with no
list to edit; helpers without a name, and classes imported from elsewhere, are not."""

import sys
import textwrap

import pytest

from cluster_pipeline.data.readers.base import FileReader
from cluster_pipeline.plugins import discover


def _package(tmp_path, monkeypatch, name: str, modules: dict[str, str]):
    root = tmp_path / name
    root.mkdir()
    (root / "__init__.py").write_text("")
    for module, text in modules.items():
        (root / f"{module}.py").write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    __import__(name)
    return sys.modules[name]


HEADER = "from cluster_pipeline.data.readers.base import FileReader, JsonTextReader\n"


def test_a_new_module_is_found_and_helpers_are_not(tmp_path, monkeypatch):
    package = _package(
        tmp_path,
        monkeypatch,
        "plugins_found",
        {
            "yaml_file": HEADER + "class YamlReader(FileReader):\n    name = 'YAML'\n",
            # A helper without a name, and a reader imported from elsewhere: neither counts.
            "helpers": HEADER
            + "from cluster_pipeline.data.readers.json_file import JsonReader\n"
            + "class Shared(JsonTextReader):\n    pass\n",
            "toml_file": HEADER + "class TomlReader(FileReader):\n    name = 'TOML'\n",
        },
    )
    found = discover(package, FileReader)
    assert [type(r).__name__ for r in found] == ["TomlReader", "YamlReader"]  # file-name order
    assert all(isinstance(r, FileReader) for r in found)


def test_two_classes_of_one_name_are_refused(tmp_path, monkeypatch):
    package = _package(
        tmp_path,
        monkeypatch,
        "plugins_twice",
        {
            "a": HEADER + "class A(FileReader):\n    name = 'same'\n",
            "b": HEADER + "class B(FileReader):\n    name = 'same'\n",
        },
    )
    with pytest.raises(ValueError) as e:
        discover(package, FileReader)
    assert str(e.value) == (
        "FileReader 'same' is defined twice: in plugins_twice.a and in plugins_twice.b; give "
        "one of them another name"
    )

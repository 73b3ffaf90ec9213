"""The layout's rules, read from its one description (docs/design.md, "Code layout"): every
folder has a layer and states its role, imports point one way (save the listed exceptions),
every module file is listed there and every listed one exists, the Dagster definitions load no
recipe, and every module path handed to torchrun exists."""

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "cluster_pipeline"
DESIGN = ROOT / "docs" / "design.md"


def _layout_section() -> str:
    text = DESIGN.read_text()
    start = text.index("\n## Code layout\n")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def _layers(section: str) -> dict[str, int]:
    """Folder (or top-level module) -> layer, from the section's table."""
    rows = re.findall(r"^\| (\d+) \| `(\w+)(?:/|\.py)` \|", section, re.MULTILINE)
    return {name: int(layer) for layer, name in rows}


def _exceptions(section: str) -> set[tuple[str, str]]:
    """(folder, module) imports allowed against the layers: ``- `a/` imports `b/c.py```."""
    found = re.findall(r"^- `(\w+)/` imports `([\w/]+)\.py`", section, re.MULTILINE)
    return {(folder, "cluster_pipeline." + path.replace("/", ".")) for folder, path in found}


def _listed_modules(section: str) -> dict[str, set[str]]:
    """Folder -> its listed modules (``name.py``) and packages (``name/``)."""
    out = {}
    for folder, rest in re.findall(r"^- `(\w+)/`: (.*)$", section, re.MULTILINE):
        out[folder] = set(re.findall(r"`(\w+\.py|\w+/)`", rest))
    return out


SECTION = _layout_section()
LAYERS = _layers(SECTION)
ALLOWED = _exceptions(SECTION)
MODULES = _listed_modules(SECTION)


def _folder(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "cluster_pipeline" else None


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names]
    return [m for m in out if m.startswith("cluster_pipeline.")]


def _modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        out.append((".".join(rel.parts), path))
    return out


def _folders() -> list[str]:
    return sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and not p.name.startswith("_"))


def _module_files(folder: Path) -> set[str]:
    """A folder's modules (``name.py``) and packages (``name/``, a folder with an
    ``__init__.py``)."""
    files = {p.name for p in folder.glob("*.py") if p.name != "__init__.py"}
    packages = {f"{p.name}/" for p in folder.iterdir() if (p / "__init__.py").is_file()}
    return files | packages


def test_the_description_is_read():
    """The section parses: a layer for every folder and module it names, exceptions, modules."""
    assert LAYERS["storage"] == 0 and LAYERS["definitions"] == max(LAYERS.values())
    assert ("evaluation", "cluster_pipeline.training.checkpointing") in ALLOWED
    assert set(MODULES) == set(_folders())


def test_every_folder_has_a_layer_and_states_its_role():
    top = {p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    assert set(_folders()) | top == set(LAYERS), (
        "docs/design.md, 'Code layout': the table's folders differ from cluster_pipeline/'s"
    )
    for folder in _folders():
        doc = ast.get_docstring(ast.parse((PACKAGE / folder / "__init__.py").read_text()))
        assert doc and len(doc.split()) >= 15, f"{folder}/__init__.py states no role"


def test_every_module_is_listed_and_every_listed_module_exists():
    """A new module (or a removed one) is added to (removed from) the folder's line in
    docs/design.md, "Code layout", with a few words on what it holds."""
    wrong = []
    for folder in _folders():
        on_disk, listed = _module_files(PACKAGE / folder), MODULES.get(folder, set())
        wrong += [f"{folder}/{m} is not listed" for m in sorted(on_disk - listed)]
        wrong += [f"{folder}/{m} is listed but does not exist" for m in sorted(listed - on_disk)]
    assert wrong == [], "docs/design.md, 'Code layout': " + "; ".join(wrong)


def test_no_folder_init_lists_its_modules():
    """A folder's ``__init__.py`` states its role; its modules are listed in one place (the
    design's "Code layout"), so the two cannot disagree."""
    listing = []
    for folder in _folders():
        doc = ast.get_docstring(ast.parse((PACKAGE / folder / "__init__.py").read_text())) or ""
        named = {m.rstrip("/").removesuffix(".py") for m in _module_files(PACKAGE / folder)}
        listing += [f"{folder}: {m}" for m in sorted(named) if f"``{m}``" in doc]
    assert listing == [], listing


def test_asset_modules_stay_thin():
    """The asset layer is thin (docs/design.md, layer 6; issue 40): each stage's module reads
    records, calls the library and writes tables and metadata, in under 120 lines."""
    sizes = {
        p.name: len(p.read_text().splitlines()) for p in (PACKAGE / "defs" / "assets").glob("*.py")
    }
    assert len(sizes) >= 9, sizes  # the package and its eight stages
    assert {name: n for name, n in sizes.items() if n >= 120} == {}


def test_imports_point_one_way():
    wrong = []
    for module, path in _modules():
        mine = _folder(module)
        if mine is None or mine not in LAYERS:
            continue
        for target in _imports(path):
            theirs = _folder(target)
            if theirs is None or theirs == mine or (mine, target) in ALLOWED:
                continue
            if LAYERS.get(theirs, 99) >= LAYERS[mine]:
                wrong.append(f"{module} imports {target}")
    assert wrong == [], "\n".join(wrong)


def test_the_definitions_load_no_recipe_and_no_torch():
    """Every ``dagster`` CLI run, code server, daemon and spawned step loads the Definitions
    (every asset module); torch, transformers and matplotlib (about 3 s of imports) are for the
    torchrun ranks and the step bodies that need them."""
    code = (
        "import sys\n"
        "from cluster_pipeline.definitions import defs\n"
        "assert len(defs().resolve_asset_graph().get_all_asset_keys()) > 7\n"
        "print([m for m in sys.modules if m.startswith('cluster_pipeline.recipes.')"
        " or m in ('torch', 'transformers', 'matplotlib')])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_every_module_handed_to_torchrun_exists():
    from cluster_pipeline.launch.torchrun import LAUNCH_MODULE, RECIPES

    assert set(RECIPES) == {"embed", "train", "evaluate"}
    for name in [LAUNCH_MODULE, *RECIPES.values()]:
        assert importlib.util.find_spec(name) is not None, name


@pytest.mark.parametrize(
    "module",
    [
        "cluster_pipeline.training.step",
        "cluster_pipeline.training.plan",
        "cluster_pipeline.training.kernels",
        "cluster_pipeline.training.mfu",
        "cluster_pipeline.data.attention",
        "cluster_pipeline.data.packing",
        "cluster_pipeline.selection.embedding",
    ],
)
def test_the_timing_core_needs_torch_alone(module):
    """benchmarks/training_throughput.py and benchmarks/gpu_step.py run these on GPU machines
    without pydantic, polars, Dagster or deltalake."""
    code = (
        f"import sys, {module}\n"
        "print(sorted(m for m in ('pydantic', 'polars', 'dagster', 'deltalake') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

"""The layout's rules (README, "Layout"; docs/design.md, "Layout"): imports point one way, the
Dagster definitions load no recipe, and every module path handed to torchrun exists."""

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "cluster_pipeline"

# Folder -> layer: a module may import its own folder and any folder of a lower layer. launch/
# (process plumbing: torchrun command lines, fate-sharing) imports nothing of the project, so it
# sits at the bottom beside storage and every rank may use it; so does tracking/ (MLflow runs by
# id), which the training loop's rank 0 and the Dagster assets both write through.
LAYERS = {
    "storage": 0,
    "launch": 1,
    "tracking": 1,
    "data": 1,
    "models": 2,
    "selection": 2,
    "training": 3,
    "evaluation": 3,
    "integrations": 4,
    "recipes": 5,
    "defs": 6,
    "cli": 7,
    "definitions": 8,
}
# The one import across a layer: evaluation reads training's checkpoint catalogue.
ALLOWED = {
    ("evaluation", "cluster_pipeline.training.checkpointing"),
}


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


def test_every_folder_has_a_layer_and_states_its_role():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and not p.name.startswith("_")}
    assert folders <= set(LAYERS), folders - set(LAYERS)
    for folder in folders:
        doc = ast.get_docstring(ast.parse((PACKAGE / folder / "__init__.py").read_text()))
        assert doc and len(doc.split()) >= 15, f"{folder}/__init__.py states no role"


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
    "module", ["cluster_pipeline.training.step", "cluster_pipeline.training.plan"]
)
def test_the_timing_core_needs_torch_alone(module):
    """benchmarks/training_throughput.py runs these on machines without pydantic or Dagster."""
    code = (
        f"import sys, {module}\n"
        "print(sorted(m for m in ('pydantic', 'polars', 'dagster', 'deltalake') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

"""The package tree shows the flow, and a module imports only downwards in it.

Layers, lowest first: what every layer may use (errors, side files, tool argument types), data, configuration,
parallel state, model, pipeline and optimizer, checkpointing, Hugging Face interchange, planning, the training
loop, inference. A module may import from its own layer or a lower one; no module (counting imports inside
functions) reaches itself again through its imports, so every package can be read bottom-up.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "megatron_lite"
LAYERS = (
    ("errors", "files", "tool_args"),
    ("data",),
    ("config",),
    ("parallel",),
    ("model",),
    ("pipeline", "optim"),
    ("checkpoint",),
    ("hf", "megatron_lm"),
    ("planning",),
    ("training",),
    ("inference",),
    ("evaluation",),
)
MAX_TOP_LEVEL_MODULES = 3
MAX_LINES = 600


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def library_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The library modules `path` imports anywhere in it (`from a.b import c` names a.b.c when that is a
    module, else a.b)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "megatron_lite":
            assert node.level == 0, f"{path}: relative import"
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                found.add(child if child in known else node.module)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = library_modules()
    return {name: imported_modules(path, set(modules)) - {name} for name, path in modules.items()}


def layer_of(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    for number, names in enumerate(LAYERS):
        if top in names:
            return number
    raise AssertionError(f"{module}: its top-level name {top!r} has no layer in LAYERS")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{importer} imports {imported} (layer {layer_of(importer)} -> {layer_of(imported)})"
                  for importer, imports in graph.items() if importer != "megatron_lite"
                  for imported in imports if imported != "megatron_lite" and layer_of(imported) > layer_of(importer))


def import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as the list of modules around it, or None."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node], _ = "open", path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node], _ = "done", path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_every_module_imports_only_downwards():
    assert upward_imports(import_graph()) == []


def test_the_training_loop_names_no_model_feature():
    """MoE and multi-token prediction reach training/ through the model contract (model/contract.py
    TrainingHooks), so a new model feature changes nothing there."""
    features = ("megatron_lite.model.moe", "megatron_lite.model.mtp")
    reaching = {name: sorted(target for target in targets if target.startswith(features))
                for name, targets in import_graph().items() if name.startswith("megatron_lite.training")}
    assert {name: targets for name, targets in reaching.items() if targets} == {}


def test_no_import_cycle():
    assert import_cycle(import_graph()) is None


def test_the_checks_catch_an_upward_import_and_a_cycle():
    graph = {"megatron_lite.data.builder": {"megatron_lite.training.loop"},
             "megatron_lite.training.loop": {"megatron_lite.data.builder"}}
    assert upward_imports(graph) == ["megatron_lite.data.builder imports megatron_lite.training.loop (layer 1 -> 9)"]
    assert import_cycle(graph) == ["megatron_lite.data.builder", "megatron_lite.training.loop",
                                   "megatron_lite.data.builder"]
    with pytest.raises(AssertionError, match="no layer"):
        layer_of("megatron_lite.somewhere_new")


def test_the_top_level_holds_packages_and_a_few_modules():
    modules = sorted(path.stem for path in PACKAGE.glob("*.py") if path.name != "__init__.py")
    packages = sorted(path.parent.name for path in PACKAGE.glob("*/__init__.py"))
    assert len(modules) <= MAX_TOP_LEVEL_MODULES, modules
    assert sorted(modules + packages) == sorted(name for names in LAYERS for name in names)


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_library_file_is_short(path):
    assert len(path.read_text().splitlines()) <= MAX_LINES

"""The package's shape: its import graph has no cycles and never points up the layers.

Layers, lowest first (a module may import its own layer and the ones below it):

- ``errors``, ``prompts``: leaves;
- ``engine``: the loop, the one-forward verification step, the pure verification maths, the tree,
  the cache, the target adapter, sampling, types, the cost model and the forward timing;
- ``models``: the drafters' torch modules;
- ``drafters``: the methods and their registry, checkpoints, drafter timing;
- ``api``: ``generate``, ``build_drafter``, ``load_drafter``;
- ``training``: corpus, features, trainer, recipes;
- ``lab``: benchmark, analysis, demo, reports;
- ``cli`` and the package root.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
#: each layer's top-level names under ``specwise``; "" is the package root
LAYERS = (("errors", "prompts"), ("engine",), ("models",), ("drafters",), ("api",), ("training",), ("lab",),
          ("cli", ""))


def _modules() -> dict[str, Path]:
    out = {}
    for path in (SRC / "specwise").rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(path: Path) -> list[tuple[str, bool]]:
    """The specwise modules ``path`` imports, each with whether the import is at module level."""
    tree = ast.parse(path.read_text())
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("specwise"):
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            targets = [name for name in names if name in MODULES] or [node.module]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names if alias.name.startswith("specwise")]
        else:
            continue
        found += [(target, id(node) in top_level) for target in targets if target in MODULES]
    return found


def layer(module: str) -> int:
    """The layer index of a module (see the module docstring)."""
    parts = module.split(".")
    name = parts[1] if len(parts) > 1 else ""
    return next(i for i, names in enumerate(LAYERS) if name in names)


GRAPH = {name: _imports(path) for name, path in MODULES.items()}


def test_the_layers_cover_every_module():
    for name in MODULES:
        layer(name)  # raises StopIteration for a top-level name no layer lists


def test_no_import_runs_up_the_layers():
    upward = [f"{name} -> {target}" for name, deps in GRAPH.items() for target, _ in deps
              if target != "specwise" and layer(target) > layer(name)]
    assert not upward, "imports up the layers:\n" + "\n".join(upward)


def test_the_engine_never_imports_the_lab_tools():
    for name, deps in GRAPH.items():
        if name.startswith(("specwise.engine", "specwise.drafters", "specwise.models", "specwise.training")):
            assert not [t for t, _ in deps if t.startswith(("specwise.lab", "specwise.cli"))], name


def test_no_import_cycles():
    edges = {name: {t for t, _ in deps if t != "specwise"} for name, deps in GRAPH.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for name in sorted(edges):
        if name not in state:
            visit(name, [name])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


#: modules allowed to import inside functions, each for the reason given in a comment at the import
LAZY_ALLOWED = {
    "specwise.cli",  # lab and training commands need the [bench]/[train] extras; `generate` must run without
}


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n not in LAZY_ALLOWED))
def test_internal_imports_are_at_module_top(name):
    inner = sorted({t for t, top in GRAPH[name] if not top})
    assert not inner, f"{name} imports {inner} inside a function"

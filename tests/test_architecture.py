"""The package's shape: its import graph has no cycles and never points up the layers.

Layers, lowest first (a module may import its own layer and the ones below it):

- ``errors``, ``checks`` (the option checks every layer shares), ``prompts``, ``discovery`` (finding the
  methods' modules by name): leaves;
- ``engine``: the decoding core: the loop, the one-forward verification step, the pure
  verification maths, the tree, sampling, stopping, types, the target and drafter interfaces, the
  cost model and the forward timing (calibration);
- ``targets``: the targets behind the interface: the Hugging Face model on torch (``hf``) and its
  KV cache, loading, the aliases, chat templates, the GGUF's native packing;
- ``models``: what the drafters' torch modules share;
- ``interop``: drafters in other projects' formats (detection, what the formats share);
- ``drafters``: the registry, the drafter base, building and keeping drafters, checkpoints, drafter timing,
  ``export``;
- ``methods``: one module per training-free method, one folder per trained one. The package's
  ``__init__`` and each folder's (a docstring) are leaves; a method's single
  module sits with ``drafters``; in a folder each module sits with the layer of its role:
  ``drafter`` with ``drafters``, ``network`` with ``models``, ``interop`` with ``interop``,
  ``recipe`` with ``training``, and any other module (a method's own helpers) with ``drafters``;
- ``api``: ``generate``, the keyword front door; ``request``: the checked request it builds and runs;
  ``output``: tools and response formats; ``many``: ``generate_many`` and the batches' load rule;
- ``serve``: the OpenAI-compatible server over ``api``;
- ``training``: corpus, features, trainer, recipes;
- ``lab``: benchmark, analysis, demo, reports;
- ``cli`` (which imports each subcommand's module only when it runs), ``commands`` (``generate``,
  ``targets``) and the package root (its names imported on first use).
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
#: each layer's top-level names under ``specwise``; "" is the package root
LAYERS = (("errors", "checks", "prompts", "discovery"), ("engine",), ("targets",), ("models",), ("interop",), ("drafters",), ("api", "many", "request", "output"), ("serve",), ("training",), ("lab",),
          ("cli", "commands", ""))


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
    """The specwise modules ``path`` imports, each with whether the import is at module level (a
    module-level ``try`` guarding an optional extra's import counts as module level)."""
    tree = ast.parse(path.read_text())
    top_level = {id(node) for node in tree.body}
    for node in tree.body:
        if isinstance(node, ast.Try):
            top_level |= {id(n) for n in node.body + node.orelse}
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


#: a method folder's module -> the layer it sits with (module docstring); other names: ``drafters``
ROLE_LAYERS = {"drafter": "drafters", "network": "models", "interop": "interop", "recipe": "training"}


def layer(module: str) -> int:
    """The layer index of a module (see the module docstring)."""
    parts = module.split(".")
    name = parts[1] if len(parts) > 1 else ""
    if name == "methods":
        is_folder = len(parts) == 3 and MODULES[module].name == "__init__.py"
        name = ("errors" if len(parts) == 2 or is_folder else
                "drafters" if len(parts) == 3 else ROLE_LAYERS.get(parts[3], "drafters"))
    return next(i for i, names in enumerate(LAYERS) if name in names)


GRAPH = {name: _imports(path) for name, path in MODULES.items()}


def test_the_layers_cover_every_module():
    for name in MODULES:
        layer(name)  # raises StopIteration for a top-level name no layer lists


def test_a_method_folder_is_found_by_its_modules_names_alone():
    """A folder's ``__init__`` is its docstring: the roles are found by module name, and importing a
    folder's network (training does) must not drag its drafter in."""
    folders = [name for name, path in MODULES.items() if name.startswith("specwise.methods.")
               and path.name == "__init__.py"]
    assert {"specwise.methods.draft", "specwise.methods.eagle", "specwise.methods.medusa",
            "specwise.methods.dflash"} <= set(folders)
    for name in folders + ["specwise.methods"]:
        body = ast.parse(MODULES[name].read_text()).body
        assert len(body) == 1 and isinstance(body[0], ast.Expr), f"{name}'s __init__ holds more than a docstring"


def _method_of(name: str) -> str | None:
    """The method a module belongs to (``specwise.methods.eagle.network`` -> ``eagle``), or ``None``."""
    parts = name.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["specwise", "methods"] else None


def test_a_method_leans_on_no_other_method():
    """What several methods share lives in a layer below them (``drafters``, ``models``,
    ``training``), so a method's module or folder imports no other method's modules, and below the
    training tools nothing imports a method's drafter, recipe or own helpers (their ``network`` and
    ``interop`` sit with lower layers and may be read; the registry finds the rest)."""
    crossing = [f"{name} -> {target}" for name, deps in GRAPH.items() for target, _ in deps
                if _method_of(name) and _method_of(target) and _method_of(name) != _method_of(target)]
    assert not crossing, "methods importing each other:\n" + "\n".join(crossing)
    reached = [f"{name} -> {target}" for name, deps in GRAPH.items() for target, _ in deps
               if not _method_of(name) and _method_of(target) and target.rsplit(".", 1)[-1] not in ("network", "interop")
               and not name.startswith(("specwise.training", "specwise.lab", "specwise.cli", "specwise.commands"))]
    assert not reached, "method internals imported from outside the methods:\n" + "\n".join(reached)


def test_no_import_runs_up_the_layers():
    upward = [f"{name} -> {target}" for name, deps in GRAPH.items() for target, _ in deps
              if target != "specwise" and layer(target) > layer(name)]
    assert not upward, "imports up the layers:\n" + "\n".join(upward)


def test_the_engine_never_imports_the_lab_tools():
    for name, deps in GRAPH.items():
        if name.startswith(("specwise.engine", "specwise.targets", "specwise.drafters", "specwise.models", "specwise.methods",
                             "specwise.training")):
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


@pytest.mark.parametrize("name", sorted(MODULES))
def test_internal_imports_are_at_module_top(name):
    inner = sorted({t for t, top in GRAPH[name] if not top})
    assert not inner, f"{name} imports {inner} inside a function"


def _code_lines(node: ast.AST, source_lines: list[str]) -> int:
    """Lines of a function that hold code: not blank, not comments, not its docstring."""
    body = node.body
    skip: set[int] = set()
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str):
        skip.update(range(body[0].lineno, body[0].end_lineno + 1))
    count = 0
    for number in range(node.lineno, node.end_lineno + 1):
        text = source_lines[number - 1].strip()
        if number not in skip and text and not text.startswith("#"):
            count += 1
    return count


#: the areas whose functions must stay short enough to read top to bottom
SHORT_FUNCTION_AREAS = ("specwise.engine", "specwise.training", "specwise.serve", "specwise.targets", "specwise.api",
                        "specwise.request", "specwise.output", "specwise.many")
MAX_FUNCTION_LINES = 60


def test_engine_targets_request_training_and_server_functions_are_at_most_60_code_lines():
    long = []
    for name, path in MODULES.items():
        if not name.startswith(SHORT_FUNCTION_AREAS):
            continue
        source = path.read_text()
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = _code_lines(node, lines)
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{name}.{node.name}: {n} lines")
    assert not long, "functions over 60 code lines:\n" + "\n".join(long)


#: a measured figure: a ratio, a rate, a time, a percentage, a τ, or a before → after pair
FIGURE = re.compile(r"(\d+(?:\.\d+)?\s*(?:×|x\b|tok/s|tokens/s|ms\b|GFLOP|GB/s|%|s\b|min\b|minutes)"
                    r"|τ\s*[=≈]?\s*\d|\b\d+\.\d+\s*(?:→|->)\s*\d)")


def _comments_and_docstrings(source: str):
    """``(line number, text)`` of every comment and docstring line of ``source``."""
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT or (token.type == tokenize.STRING and token.string.lstrip("rbu").startswith(('"""', "'''"))):
            for offset, line in enumerate(token.string.splitlines()):
                yield token.start[0] + offset, line


def test_no_code_comment_quotes_a_benchmark_figure_or_the_readme():
    """Figures rot with the next run: comments point to a report in docs/ instead (docs/design.md, Measuring)."""
    found = []
    for name, path in MODULES.items():
        for number, line in _comments_and_docstrings(path.read_text()):
            if FIGURE.search(line) or "README" in line:
                found.append(f"{path.relative_to(SRC)}:{number}: {line.strip()}")
    assert not found, "comments quoting figures or the README:\n" + "\n".join(found)


# --------------------------------------------------------------------------------------------
# start-up: a subcommand's module is imported only when it runs


def _modules_after(code: str) -> set[str]:
    """The modules loaded in a fresh interpreter after running ``code``."""
    out = subprocess.run([sys.executable, "-c", f"import sys\n{code}\nprint('\\n'.join(sys.modules))"],
                         capture_output=True, text=True, check=True, timeout=120)
    return set(out.stdout.split())


def test_help_and_the_package_import_no_model_code():
    for code in ("import specwise.cli as c; c.build_parser('')", "import specwise"):
        loaded = _modules_after(code)
        assert not loaded & {"torch", "transformers", "numpy"}, code


def test_generate_imports_neither_the_lab_tools_nor_the_server_nor_training():
    loaded = _modules_after("import specwise.cli as c; c.build_parser('generate')")
    assert "specwise.commands.generate" in loaded
    heavy = {m for m in loaded if m.startswith(("specwise.lab.bench", "specwise.lab.analysis", "specwise.serve",
                                                 "specwise.training", "matplotlib", "fastapi", "uvicorn"))}
    assert not heavy, sorted(heavy)


def test_every_subcommand_module_exists_and_sits_in_a_layer():
    from specwise.cli import COMMANDS

    for name, (module, *_rest) in COMMANDS.items():
        assert module in MODULES, (name, module)
        layer(module)


# --------------------------------------------------------------------------------------------
# references: every document the code cites is in the repository

ROOT = SRC.parent
#: a cited document: a file under ``docs/`` or a capitalised one (``README.md``), with an optional
#: section of docs/algorithms.md after it; other ``.md`` names in code are files it writes
DOC_REFERENCE = re.compile(r"(?<![\w./-])((?:\.\./)*(?:docs/[\w./-]*[\w-]|[A-Z][A-Z_]+)\.md)(?: §([0-9.]*[0-9]))?")


def _cited_documents() -> list[tuple[str, str, str]]:
    """``(where, file, section)`` for each Markdown file a source, test, benchmark or script cites."""
    found = []
    for folder in ("src/specwise", "tests", "benchmarks", "scripts"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for number, line in _comments_and_docstrings(path.read_text()):
                for match in DOC_REFERENCE.finditer(line):
                    found.append((f"{path.relative_to(ROOT)}:{number}", match.group(1), match.group(2) or ""))
    return found


def test_every_document_the_code_cites_is_in_the_repository():
    """A reader of the code or of the wheel's sources can follow every reference: each cited
    document exists in the repository, and each cited section of
    docs/algorithms.md is one of its headings."""
    headings = set(re.findall(r"^#+ §([0-9.]+)", (ROOT / "docs" / "algorithms.md").read_text(), re.M))
    missing = []
    for where, name, section in _cited_documents():
        if not (ROOT / name).is_file():
            missing.append(f"{where}: {name}")
        elif section and name.endswith("algorithms.md") and section not in headings:
            missing.append(f"{where}: {name} §{section}")
    assert not missing, "references to documents or sections the repository does not have:\n" + "\n".join(missing)

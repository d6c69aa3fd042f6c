"""casstore's modules import each other without cycles and stay small (one concept per module,
STYLE.md §1).

The graph is read from the source with ``ast``: every ``import`` counts, including those under
``if TYPE_CHECKING:`` and inside functions, since a cycle hidden there is still two modules that
cannot be read (or changed) one without the other. A package's ``__init__`` is a node like any
module; a submodule is not taken to import its parent package.
"""

import ast
import importlib
import pathlib
import re

import pytest

import casstore

ROOT = pathlib.Path(casstore.__file__).parent


def _modules() -> dict[str, pathlib.Path]:
    """Dotted module name -> source file, for every module of the casstore package."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The casstore module ``name`` (a module, or a name inside one) lives in, else None."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: pathlib.Path) -> set[str]:
    """The casstore modules that ``module`` imports anywhere in its source."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        found |= {m for m in map(_resolve, names) if m is not None and m != module}
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_checker_finds_a_cycle_and_resolves_relative_imports():
    """The checker itself: a two-module cycle is found, a chain is not, and ``from ._x import
    y`` in casstore and ``from .._x import y`` in casstore.store resolve to ``casstore._x``."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert "casstore._errors" in _imports("casstore._save_leaves", MODULES["casstore._save_leaves"])
    assert "casstore._pool" in _imports("casstore.store._base", MODULES["casstore.store._base"])


def test_no_import_cycle_in_casstore():
    """No two casstore modules import each other, directly or through others."""
    graph = {m: _imports(m, p) for m, p in MODULES.items()}
    assert _cycles(graph) == []


def test_no_module_is_over_450_lines():
    """One concept per module (issue 32): a module past 450 lines holds more than one."""
    sizes = {m: len(p.read_text().splitlines()) for m, p in MODULES.items()}
    assert {m: n for m, n in sizes.items() if n > 450} == {}


@pytest.mark.parametrize("module", sorted(set(MODULES) - {"casstore.__main__"}))
def test_every_module_imports(module):
    """Each module imports (in the test process, after casstore: no missing name or syntax);
    ``casstore.__main__`` runs the command line when imported, so it is only parsed."""
    assert importlib.import_module(module).__name__ == module


def test_the_design_notes_diagrams_name_existing_modules_and_every_save_stage():
    """docs/design-notes.md draws the data flow of save and restore: every ``_module.name`` in
    its diagrams exists, and every save-stage module (``casstore/_save*.py``) is drawn."""
    notes = (ROOT.parent / "docs" / "design-notes.md").read_text()
    diagrams = "".join(re.findall(r"^```text\n(.*?)^```", notes, re.S | re.M))
    named = [(m, chain.split(".")[1:]) for m, chain in
             re.findall(r"\b(_[a-z_]+)((?:\.[A-Za-z_]+)+)", diagrams) if chain != ".py"]
    assert len(named) >= 10
    for module, chain in named:
        found = [m for m in (f"casstore.{module}", f"casstore.store.{module}") if m in MODULES]
        assert found, f"{module} in docs/design-notes.md is not a casstore module"
        value = importlib.import_module(found[0])
        for name in chain:
            assert hasattr(value, name), f"{module}.{'.'.join(chain)}"
            value = getattr(value, name)
    stages = {p.stem for p in ROOT.glob("_save*.py")}
    assert stages <= {m for m, _ in named} | {"_save"}, stages

"""The package's layering (docs/ARCHITECTURE.md, "Layers"): no import cycle between its
units, and no import from a layer above.

A unit is a subpackage of src/decodekit or a top-level module; "decodekit" is the
package's own __init__ (the public API). Every import counts, including those inside
functions (lazy imports) and under `if TYPE_CHECKING`, since any of them can close a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "decodekit"
ROOT = "decodekit"  # the package's __init__.py

# Bottom first, as docs/ARCHITECTURE.md states them. A unit imports only units of its own
# layer or of layers below; within a layer, the cycle check keeps imports one-way.
LAYERS = [
    # params imports validate only
    {"validate", "params", "completion", "optional", "runtime", "text", "cache_dir", "scratch"},
    {"models", "sampling"},  # the LanguageModel contract and models; sampling adapters
    {"compress", "request"},  # compression of models; the request model of every decoder
    {"engine"},  # paged KV, prefix cache, scheduler: runs requests
    {"decode"},  # primitive generators: the plain loop, beam, contrastive, speculative
    # public API and chat; meta-generators; alignment; `doctor`'s report
    {ROOT, "meta", "align", "environment", "conversation"},
    {"server", "bench", "cli"},  # user surfaces
]
LAYER = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


def unit_of(module: str, package: Path) -> str | None:
    """The unit of a dotted name inside the package (a name that is no subpackage or
    module, as in `from decodekit import generate`, is the API), or None outside it."""
    parts = module.split(".")
    if parts[0] != "decodekit":
        return None
    if len(parts) > 1 and ((package / parts[1]).is_dir() or (package / f"{parts[1]}.py").is_file()):
        return parts[1]
    return ROOT


def module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_units(path: Path, package: Path) -> list[tuple[str, int]]:
    """(unit, line) of every import of the package in one file, lazy ones included."""
    module = module_name(path, package)
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join(anchor + ([base] if base else []))
            # `from decodekit import engine` names a unit, `from decodekit import generate` the API.
            targets = [f"{base}.{alias.name}" if base == "decodekit" else base for alias in node.names]
        else:
            continue
        for target in targets:
            unit = unit_of(target, package)
            if unit is not None:
                found.append((unit, node.lineno))
    return found


def import_graph(package: Path) -> dict[str, dict[str, list[str]]]:
    """unit -> imported unit -> ["file:line", ...] (imports within a unit left out)."""
    graph: dict[str, dict[str, list[str]]] = {}
    for path in sorted(package.rglob("*.py")):
        source = unit_of(module_name(path, package), package)
        graph.setdefault(source, {})
        for target, line in imported_units(path, package):
            if target != source:
                where = f"{path.relative_to(package.parent)}:{line}"
                places = graph[source].setdefault(target, [])
                if where not in places:  # `from m import a, b` is one import
                    places.append(where)
    return graph


def cycles(graph: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """The strongly connected components with more than one unit (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(unit: str) -> None:
        index[unit] = low[unit] = len(index)
        stack.append(unit)
        for other in graph.get(unit, {}):
            if other not in index:
                visit(other)
                low[unit] = min(low[unit], low[other])
            elif other in stack:
                low[unit] = min(low[unit], index[other])
        if low[unit] == index[unit]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == unit:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for unit in sorted(graph):
        if unit not in index:
            visit(unit)
    return found


@pytest.fixture(scope="module")
def graph():
    return import_graph(PACKAGE)


def test_every_unit_has_a_layer(graph):
    missing = sorted(set(graph) - set(LAYER))
    assert not missing, f"units with no layer in LAYERS (and docs/ARCHITECTURE.md): {missing}"


def test_no_import_cycle_between_units(graph):
    found = cycles(graph)
    detail = [
        f"{a} -> {b}: {', '.join(graph[a][b])}"
        for component in found
        for a in component
        for b in component
        if b in graph.get(a, {})
    ]
    assert not found, f"import cycles between units {found}:\n" + "\n".join(detail)


def test_no_import_from_a_layer_above(graph):
    upward = [
        f"{source} (layer {LAYER[source]}) imports {target} (layer {LAYER[target]}): "
        + ", ".join(places)
        for source, targets in graph.items()
        for target, places in targets.items()
        if source in LAYER and target in LAYER and LAYER[target] > LAYER[source]
    ]
    assert not upward, "imports from a layer above:\n" + "\n".join(upward)


def test_the_checks_see_lazy_imports_and_cycles(tmp_path):
    """The walker on a made-up package: a lazy import closes a cycle and goes upward."""
    package = tmp_path / "decodekit"
    (package / "engine").mkdir(parents=True)
    (package / "decode").mkdir()
    (package / "__init__.py").write_text("")
    (package / "params.py").write_text("")
    (package / "engine" / "__init__.py").write_text("")
    (package / "decode" / "__init__.py").write_text("")
    sample = "from decodekit.engine import run\nimport decodekit.params\n"
    (package / "decode" / "sample.py").write_text(sample)
    (package / "engine" / "run.py").write_text("def f():\n    from ..decode.sample import g\n")
    lazy = import_graph(package)
    assert lazy["engine"] == {"decode": ["decodekit/engine/run.py:2"]}
    assert set(lazy["decode"]) == {"engine", "params"}
    assert cycles(lazy) == [["decode", "engine"]]

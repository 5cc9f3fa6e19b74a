"""Draw kestrel's import layers from the code, for CONTRIBUTING.md's map.

A module's layer is one more than the highest layer among the kestrel modules it imports at
run time (``TYPE_CHECKING`` imports left out; imports inside functions counted: they are
dependencies too, only deferred); a module that imports none of kestrel is on layer 0. The
number of layers is the longest import chain. ``python -m tools.layers`` prints the block
CONTRIBUTING.md holds between its ``layers:begin``/``layers:end`` markers;
``--write`` rewrites it there; ``tests/unit/test_layering.py`` fails while the two differ.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "kestrel"
CONTRIBUTING = ROOT / "CONTRIBUTING.md"
BEGIN, END = "<!-- layers:begin -->", "<!-- layers:end -->"


def module_name(path: Path) -> str:
    """``kestrel.http.ui.pages`` for ``src/kestrel/http/ui/pages.py`` (a package: its
    ``__init__``, as ``kestrel.http.ui``)."""
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(tree: ast.AST, package: str, modules: set[str]) -> Iterator[str]:
    """The modules *tree* imports: ``from kestrel import codec`` imports ``kestrel.codec``
    (a package's ``__init__`` counts only where a name is taken from it)."""
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing_only |= {id(n) for n in ast.walk(node)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([node.module] if node.module else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield sub if sub in modules else base


def graph() -> dict[str, set[str]]:
    """Each kestrel module and the kestrel modules it imports at run time."""
    paths = {module_name(p): p for p in SRC.rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = {m for m in _runtime_imports(ast.parse(path.read_text()), package, set(paths))
                 if m in paths and m != name}
        edges[name] = found
    return edges


def layers(edges: dict[str, set[str]]) -> dict[str, int]:
    """Each module's layer (see the module docstring).

    Raises:
        ValueError: the imports form a cycle (it names one).
    """
    layer: dict[str, int] = {}
    visiting: list[str] = []

    def visit(name: str) -> int:
        if name in layer:
            return layer[name]
        if name in visiting:
            cycle = [*visiting[visiting.index(name):], name]
            raise ValueError("import cycle: " + " -> ".join(cycle))
        visiting.append(name)
        layer[name] = 1 + max((visit(m) for m in edges[name]), default=-1)
        visiting.pop()
        return layer[name]

    for name in sorted(edges):
        visit(name)
    return layer


def _unit(name: str) -> str:
    """The top-level module or package *name* belongs to (``http`` for ``kestrel.http.ui``)."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "kestrel"


def collapsed(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """*edges* with each package one node (``cli``, ``http``, ``statements``)."""
    units: dict[str, set[str]] = {}
    for name, found in edges.items():
        units.setdefault(_unit(name), set()).update(
            _unit(m) for m in found if _unit(m) != _unit(name))
    return units


def longest_chain(edges: dict[str, set[str]]) -> list[str]:
    """One longest import chain, from the top down."""
    layer = layers(edges)
    name = max(layer, key=lambda m: (layer[m], m))
    chain = [name]
    while edges[name]:
        name = max(edges[name], key=lambda m: (layer[m], m))
        chain.append(name)
    return chain


def block() -> str:
    """The Markdown CONTRIBUTING.md shows between its markers."""
    edges = graph()
    by_layer: dict[int, list[str]] = {}
    for name, n in layers(collapsed(edges)).items():
        by_layer.setdefault(n, []).append(name)
    chain = longest_chain(edges)
    lines = [BEGIN, "",
             f"{len(by_layer)} layers, each package one box (drawn from the code by "
             "`python -m tools.layers`, checked by `tests/unit/test_layering.py`): a module "
             "imports only modules on layers below its own, `TYPE_CHECKING` imports aside.",
             "", "| layer | modules and packages |", "|---|---|"]
    for n in sorted(by_layer, reverse=True):
        names = ", ".join(f"`{m}`" for m in sorted(by_layer[n]))
        lines.append(f"| {n} | {names} |")
    lines += ["", f"The longest chain of single modules is {len(chain)} long: "
              + " → ".join(f"`{m.removeprefix('kestrel.')}`" for m in chain) + "."]
    return "\n".join([*lines, "", END])


def current() -> str:
    """The block CONTRIBUTING.md holds now (markers included)."""
    text = CONTRIBUTING.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[start:end]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true",
                        help="rewrite the block in CONTRIBUTING.md")
    args = parser.parse_args()
    want = block()
    if args.write:
        CONTRIBUTING.write_text(CONTRIBUTING.read_text().replace(current(), want))
    else:
        print(want)
    return 0


if __name__ == "__main__":
    sys.exit(main())

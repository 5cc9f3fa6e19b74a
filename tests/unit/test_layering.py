"""Architecture rules checked on the source: layering of imports, SQL only in sql/."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import kestrel

SRC = Path(kestrel.__file__).resolve().parent
LOW_LEVEL = ["worker", "workflow", "db"]
HIGH_LEVEL = {"kestrel.supervisor", "kestrel.cli", "kestrel.migrate", "kestrel.demo"}
# demo.py shows a *user* approving from SQL, which is the point of that line.
SQL_ALLOWED = {"sql.py", "migrate.py", "db.py", "demo.py"}
SQL_START = re.compile(
    r"\s*(SELECT\b|INSERT\s+INTO\b|UPDATE\s+\S+\s+SET\b|DELETE\s+FROM\b|WITH\s+\w+\s+AS\s*\()",
    re.IGNORECASE)


def imported_modules(tree: ast.AST) -> set[str]:
    """Every module an import anywhere in *tree* (module level or in a function) names."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = "kestrel" if node.level else (node.module or "")
            if node.level and node.module:
                base = f"kestrel.{node.module}"
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def test_import_scanner_sees_every_form() -> None:
    tree = ast.parse(
        "import kestrel.cli\n"
        "def f():\n    from kestrel import supervisor\n"
        "async def g():\n    from .migrate import migrate\n"
        "class C:\n    def m(self):\n        import kestrel.demo as d\n"
    )
    assert imported_modules(tree) >= HIGH_LEVEL


@pytest.mark.parametrize("module", LOW_LEVEL)
def test_low_level_modules_do_not_import_high_level(module: str) -> None:
    tree = ast.parse((SRC / f"{module}.py").read_text())
    assert imported_modules(tree) & HIGH_LEVEL == set()


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def sql_literals(source: str) -> list[str]:
    tree = ast.parse(source)
    skip = _docstrings(tree)
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in skip
        and SQL_START.match(node.value)
    ]


def test_sql_literal_scanner_finds_sql() -> None:
    source = ('x = "  select 1"\ny = "UPDATE t SET a = 1"\nw = f"WITH x AS ({q})"\n'
              'z = "selection"\nv = " with key "\n')
    assert sql_literals(source) == ["  select 1", "UPDATE t SET a = 1", "WITH x AS ("]


@pytest.mark.parametrize(
    "path",
    sorted(p for p in SRC.glob("*.py") if p.name not in SQL_ALLOWED),
    ids=lambda p: p.name,
)
def test_no_sql_string_literals_outside_sql_layer(path: Path) -> None:
    assert sql_literals(path.read_text()) == []

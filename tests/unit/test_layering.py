"""Architecture rules checked on the source: layering of imports, no import cycles, SQL only
in sql/ and executed only by db.py, one client (the sync one generated from the async one),
docstrings on the public API."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest

import kestrel

SRC = Path(kestrel.__file__).resolve().parent
ROOT = SRC.parents[1]
LOW_LEVEL = ["worker", "runner", "claimer", "commits", "writer", "lease", "services",
             "workflow/__init__", "workflow/steps", "workflow/waits", "workflow/patches",
             "workflow/calls", "workflow/lanes", "db", "loops", "connections"]
HIGH_LEVEL = {"kestrel.supervisor", "kestrel.cli", "kestrel.boot", "kestrel.migrate",
              "kestrel.demo"}
SQL_ALLOWED = {"sql.py", "db.py"}
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
        "import kestrel.cli\nimport kestrel.boot\n"
        "def f():\n    from kestrel import supervisor\n"
        "async def g():\n    from .migrate import migrate\n"
        "class C:\n    def m(self):\n        import kestrel.demo as d\n"
    )
    assert imported_modules(tree) >= HIGH_LEVEL


@pytest.mark.parametrize("module", LOW_LEVEL)
def test_low_level_modules_do_not_import_high_level(module: str) -> None:
    tree = ast.parse((SRC / f"{module}.py").read_text())
    assert imported_modules(tree) & HIGH_LEVEL == set()


# Boot and CLI (issue 25, item 3): the boot sequence in one module, each command in a module
# of the cli package that shares only kestrel.cli.common with the others.
CLI = SRC / "cli"
CLI_SHARED = "kestrel.cli.common"
CLI_BULK = "kestrel.cli.bulk"
"""Shared by the commands that act on one id or on all that filters match (cancel, retry,
signal); declares no command and imports only the common module."""


def test_boot_alone_imports_both_the_supervisor_and_migrate() -> None:
    """The runtime's boot sequence (migrate or check, then supervise) is written once, in
    kestrel.boot; the CLI's handlers call it (the cli package is the one other allowed)."""
    both = {"kestrel.supervisor", "kestrel.migrate"}
    importers = {str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
                 if both <= imported_modules(ast.parse(p.read_text()))}
    assert {i for i in importers if not i.startswith("cli/")} == {"boot.py"}


def cli_imports(path: Path) -> set[str]:
    """The modules of the cli package that *path* imports (``kestrel.cli`` itself: the
    package, i.e. its ``__init__``)."""
    def ours(name: str) -> bool:
        return name == "kestrel.cli" or name.startswith("kestrel.cli.")

    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if ours(a.name))
        elif isinstance(node, ast.ImportFrom) and ours(node.module or ""):
            if node.module == "kestrel.cli":  # from kestrel.cli import common / main
                found.update(f"kestrel.cli.{a.name}" for a in node.names)
            else:
                found.add(node.module or "")
    return found


def test_cli_import_scanner_sees_every_form(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("from kestrel.cli import common\nfrom kestrel.cli.replay import x\n"
                   "from kestrel.client import SyncClient\n"
                   "def f():\n    import kestrel.cli.tokens\n    from kestrel.cli import main\n")
    assert cli_imports(src) == {"kestrel.cli.common", "kestrel.cli.replay",
                                "kestrel.cli.tokens", "kestrel.cli.main"}


@pytest.mark.parametrize("path", sorted(p for p in CLI.glob("*.py")
                                        if p.stem not in ("__init__", "__main__")),
                         ids=lambda p: p.name)
def test_cli_command_modules_share_only_the_common_module(path: Path) -> None:
    """A command module imports no other command module and not the package (whose
    __init__ imports every command): what they share is in kestrel.cli.common (and, for a
    bulk action, kestrel.cli.bulk)."""
    allowed = (set() if path.stem == "common" else {CLI_SHARED} if path.stem == "bulk"
               else {CLI_SHARED, CLI_BULK})
    assert cli_imports(path) <= allowed, path.name


@pytest.mark.parametrize("path", sorted(SRC.rglob("*.py")),
                         ids=lambda p: str(p.relative_to(SRC)))
def test_no_module_is_over_600_lines(path: Path) -> None:
    """Each home small enough to read whole (issue 25): the CLI was one 1,400-line module,
    the HTTP door one of 683, the test kit 813, the workflow context 736."""
    assert len(path.read_text().splitlines()) <= 600


@pytest.mark.parametrize("path", sorted((ROOT / "sql").rglob("*.sql")),
                         ids=lambda p: str(p.relative_to(ROOT / "sql")))
def test_no_sql_file_is_over_600_lines(path: Path) -> None:
    """The same rule for SQL (issue 39): the functions were one file of 1,727 lines; they
    are five, one family each (sql/functions/00_rules.sql says the order)."""
    assert len(path.read_text().splitlines()) <= 600



# The two HTTP doors (issue 25). The API's side: the route table (app), its handlers (api)
# and the webhooks (webhooks). The UI's side: the ui package (render, pages, forms) on the
# sessions it alone uses. They share tokens (auth), refusals, request parts and metrics
# (observe) through modules of their own, and their statements (kestrel.statements.http);
# neither side imports the other, sessions imports neither door, and the shared modules
# import neither door nor sessions. Within the API's side the arrows point one way:
# app -> webhooks -> api.
HTTP = SRC / "http"
API_SIDE = {"kestrel.http.app", "kestrel.http.api", "kestrel.http.webhooks"}
UI_SIDE = {"kestrel.http.ui", "kestrel.http.sessions"}
HTTP_DOORS = API_SIDE | {"kestrel.http.ui"}
HTTP_SHARED = ["auth", "refusals", "requests", "observe"]
UI_FILES = sorted(p.relative_to(HTTP).as_posix() for p in (HTTP / "ui").glob("*.py"))
DOOR_FILES = ["app.py", "api.py", "webhooks.py", "sessions.py", *UI_FILES]


def http_imports(path: str) -> set[str]:
    """The modules *path* (under kestrel/http) imports, each with every package above it
    (``kestrel.http.ui.pages`` also names ``kestrel.http.ui``)."""
    found = imported_modules(ast.parse((HTTP / path).read_text()))
    return {".".join(name.split(".")[:n]) for name in found
            for n in range(1, name.count(".") + 2)}


def test_http_import_scanner_sees_a_package_through_its_modules() -> None:
    assert "kestrel.http.ui" in http_imports("ui/__init__.py")
    assert {"kestrel.http.sessions", "kestrel.http.ui"} <= http_imports("ui/forms.py")


def test_the_ui_is_a_package_of_its_own() -> None:
    assert {"__init__.py", "render.py", "pages.py", "forms.py"} <= {
        p.name for p in (HTTP / "ui").glob("*.py")}
    assert not (HTTP / "ui.py").exists()


@pytest.mark.parametrize("path", UI_FILES)
def test_the_ui_does_not_import_the_api(path: str) -> None:
    assert http_imports(path) & API_SIDE == set()


@pytest.mark.parametrize("path", ["app.py", "api.py", "webhooks.py"])
def test_the_api_does_not_import_the_ui_or_its_sessions(path: str) -> None:
    assert http_imports(path) & UI_SIDE == set()


def test_sessions_import_neither_door() -> None:
    assert http_imports("sessions.py") & HTTP_DOORS == set()


def test_the_api_side_points_one_way() -> None:
    """app builds the route table from api's and webhooks' handlers; neither imports it
    back, and the API's handlers do not import the webhooks (a hook signals through
    api.send_signal)."""
    assert "kestrel.http.app" not in http_imports("api.py") | http_imports("webhooks.py")
    assert "kestrel.http.webhooks" not in http_imports("api.py")


@pytest.mark.parametrize("module", HTTP_SHARED)
def test_what_the_http_doors_share_imports_neither_door(module: str) -> None:
    assert http_imports(f"{module}.py") & (HTTP_DOORS | UI_SIDE) == set()


@pytest.mark.parametrize("path", DOOR_FILES)
def test_one_refusal_type_for_both_doors(path: str) -> None:
    """The doors refuse with kestrel.http.refusals.Refusal; none defines its own (they
    had ApiError and UiError, the same class twice)."""
    tree = ast.parse((HTTP / path).read_text())
    own = [node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
           and any(isinstance(b, ast.Name) and b.id.endswith(("Exception", "Error"))
                   for b in node.bases)]
    assert own == [], (path, own)


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
    sorted(p for p in SRC.rglob("*.py") if p.name not in SQL_ALLOWED or p.parent != SRC),
    ids=lambda p: str(p.relative_to(SRC)),
)
def test_no_sql_string_literals_outside_sql_layer(path: Path) -> None:
    assert sql_literals(path.read_text()) == []


# -- one place for SQL, no import cycles, one client -----------------------------------------

EXECUTING = {"execute", "executemany", "copy"}
DB_ONLY = {"db.py"}


def executed_sql(source: str, *, overrides: bool = False) -> list[int]:
    """Lines of *source* that call ``.execute``/``.executemany``/``.copy`` on something.

    *overrides*: leave out ``super().execute(...)``, a connection class's override passing
    on what it was given (kestrel.connections' lock_timeout classes)."""
    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in EXECUTING
            and not (overrides and ast.unparse(node.func.value) == "super()")]


def test_execution_scanner_finds_calls() -> None:
    source = ("conn.execute('x')\nawait cur.executemany(q, [])\nwith c.copy(q) as cp:\n"
              "    pass\nexecutor.submit(f)\n")
    assert executed_sql(source) == [1, 2, 3]
    assert executed_sql("super().execute(q)\nconn.execute(q)\n", overrides=True) == [2]


@pytest.mark.parametrize("path", sorted(p for p in SRC.rglob("*.py")
                                        if p.name not in DB_ONLY or p.parent != SRC),
                         ids=lambda p: str(p.relative_to(SRC)))
def test_sql_is_executed_only_by_db(path: Path) -> None:
    """kestrel.connections opens connections; what it sends is only what its lock_timeout
    classes' overrides put in front of each statement they pass on (``super().execute``)."""
    overrides = path == SRC / "connections.py"
    assert executed_sql(path.read_text(), overrides=overrides) == [], \
        f"{path.name} executes SQL; use kestrel.db"


def module_imports(path: Path) -> set[str]:
    """The kestrel modules *path* imports at run time (``TYPE_CHECKING`` blocks excluded)."""
    tree = ast.parse(path.read_text())
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing_only |= {id(n) for n in ast.walk(node)}
    found = set()
    known = {p.stem for p in SRC.glob("*.py")} | {"cli", "http", "statements", "workflow"}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "kestrel" and len(parts) > 1 and parts[1] in known:
                found.add(parts[1])
    found.discard(path.stem)
    if path.parent == SRC / "cli":
        found.discard("cli")
    return found


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle of *graph* found by a depth-first search (each reported once)."""
    cycles: list[list[str]] = []
    seen: set[frozenset[str]] = set()

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                cycle = path[path.index(nxt):]
                if frozenset(cycle) not in seen:
                    seen.add(frozenset(cycle))
                    cycles.append([*cycle, nxt])
            elif len(path) < len(graph):
                visit(nxt, [*path, nxt])

    for start in sorted(graph):
        visit(start, [start])
    return cycles


def test_cycle_finder_finds_a_cycle() -> None:
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [
        ["a", "b", "c", "a"]]


PACKAGES = ("cli", "http", "statements", "workflow")


def test_no_import_cycles() -> None:
    """Between the top-level modules, each package (cli, http, statements) one node."""
    graph = {p.stem: module_imports(p) for p in SRC.glob("*.py") if p.stem != "__init__"}
    for package in PACKAGES:
        graph[package] = set().union(*(module_imports(p) - {package}
                                       for p in (SRC / package).rglob("*.py")))
    graph = {k: {m for m in v if m != "__init__"} for k, v in graph.items()}
    assert import_cycles(graph) == []


# -- statements: one module of kestrel/statements per file of sql/queries --------------------

STATEMENTS = SRC / "statements"
RAW_TEXT = {"set_lock_timeout", "set_statement_timeout"}
"""Statements the connection layer sends as raw text ahead of another statement (the
pipelined lock_timeout of a connection behind a pooler, the HTTP door's statement_timeout),
so they have no builder."""


def query_files() -> dict[str, str]:
    """Every named statement of sql/queries by name: the file (stem) that holds it."""
    from kestrel.sql import parse_named, sql_dir

    return {name: path.stem for path in sorted((sql_dir() / "queries").glob("*.sql"))
            for name in parse_named(path.read_text())}


def queries_read(source: str) -> set[str]:
    """The named statements *source* reads off a Queries value: ``q.name``,
    ``self._q.name``, ``app.state.q.name`` or ``queries(schema).name``."""
    names = set(query_files())
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in names:
            base = node.value
            if ((isinstance(base, ast.Name) and base.id == "q")
                    or (isinstance(base, ast.Attribute) and base.attr in ("q", "_q"))
                    or (isinstance(base, ast.Call) and isinstance(base.func, ast.Name)
                        and base.func.id == "queries")):
                found.add(node.attr)
    return found


def test_queries_scanner_sees_every_form() -> None:
    source = ("a = q.submit\nb = self._q.signal\nc = app.state.q.fork\n"
              "d = queries(s).listen\ne = client.submit\n")
    assert queries_read(source) == {"submit", "signal", "fork", "listen"}


def test_each_sql_file_has_one_statements_module() -> None:
    files = set(query_files().values())
    modules = {p.stem for p in STATEMENTS.glob("*.py")} - {"__init__", "stmt"}
    assert modules == files


@pytest.mark.parametrize("name", sorted(set(query_files()) - RAW_TEXT))
def test_each_statement_is_built_in_the_module_of_its_file(name: str) -> None:
    """``-- name: X`` of sql/queries/F.sql is built in kestrel/statements/F.py, and read
    off a Queries value nowhere else."""
    home = query_files()[name]
    readers = {str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
               if name in queries_read(p.read_text())}
    assert readers == {f"statements/{home}.py"}


STATEMENT_DEPS = {"kestrel.statements", "kestrel.sql", "kestrel.types", "kestrel.codec",
                  "kestrel.errors", "kestrel.config"}


@pytest.mark.parametrize("path", sorted(STATEMENTS.glob("*.py")), ids=lambda p: p.name)
def test_statements_do_no_io(path: Path) -> None:
    """A builder says what to send and how to read the rows; it imports nothing that
    connects, executes or runs workflows."""
    found = {m for m in imported_modules(ast.parse(path.read_text()))
             if m.startswith("kestrel.")}
    outside = {m for m in found if not any(m == d or m.startswith(d + ".")
                                           for d in STATEMENT_DEPS)}
    assert outside == set(), path.name


def test_db_is_only_the_executor() -> None:
    """db.py builds no statement: it reads no named statement off a Queries value and
    defines no function that takes one."""
    source = (SRC / "db.py").read_text()
    assert queries_read(source) == set()
    takes_queries = [node.name for node in ast.walk(ast.parse(source))
                     if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                     and any(ast.unparse(a.annotation or ast.Constant(None)) == "Queries"
                             for a in node.args.args + node.args.kwonlyargs)]
    assert takes_queries == []


def load_tool(name: str) -> Any:
    """The module ``tools/<name>.py`` (tools/ is not a package on the path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_sync_client_is_generated_from_the_async_one() -> None:
    """client_sync.py is exactly what tools/unasync.py makes of client_async.py."""
    unasync = load_tool("unasync")
    want = unasync.generate((SRC / "client_async.py").read_text())
    assert (SRC / "client_sync.py").read_text() == want, "run `make unasync`"


def test_both_clients_offer_the_same_calls() -> None:
    """Every public call of either client (and of their handles) exists on the other with
    the same parameters, and is a coroutine on the async side only (issue 18)."""
    import inspect

    from kestrel.client import Client, Handle, SyncClient, SyncHandle

    def calls(cls: type) -> dict[str, list[str]]:
        return {name: list(inspect.signature(fn).parameters)
                for name, fn in inspect.getmembers(cls, inspect.isfunction)
                if not name.startswith("_")}

    for async_cls, sync_cls in ((Client, SyncClient), (Handle, SyncHandle)):
        assert calls(async_cls) == calls(sync_cls)
        assert {"submit", "result", "get"} & set(calls(async_cls))
        for name in calls(async_cls):
            assert inspect.iscoroutinefunction(getattr(async_cls, name)), name
            assert not inspect.iscoroutinefunction(getattr(sync_cls, name)), name
    for name in ("submit", "signal", "cancel", "retry", "fork", "get", "steps", "list",
                 "stats", "result", "get_event", "close"):
        assert name in calls(Client), name


def test_public_functions_and_classes_have_docstrings() -> None:
    missing = []
    for path in sorted(SRC.rglob("*.py")):  # kestrel.http included
        tree = ast.parse(path.read_text())
        for node in tree.body:
            nodes = [node]
            if isinstance(node, ast.ClassDef):
                nodes += [n for n in node.body
                          if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
            for n in nodes:
                if not isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    continue
                if n.name.startswith("_") or any(
                        isinstance(d, ast.Name) and d.id == "overload"
                        for d in n.decorator_list):
                    continue
                if not ast.get_docstring(n):
                    missing.append(f"{path.name}:{n.lineno} {n.name}")
    assert missing == []


def test_contributing_shows_the_import_layers_drawn_from_the_code() -> None:
    """CONTRIBUTING.md's layers are what tools/layers.py draws from the imports now (run
    ``python -m tools.layers --write`` after a change of them); drawing them also proves the
    module-level imports have no cycle."""
    layers = load_tool("layers")
    assert layers.current() == layers.block(), "run `python -m tools.layers --write`"


def test_layers_are_drawn_from_the_longest_chain() -> None:
    layers = load_tool("layers")
    edges = {"a": {"b", "c"}, "b": {"c"}, "c": set(), "d": {"a"}}
    assert layers.layers(edges) == {"a": 2, "b": 1, "c": 0, "d": 3}
    assert layers.longest_chain(edges) == ["d", "a", "b", "c"]
    with pytest.raises(ValueError, match="import cycle"):
        layers.layers({"a": {"b"}, "b": {"a"}})


# -- services: one shape (kestrel.loops.Service) ----------------------------------------------


def service_classes() -> dict[str, ast.ClassDef]:
    """Every class of src with a ``run_once``: each is a worker's service."""
    found = {}
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
                    and f.name == "run_once" for f in node.body):
                found[f"{path.relative_to(SRC)}:{node.name}"] = node
    return found


def test_the_services_are_found() -> None:
    names = {k.split(":")[1] for k in service_classes()}
    assert {"Claimer", "Heartbeat", "Sweeper", "Upkeep", "Scheduler", "Stats", "Listener",
            "Registration", "CheckpointCommits", "Completions", "Ticker"} <= names


@pytest.mark.parametrize("where", sorted(service_classes()))
def test_every_service_has_the_one_shape(where: str) -> None:
    """A class with a round (``run_once``) is a Service: it has its ``run`` and a ``name``
    (a class attribute, or one set in ``__init__``), in its own body or a base's of src."""
    classes = {k.split(":")[1]: v for k, v in service_classes().items()}
    all_classes = {node.name: node for path in SRC.rglob("*.py")
                   for node in ast.walk(ast.parse(path.read_text()))
                   if isinstance(node, ast.ClassDef)}

    def members(node: ast.ClassDef) -> set[str]:
        found = {f.name for f in node.body
                 if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)}
        found |= {t.id for a in node.body if isinstance(a, ast.Assign | ast.AnnAssign)
                  for t in ([a.target] if isinstance(a, ast.AnnAssign) else a.targets)
                  if isinstance(t, ast.Name)}
        found |= {t.attr for n in ast.walk(node) if isinstance(n, ast.Assign)
                  for t in n.targets if isinstance(t, ast.Attribute)
                  and isinstance(t.value, ast.Name) and t.value.id == "self"}
        for base in node.bases:
            name = ast.unparse(base).split("[")[0].split(".")[-1]
            if name in all_classes:
                found |= members(all_classes[name])
        return found

    node = classes[where.split(":")[1]]
    assert {"name", "run", "run_once"} <= members(node), where

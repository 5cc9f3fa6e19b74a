"""Load the SQL in ``sql/`` once, with the schema name filled in.

Statements live in ``sql/queries/*.sql`` under ``-- name: <name>`` headers; migrations in
``sql/migrations/NNNN_<name>.sql``. ``__schema__`` becomes the quoted schema identifier and
``__schema_name__`` the bare name (for NOTIFY channels). The schema name is validated by
:class:`kestrel.config.Config` against :data:`SCHEMA_NAME` before it gets here, so the
substitution cannot inject anything.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path

from kestrel.errors import ConfigError

SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,47}")
"""What a schema name may be: it is written into every statement (``__schema__``), so it is
checked here, where that happens, and by :class:`kestrel.config.Config` before. At most 48
characters: the longest notification channel, ``kestrel.<schema>.events``, must fit
PostgreSQL's 63 bytes (a longer channel fails every statement that notifies on it)."""

SCHEMA_RULE = ("1-48 of a-z 0-9 _, not starting with a digit (the notification channel "
               "kestrel.<schema>.events must fit PostgreSQL's 63 bytes)")
"""What :data:`SCHEMA_NAME` asks, in the errors that refuse a name."""


def sql_dir() -> Path:
    """Return the directory holding ``queries/`` and ``migrations/``."""
    packaged = Path(__file__).parent / "sql"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[2] / "sql"


@dataclass(frozen=True, slots=True)
class Queries:
    """Every named statement, ready to execute for one schema, under the file that holds
    it (``sql/queries/<file>.sql``, built by ``kestrel/statements/<file>.py``)."""

    # sql/queries/client.sql (kestrel/statements/client.py)
    submit: str
    signal: str
    cancel: str
    retry: str
    fork: str
    get_event: str
    listen_done: str
    listen_events: str
    get_execution: str
    list_steps: str
    count_by_status: str
    list_executions: str
    queue_stats: str
    worker_stats: str
    fork_source: str
    # sql/queries/executions.sql (kestrel/statements/executions.py)
    claim_batch: str
    set_lock_timeout: str
    take_lease: str
    heartbeat: str
    running_under: str
    end_leases: str
    complete_batch: str
    complete_batch_delegated: str
    release_batch: str
    give_back: str
    park: str
    finished_readback: str
    # sql/queries/history.sql (kestrel/statements/history.py)
    maintenance_lock: str
    ensure_partitions: str
    drop_partitions: str
    list_partitions: str
    take_uncounted_finishes: str
    # sql/queries/http.sql (kestrel/statements/http.py)
    set_statement_timeout: str
    create_token: str
    list_tokens: str
    revoke_token: str
    get_token: str
    live_token: str
    create_session: str
    get_session: str
    end_session: str
    end_token_sessions: str
    page_executions: str
    count_executions: str
    get_wait: str
    list_events: str
    pending_signals: str
    list_children: str
    list_queue_limits: str
    list_schedules: str
    signal_sent: str
    hook_submit: str
    # sql/queries/migrate.sql (kestrel/statements/migrate.py)
    migrate_lock: str
    create_schema: str
    may_migrate: str
    migrations_table_exists: str
    applied_migrations: str
    current_migration: str
    record_migration: str
    ensure_current_partitions: str
    set_clock_kind: str
    has_test_clock: str
    lock_test_clock: str
    delegate_functions: str
    distributed_schema: str
    functions_version: str
    node_lock_timeout: str
    bucket_table_exists: str
    migrate_finished: str
    read_bucket: str
    record_bucket: str
    set_bucket: str
    # sql/queries/notify.sql (kestrel/statements/notify.py)
    listen: str
    wake_workers: str
    notify_done: str
    # sql/queries/queues.sql (kestrel/statements/queues.py)
    upsert_queue_limit: str
    limits_of: str
    remove_queue_limit: str
    lock_queue_limit: str
    claim_limited: str
    lock_namespace_limit: str
    running_in_queue: str
    claim_limited_in_namespace: str
    running_by_key: str
    claim_keyed: str
    record_namespace_starts: str
    db_now: str
    upsert_schedule: str
    advance_schedule: str
    get_schedule: str
    # sql/queries/steps.sql (kestrel/statements/steps.py)
    save_steps_batch: str
    save_new_steps_batch: str
    save_new_steps_delegated: str
    save_steps_delegated: str
    load_step: str
    consume_signal: str
    set_event: str
    set_tags: str
    # sql/queries/sweeper.sql (kestrel/statements/sweeper.py)
    reenqueue_expired: str
    reenqueue_expired_delegated: str
    expire_deadlines: str
    expire_deadlines_delegated: str
    expire_worker_leases: str
    # sql/queries/testing.sql (kestrel/statements/testing.py)
    advance_clock: str
    skip_to_next_sleep: str
    waiting_for: str
    reset_for_test: str
    drop_schema: str
    # sql/queries/ui.sql (kestrel/statements/ui.py)
    ui_counts: str
    search_history: str
    ui_waits: str
    ui_sent_signal: str
    ui_retried: str
    # sql/queries/versions.sql (kestrel/statements/versions.py)
    register_worker: str
    unregister_worker: str
    live_workers: str
    unclaimable_total: str
    unclaimable_by_workflow: str
    patch_summary: str
    replay_history: str
    # sql/queries/waits.sql (kestrel/statements/waits.py)
    waiting_stats: str


_HEADER = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


def parse_named(text: str) -> dict[str, str]:
    """Split a file into ``{name: statement}`` at its ``-- name:`` headers."""
    parts = _HEADER.split(text)
    pairs = zip(parts[1::2], parts[2::2], strict=True)
    return {name: body.strip().rstrip(";") for name, body in pairs}


def render(text: str, schema: str) -> str:
    """Fill the schema placeholders into *text*."""
    if not SCHEMA_NAME.fullmatch(schema):
        raise ConfigError(f"invalid schema name {schema[:100]!r}: {SCHEMA_RULE}")
    return text.replace("__schema_name__", schema).replace("__schema__", f'"{schema}"')


_INCLUDE = re.compile(r"^[ \t]*-- include: (\w+)[ \t]*$", re.MULTILINE)


def fragments() -> dict[str, str]:
    """Every ``-- name:`` fragment of ``sql/fragments``: a part of statements written once
    (the claims' lease, their change to their rows and their result)."""
    found: dict[str, str] = {}
    for path in sorted((sql_dir() / "fragments").glob("*.sql")):
        found.update(parse_named(path.read_text()))
    return found


def named_statements() -> dict[str, str]:
    """Return every ``-- name:`` statement of ``sql/queries`` (placeholders unfilled), each
    ``-- include: <fragment>`` line replaced by that fragment of ``sql/fragments``, without
    its comments (:func:`strip_comments`) but one that names it, ``/* kestrel <name> */``."""
    parts = fragments()
    found: dict[str, str] = {}
    for path in sorted((sql_dir() / "queries").glob("*.sql")):
        for name, body in parse_named(path.read_text()).items():
            if name in found:
                raise RuntimeError(f"query {name!r} is defined twice (again in {path.name})")

            def include(m: re.Match[str], name: str = name) -> str:
                if m.group(1) not in parts:
                    raise RuntimeError(f"query {name!r} includes {m.group(1)!r}, which "
                                       "sql/fragments does not define")
                return parts[m.group(1)]

            # One comment stays, the statement's name, for whoever reads pg_stat_activity or
            # pg_stat_statements.
            found[name] = f"/* kestrel {name} */ " + strip_comments(_INCLUDE.sub(include, body))
    return found


_NAMES: dict[str, str] = {}


def statement_name(text: str) -> str | None:
    """The ``-- name:`` of a statement of :func:`queries` (rendered for any schema loaded in
    this process), or None for any other text (a migration, a DDL of the test kit)."""
    return _NAMES.get(text)


def derived(name: str, text: str) -> str:
    """*text*, made from the statement *name* by writing a checked value in place of a
    marker (a DDL body takes no parameters), known by that name from now on (to the
    lost-reply failpoints, as its rendered text is)."""
    _NAMES[text] = name
    return text


@functools.cache
def queries(schema: str) -> Queries:
    """Return the statements for *schema*, loaded and rendered once per process."""
    statements = named_statements()
    rendered = {f.name: render(statements[f.name], schema) for f in fields(Queries)}
    _NAMES.update((text, name) for name, text in rendered.items())
    return Queries(**rendered)


@dataclass(frozen=True, slots=True)
class Migration:
    """One file of ``sql/migrations``: its version, name and rendered text."""

    version: int
    name: str
    text: str

    @property
    def statements(self) -> list[str]:
        """The file's statements, in order, as :func:`split_statements` cuts them:
        ``migrate`` sends each on its own (issue 24: Citus propagates a DDL command to the
        worker nodes with the whole text the client sent, and a worker refuses several
        commands in one prepared statement)."""
        return split_statements(self.text)


_DOLLAR_TAG = re.compile(r"\$(?:[A-Za-z_\x80-\uffff][A-Za-z0-9_\x80-\uffff]*)?\$")
_IDENT_CHAR = re.compile(r"[A-Za-z0-9_$\x80-\uffff]")


def _lex(text: str) -> Iterator[tuple[str, int, int]]:
    """Cut SQL *text* as PostgreSQL's lexer does, into ``(kind, start, end)`` pieces that
    cover it in order: ``"comment"`` (a ``--`` comment up to its line's end, the newline
    not included, or a nested ``/* */`` one), ``";"`` (a semicolon outside any of these),
    ``"quoted"`` (a ``'...'`` or ``E'...'`` string, a ``"..."`` identifier or a
    ``$tag$...$tag$`` dollar-quoted body, whole; an ``E`` prefix stays in the code before
    it) and ``"code"`` (the rest)."""
    start = i = 0
    n = len(text)
    while i < n:
        c = text[i]
        if c == "-" and text.startswith("--", i):
            end = text.find("\n", i)
            end = n if end < 0 else end
            if start < i:
                yield "code", start, i
            yield "comment", i, end
            start = i = end
            continue
        if c == "/" and text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            if start < i:
                yield "code", start, i
            yield "comment", i, j
            start = i = j
            continue
        if c == ";":
            if start < i:
                yield "code", start, i
            yield ";", i, i + 1
            start = i = i + 1
            continue
        if c == "'":
            backslash = i > 0 and text[i - 1] in "eE" and (
                i < 2 or not _IDENT_CHAR.match(text[i - 2]))
            j = i + 1
            while j < n:
                if backslash and text[j] == "\\":
                    j += 2
                elif text[j] == "'":
                    if text.startswith("''", j):
                        j += 2
                    else:
                        break
                else:
                    j += 1
            end = min(j + 1, n)
        elif c == '"':
            end = text.find('"', i + 1)
            while end >= 0 and text.startswith('""', end):
                end = text.find('"', end + 2)
            end = n if end < 0 else end + 1
        elif c == "$" and not (i > 0 and _IDENT_CHAR.match(text[i - 1])) and (
                tag := _DOLLAR_TAG.match(text, i)):
            end = text.find(tag.group(), tag.end())
            end = n if end < 0 else end + len(tag.group())
        else:
            i += 1
            continue
        if start < i:
            yield "code", start, i
        yield "quoted", i, end
        start = i = end
    if start < n:
        yield "code", start, min(i, n)


def split_statements(text: str) -> list[str]:
    """Cut a script of several SQL statements at its top-level semicolons, as PostgreSQL's
    lexer does (:func:`_lex`): not inside a comment, a string, a quoted identifier or a
    dollar-quoted body. Returns each statement without its semicolon, comments kept; a part
    that is only whitespace and comments (the text after the last semicolon) is dropped.

    No kestrel script uses ``BEGIN ATOMIC`` bodies, whose semicolons this would cut (a unit
    test keeps it so)."""
    out: list[str] = []
    begin = 0
    code = False  # whether the current part has anything besides whitespace and comments
    for kind, start, end in _lex(text):
        if kind == ";":
            if code:
                out.append(text[begin:start].strip())
            begin, code = end, False
        elif kind != "comment" and not code and not text[start:end].isspace():
            code = True
    if code:
        out.append(text[begin:].strip())
    return out


def strip_comments(text: str) -> str:
    """*text* without its comments (:func:`_lex`), what a statement sends: a line that held
    only a comment goes whole, a comment after code goes with the blanks before it; strings,
    identifiers and dollar-quoted bodies are kept byte for byte; so is the code but for the
    indentation of its lines. The statements' comments and layout are for their readers,
    and a text over psycopg's 4,096-byte cache limit is parsed for its placeholders again
    at every execution (the claim's 7.5 KB: 56 µs a call against 5)."""
    out = ""
    after_comment = False
    for kind, start, end in _lex(text):
        if kind == "comment":
            after_comment = True
            continue
        piece = _INDENT.sub("\n", text[start:end]) if kind == "code" else text[start:end]
        if after_comment and piece.startswith("\n"):
            # The comment ended its line: its blanks go, and the line itself when nothing
            # else was on it.
            out = out.rstrip(" \t")
            if not out or out.endswith("\n"):
                piece = piece[1:]
        elif after_comment and kind == "code" and (not out or out.endswith("\n")):
            piece = piece.lstrip(" \t")  # a comment that began its line: no indentation
        after_comment = False
        out += piece
    return out.strip()


_INDENT = re.compile(r"\n[ \t]+")


_FUNCTION = re.compile(r"CREATE OR REPLACE FUNCTION __schema__\.(\w+)\(")


def function_definitions() -> dict[str, str]:
    """Every kestrel SQL function by its name in the database, as defined now:
    ``sql/functions`` (the runtime's functions) and ``sql/partitions`` (partition upkeep),
    placeholders unfilled."""
    found: dict[str, str] = {}
    for folder in ("functions", "partitions"):
        for path in sorted((sql_dir() / folder).glob("*.sql")):
            for body in parse_named(path.read_text()).values():
                match = _FUNCTION.search(body)
                if match is None:
                    raise RuntimeError(f"{folder}/{path.name}: a statement that defines no "
                                       "function")
                name = match.group(1)
                if name in found:
                    raise RuntimeError(f"function {name!r} is defined twice (again in "
                                       f"{folder}/{path.name})")
                found[name] = body
    return found


def movable_clock_definitions() -> dict[str, str]:
    """The statements that give a schema made for tests its movable clock
    (``sql/testclock``), by name, placeholders unfilled; ``migrate`` applies them, in order,
    after the functions, to such a schema only (migration 0016)."""
    return parse_named((sql_dir() / "testclock" / "test_clock.sql").read_text())


def movable_clock(schema: str) -> list[str]:
    """:func:`movable_clock_definitions` rendered for *schema*, in order, one statement
    each (:func:`split_statements`)."""
    return [statement for body in movable_clock_definitions().values()
            for statement in split_statements(render(body, schema))]


def functions_version() -> int:
    """The version of ``sql/functions`` this code needs (``kestrel_functions_version()``,
    read from its definition there, its one home)."""
    body = function_definitions()["kestrel_functions_version"]
    found = re.search(r"\$\$\s*SELECT\s+(\d+)\s*\$\$", body)
    if found is None:
        raise RuntimeError("sql/functions: kestrel_functions_version() must return a number")
    return int(found.group(1))


def functions(schema: str) -> list[str]:
    """Return the ``CREATE OR REPLACE FUNCTION`` statements of every kestrel function,
    rendered for *schema*; ``migrate`` applies them after the migrations, every time."""
    return [render(body, schema) for body in function_definitions().values()]


def migrations(schema: str) -> list[Migration]:
    """Return the migrations in order, rendered for *schema*."""
    found = []
    for path in sorted((sql_dir() / "migrations").glob("[0-9][0-9][0-9][0-9]_*.sql")):
        version = int(path.name[:4])
        found.append(Migration(version, path.stem[5:], render(path.read_text(), schema)))
    versions = [m.version for m in found]
    if versions != list(range(1, len(found) + 1)):
        raise RuntimeError(f"migrations must be numbered 1..n without gaps, found {versions}")
    return found

"""One schema truth: every SQL function is defined once, in sql/functions or sql/partitions,
and a migrated schema holds exactly those definitions."""

from __future__ import annotations

import re

import pytest

from kestrel.migrate import migrate
from kestrel.sql import function_definitions, movable_clock_definitions, render
from tests.helpers import q

BODY = re.compile(r"\$\$(.*)\$\$", re.S)


def _installed(pg_dsn: str, schema: str) -> list[tuple[str, str]]:
    return [(r[0], r[1]) for r in q(
        pg_dsn, schema, "SELECT p.proname, p.prosrc FROM pg_proc AS p "
        "JOIN pg_namespace AS n ON n.oid = p.pronamespace WHERE n.nspname = %s", [schema])]


def test_the_schema_holds_exactly_the_functions_defined_in_one_place(
    pg_dsn: str, schema: str, production_schema: str
) -> None:
    """A production schema holds exactly sql/functions and sql/partitions; a schema made for
    tests (the fixture's) those and sql/testclock's, its kestrel_now() rewritten by the
    clock trigger to now() plus the offset (zero after migrate)."""
    defined = function_definitions()
    testclock = {k: v for k, v in movable_clock_definitions().items()
                 if "CREATE OR REPLACE FUNCTION" in v}
    for name_, wanted in ((production_schema, defined), (schema, {**defined, **testclock})):
        rows = _installed(pg_dsn, name_)
        # No function a migration created and the files no longer define; no stale overload.
        assert sorted(r[0] for r in rows) == sorted(wanted)
        for name, source in rows:
            if name == "kestrel_now" and name_ == schema:
                assert source == "SELECT now() + 'PT0S'::interval"
                continue
            body = BODY.search(render(wanted[name], name_))
            assert body is not None, name
            assert source == body.group(1), f"{name} differs from its definition in sql/"


def test_migrate_again_reapplies_the_definitions(pg_dsn: str, schema: str) -> None:
    """A function changed in the database (or by an old migration) is put back to the
    file's definition by the next migrate, with no new migration."""
    q(pg_dsn, schema, "CREATE OR REPLACE FUNCTION {s}.valid_queue_name(p_queue text) "
      "RETURNS boolean LANGUAGE sql IMMUTABLE AS $$ SELECT true $$")
    assert q(pg_dsn, schema, "SELECT {s}.valid_queue_name('no spaces allowed')") == [(True,)]
    assert migrate(pg_dsn, schema) == []  # nothing pending
    assert q(pg_dsn, schema, "SELECT {s}.valid_queue_name('no spaces allowed')") == [(False,)]


def test_the_longest_schema_name_notifies_on_every_channel(pg_dsn: str) -> None:
    """48 characters, the most a schema name may have: kestrel.<schema>.events, its longest
    notification channel, is 63 bytes, PostgreSQL's limit. A submit (the workers' channel),
    an event (events), a signal and the completion (done) all go through, heard by a
    client that listens; one character more is refused before anything is written."""
    import threading

    import psycopg

    from kestrel.client import SyncClient
    from kestrel.config import Config
    from kestrel.errors import ConfigError
    from tests.apps import ledger_app as app
    from tests.helpers import config, run_worker_until

    name = "k" * 48
    assert len(f"kestrel.{name}.events") == 63
    migrate(pg_dsn, name)
    try:
        client = SyncClient(pg_dsn, schema=name, pool_size=0, listen_dsn=pg_dsn)
        h = client.submit(app.progress)
        got: dict[str, object] = {}

        def wait() -> None:
            got["stage"] = client.get_event(h.id, "stage", timeout=30)
            client.signal(h.id, "go")
            got["result"] = client.result(h.id, timeout=30)

        waiter = threading.Thread(target=wait)
        waiter.start()
        run_worker_until(pg_dsn, config(name, listen=True), lambda: "result" in got,
                         timeout=40)
        waiter.join(timeout=5)
        assert got["result"] == "done" and got["stage"] in ("analyzing", "fixing")
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA "{name}" CASCADE')
    for refused in (lambda: Config(schema="k" * 49),
                    lambda: SyncClient(pg_dsn, schema="k" * 49, pool_size=0),
                    lambda: migrate(pg_dsn, "k" * 49)):
        with pytest.raises(ConfigError, match="63 bytes"):
            refused()
    assert q(pg_dsn, "public", "SELECT count(*) FROM pg_namespace WHERE nspname = %s",
             ["k" * 49]) == [(0,)]
    # Why: PostgreSQL refuses the 64-byte channel that name would need.
    with psycopg.connect(pg_dsn, autocommit=True) as conn, \
            pytest.raises(psycopg.errors.InvalidParameterValue, match="channel name too long"):
        conn.execute("SELECT pg_notify(%s, '')", [f"kestrel.{'k' * 49}.events"])

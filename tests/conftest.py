"""Shared fixtures: a real PostgreSQL and a fresh schema per test.

The server is the embedded one kestrel itself uses (pgserver), started once per session in a
temporary directory, unless ``KESTREL_TEST_DSN`` names a server to use instead.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql as pgsql

ROOT = Path(__file__).resolve().parents[1]


VIA_PGBOUNCER = os.environ.get("KESTREL_TEST_VIA") == "pgbouncer"


@pytest.fixture(scope="session")
def direct_dsn(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real PostgreSQL, direct: KESTREL_TEST_DSN, or the embedded server started here."""
    dsn = os.environ.get("KESTREL_TEST_DSN")
    if dsn:
        yield dsn
        return
    from kestrel import embedded

    dsn, server = embedded.start(tmp_path_factory.mktemp("pg") / "data")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("ALTER SYSTEM SET max_connections = 300")
    server.cleanup()  # restart to apply max_connections
    dsn, server = embedded.start(tmp_path_factory.getbasetemp() / "pg0" / "data")
    yield dsn
    server.cleanup()


@pytest.fixture(scope="session")
def pg_dsn(direct_dsn: str) -> Iterator[str]:
    """The DSN tests and runtimes use: direct, or with KESTREL_TEST_VIA=pgbouncer through a
    real PgBouncer in transaction mode with a small server pool (the suite's second pass).
    In that pass the runtimes and clients run in pgbouncer mode, LISTEN going direct."""
    if not VIA_PGBOUNCER:
        yield direct_dsn
        return
    from tests.pgbouncer import PgBouncer

    bouncer = PgBouncer(direct_dsn, pool_size=8)
    os.environ["KESTREL_CONNECTION_MODE"] = "pgbouncer"
    os.environ["KESTREL_LISTEN_DSN"] = direct_dsn
    yield bouncer.dsn
    bouncer.stop()


@pytest.fixture
def schema(pg_dsn: str) -> Iterator[str]:
    from kestrel.migrate import migrate

    """A fresh schema made for tests (its clock moves: clock_offset, migration 0016)."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    migrate(pg_dsn, name, test_clock=True)
    yield name
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(pgsql.SQL("DROP SCHEMA {} CASCADE").format(pgsql.Identifier(name)))


@pytest.fixture
def production_schema(pg_dsn: str) -> Iterator[str]:
    """A fresh schema as production has it: its clock is now() and cannot be moved."""
    from kestrel.migrate import migrate

    name = f"p_{uuid.uuid4().hex[:12]}"
    migrate(pg_dsn, name)
    yield name
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(pgsql.SQL("DROP SCHEMA {} CASCADE").format(pgsql.Identifier(name)))


@pytest.fixture
def namespace(pg_dsn: str) -> Iterator[str]:
    """A fresh namespace of NAMESPACE_BUCKETS buckets (kestrel.buckets), made for tests."""
    from kestrel import buckets
    from kestrel.migrate import migrate_namespace
    from tests.helpers import drop_schemas

    name = f"n_{uuid.uuid4().hex[:12]}"
    migrate_namespace(pg_dsn, name, buckets=NAMESPACE_BUCKETS, test_clock=True)
    yield name
    drop_schemas(pg_dsn, buckets.schemas(name, NAMESPACE_BUCKETS))


NAMESPACE_BUCKETS = 3


@pytest.fixture
def ledger_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "ledger.jsonl"
    monkeypatch.setenv("KESTREL_TEST_LEDGER", str(path))
    return path


@pytest.fixture(scope="session")
def kestrel_dsn(pg_dsn: str) -> str:
    """kestrel.testing's fixtures (kestrel_env) use this suite's server, and so run through
    PgBouncer in the suite's second pass like every other integration test."""
    return pg_dsn

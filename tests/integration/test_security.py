"""S4: the runtime works under a least-privilege role (DML only, no DDL); migrations and
partition upkeep belong to the owner."""

from __future__ import annotations

import uuid
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from psycopg import sql as pgsql

from tests.helpers import finished_count, q, runtime, submit_many, wait_until


def as_role(dsn: str, role: str) -> str:
    parts = urlsplit(dsn)
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit(parts._replace(netloc=f"{role}@{host}"))


def test_runtime_role_without_ddl_rights(direct_dsn: str, schema: str, tmp_path: Path) -> None:
    role = f"kestrel_rt_{uuid.uuid4().hex[:8]}"
    s = pgsql.Identifier(schema)
    with psycopg.connect(direct_dsn, autocommit=True) as conn:
        conn.execute(pgsql.SQL("CREATE ROLE {} LOGIN").format(pgsql.Identifier(role)))
        r = pgsql.Identifier(role)
        conn.execute(pgsql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(s, r))
        conn.execute(pgsql.SQL("GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA "
                               "{} TO {}").format(s, r))
        conn.execute(pgsql.SQL("GRANT USAGE ON ALL SEQUENCES IN SCHEMA {} TO {}").format(s, r))
    runtime_dsn = as_role(direct_dsn, role)
    try:
        with psycopg.connect(runtime_dsn, autocommit=True) as conn, \
                pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute(pgsql.SQL("CREATE TABLE {}.intruder (x int)").format(s))
        submit_many(direct_dsn, schema, "three_steps", "jsonb_build_array(i)", 200)
        submit_many(direct_dsn, schema, "waiter", "'[]'::jsonb", 10)
        log = tmp_path / "rt.log"
        # --history-ahead 6 asks upkeep for partitions that do not exist yet: DDL it may not run.
        with runtime(runtime_dsn, schema, procs=2,
                     args=["--maintenance-interval", "0.5", "--history-ahead", "6"],
                     log=log):
            wait_until(lambda: q(direct_dsn, schema, "SELECT count(*) FROM "
                                 "{s}.workflow_executions WHERE status = 'waiting'")[0][0] == 10,
                       timeout=60, what="the waits")
            q(direct_dsn, schema, "SELECT {s}.signal(id, 'go', '1') FROM "
              "{s}.workflow_executions WHERE status = 'waiting'")
            wait_until(lambda: finished_count(direct_dsn, schema) == 210, timeout=60,
                       what="every workflow under the restricted role")
        text = log.read_text()
        assert "not migrating (this role may not run DDL)" in text
        assert "partition upkeep needs the schema owner" in text
        assert "worker crashed" not in text
    finally:
        with psycopg.connect(direct_dsn, autocommit=True) as conn:
            r = pgsql.Identifier(role)
            conn.execute(pgsql.SQL("DROP OWNED BY {}").format(r))
            conn.execute(pgsql.SQL("DROP ROLE {}").format(r))

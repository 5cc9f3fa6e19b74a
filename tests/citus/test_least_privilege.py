"""Issue 44 row 2: ``migrate`` as the schema's owner, a role without superuser, the way the
README and ``docs/citus.md`` show it (the tier otherwise connects as ``postgres``).

In one transaction, ``CREATE SCHEMA`` then a ``bigserial`` failed for such a role: Citus
makes the sequence on the worker node over the user's connection, then records it over a
connection of its own that cannot see the uncommitted schema (``relation
"shop.signals_id_seq" does not exist``). ``migrate`` now commits the schema first and each
migration on its own.

And row 3: the least-privilege runtime (a role with the README's DML grants) left `must be
owner of schema` errors in every worker node's log at each start, from DDL it tried and
was refused; it now asks first and sends none."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql as pgsql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from kestrel import buckets
from kestrel.migrate import migrate, migrate_namespace
from tests.citus.conftest import sharding_dsn
from tests.citus.test_tenants import APP, submit
from tests.helpers import q, q1, runtime, wait_until


@pytest.fixture
def owner(citus_dsn: str) -> Iterator[str]:
    """A login role with CREATE on the database and nothing else (Citus propagates the role
    and the grant to every node); dropped with everything it owns afterwards."""
    role = f"kowner_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(citus_dsn, autocommit=True) as conn:
        conn.execute(pgsql.SQL("CREATE ROLE {} LOGIN").format(pgsql.Identifier(role)))
        conn.execute(pgsql.SQL("GRANT CREATE ON DATABASE {} TO {}").format(
            pgsql.Identifier(conninfo_to_dict(citus_dsn).get("dbname", "postgres")),
            pgsql.Identifier(role)))
    yield role
    with psycopg.connect(citus_dsn, autocommit=True) as conn:
        schemas = [r[0] for r in conn.execute(
            "SELECT nspname FROM pg_namespace WHERE nspowner = %s::regrole", [role])]
        for name in schemas:
            conn.execute(pgsql.SQL("DROP SCHEMA {} CASCADE").format(pgsql.Identifier(name)))
        dbname = conninfo_to_dict(citus_dsn).get("dbname", "postgres")
        conn.execute(pgsql.SQL("REVOKE CREATE ON DATABASE {} FROM {}").format(
            pgsql.Identifier(dbname), pgsql.Identifier(role)))
        conn.execute(pgsql.SQL("DROP ROLE {}").format(pgsql.Identifier(role)))


def as_role(dsn: str, role: str) -> str:
    return make_conninfo(dsn, user=role)


def distributed(dsn: str, schema: str) -> tuple[str, str] | None:
    """(schema owner, Citus's name for it) when Citus lists *schema* as distributed."""
    rows = q(dsn, schema, "SELECT schema_owner::text, schema_name::text FROM citus_schemas "
             "WHERE schema_name::text = %s", [schema])
    return (rows[0][0], rows[0][1]) if rows else None


def test_the_owner_role_migrates_a_tenant_and_a_namespace_and_runs_a_timed_wait(
        citus_dsn: str, owner: str, tmp_path: Path) -> None:
    assert not q1(citus_dsn, "public", "SELECT rolsuper FROM pg_roles WHERE rolname = %s",
                  [owner])
    tenant = f"lp_{uuid.uuid4().hex[:10]}"
    applied = migrate(sharding_dsn(as_role(citus_dsn, owner)), tenant)
    assert applied and applied == sorted(applied)
    assert distributed(citus_dsn, tenant) == (owner, tenant)
    # Again as the owner: nothing to do, and the schema works for it.
    assert migrate(sharding_dsn(as_role(citus_dsn, owner)), tenant) == []

    namespace = f"lpn_{uuid.uuid4().hex[:10]}"
    made = migrate_namespace(sharding_dsn(as_role(citus_dsn, owner)), namespace, buckets=2)
    assert list(made) == buckets.schemas(namespace, 2)
    for k, name in enumerate(buckets.schemas(namespace, 2)):
        assert distributed(citus_dsn, name) == (owner, name)
        assert q(citus_dsn, name, "SELECT bucket, buckets FROM {s}.bucket") == [(k, 2)]

    # The owner's runtime runs the quick start's first workflow (a durable sleep) there.
    dsn = as_role(citus_dsn, owner)
    slept = submit(dsn, tenant, "sleeper", 3, 0.3)
    with runtime(dsn, tenant, procs=1, app=APP, log=tmp_path / "runtime.log"):
        wait_until(lambda: q1(citus_dsn, tenant, "SELECT status FROM {s}.executions "
                              "WHERE id = %s", [slept]) in ("completed", "failed"),
                   timeout=60, what="the sleeper to end")
    assert q1(citus_dsn, tenant, "SELECT status FROM {s}.executions WHERE id = %s",
              [slept]) == "completed"


def node_logs() -> dict[str, Path]:
    """Each node's server log (Debian's clusters of the local cluster, cluster.sh)."""
    import subprocess

    out = subprocess.run(["pg_lsclusters", "-h"], capture_output=True, text=True, check=True)
    return {name: Path(log) for _, name, _, _, _, _, log in
            (line.split() for line in out.stdout.splitlines()) if name.startswith("citus")}


def test_the_dml_runtime_role_leaves_no_refused_ddl_on_any_node(
        citus_dsn: str, owner: str, tmp_path: Path) -> None:
    tenant = f"lq_{uuid.uuid4().hex[:10]}"
    migrate(sharding_dsn(as_role(citus_dsn, owner)), tenant)
    role = f"krt_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(citus_dsn, autocommit=True) as conn:
        conn.execute(pgsql.SQL("CREATE ROLE {} LOGIN").format(pgsql.Identifier(role)))
    try:
        with psycopg.connect(as_role(citus_dsn, owner), autocommit=True) as conn:
            for grant in ("GRANT USAGE ON SCHEMA {s} TO {r}",
                          "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {s} "
                          "TO {r}", "GRANT USAGE ON ALL SEQUENCES IN SCHEMA {s} TO {r}"):
                conn.execute(pgsql.SQL(grant).format(s=pgsql.Identifier(tenant),
                                                     r=pgsql.Identifier(role)))
        logs = node_logs()
        sizes = {name: log.stat().st_size for name, log in logs.items()}
        dsn = as_role(citus_dsn, role)
        slept = submit(citus_dsn, tenant, "sleeper", 2, 0.2)
        with runtime(dsn, tenant, procs=1, app=APP, log=tmp_path / "runtime.log",
                     args=["--maintenance-interval", "0.5"]):
            wait_until(lambda: q1(citus_dsn, tenant, "SELECT status FROM {s}.executions "
                                  "WHERE id = %s", [slept]) == "completed",
                       timeout=60, what="the sleeper under the DML role")
        assert "not migrating (this role may not run DDL)" in (
            tmp_path / "runtime.log").read_text()
        refused = []
        for name, log in logs.items():
            with log.open("rb") as f:
                f.seek(sizes[name])
                refused += [f"{name}: {line}" for line in f.read().decode(
                    errors="replace").splitlines()
                    if role in line and ("ERROR" in line or "must be owner" in line)]
        assert not refused, refused
    finally:
        with psycopg.connect(citus_dsn, autocommit=True) as conn:
            conn.execute(pgsql.SQL("DROP OWNED BY {}").format(pgsql.Identifier(role)))
            conn.execute(pgsql.SQL("DROP ROLE {}").format(pgsql.Identifier(role)))

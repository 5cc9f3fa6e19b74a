"""The Citus tier (issue 24): kestrel on a real Citus cluster, through its coordinator.

Not part of the default ``tests`` run (``make test`` passes ``--ignore=tests/citus``); run it
with ``make test-citus``, which builds and starts a local cluster first (``make
citus-cluster``, as root: coordinator 127.0.0.1:5440, workers 5441 and 5442) unless
``KESTREL_CITUS_DSN`` names one. ``.ci/run`` runs it.
The cluster is ``KESTREL_CITUS_DSN`` (default the local coordinator); when it does not
answer, or is no Citus, every test fails with one line saying so: this tier never skips.

Each test's tenant is a kestrel schema made by ``migrate`` with
``citus.enable_schema_based_sharding`` on for the migrating session only: Citus makes it a
distributed schema, every table of it one shard, all on one node. Tenants are production
schemas (their clock is ``now()``): a schema made for tests reads a clock table.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator

import psycopg
import pytest
from psycopg import sql as pgsql
from psycopg.conninfo import make_conninfo

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5440/postgres"


@pytest.fixture(scope="session")
def citus_dsn() -> str:
    """The coordinator, checked to answer and to run Citus; configured for kestrel."""
    dsn = os.environ.get("KESTREL_CITUS_DSN", DEFAULT_DSN)
    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
            version = conn.execute("SELECT citus_version()").fetchone()
    except psycopg.Error as exc:
        pytest.fail(f"no Citus cluster at {dsn} ({type(exc).__name__}: "
                    f"{str(exc).strip().splitlines()[0]}); start one with "
                    "`make citus-cluster` (as root), or set "
                    "KESTREL_CITUS_DSN", pytrace=False)
    assert version is not None and "Citus" in str(version[0])
    return dsn


def sharding_dsn(dsn: str) -> str:
    """*dsn* with schema-based sharding on for the sessions it opens (migrate's)."""
    return make_conninfo(dsn, options="-c citus.enable_schema_based_sharding=on")


@pytest.fixture
def make_tenant(citus_dsn: str) -> Iterator[Callable[[], str]]:
    """Migrate fresh tenant schemas with schema-based sharding on; drop them afterwards."""
    from kestrel.migrate import migrate

    made: list[str] = []

    def make() -> str:
        name = f"c_{uuid.uuid4().hex[:12]}"
        made.append(name)
        migrate(sharding_dsn(citus_dsn), name)
        return name

    yield make
    with psycopg.connect(citus_dsn, autocommit=True) as conn:
        for name in made:
            conn.execute(pgsql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
                pgsql.Identifier(name)))


@pytest.fixture
def tenant(make_tenant: Callable[[], str]) -> str:
    return make_tenant()

"""Which form of the write path a schema gets: the statements (one PostgreSQL, or a Citus
schema that is not distributed), or their Citus forms, calls of functions ``migrate``
delegates to the tenant's node in a Citus distributed schema (``save_steps()``,
``finish_batch()``, ``sweep_expired()``, ``fail_late()``; docs/citus.md).

Asked of the database once per process and schema (``distributed_schema()``), on the first
write that has two forms. :func:`forced` makes a process send the Citus forms on plain
PostgreSQL, where the same functions run (the test suites use it).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kestrel import db
from kestrel.sql import Queries
from kestrel.statements import migrate

_DELEGATED: dict[int, bool] = {}
"""By schema: the key is its Queries' id (:func:`kestrel.sql.queries` makes one per schema
and keeps it for the life of the process)."""


async def delegated(conn: Any, q: Queries) -> bool:
    """Whether to send the Citus forms to *q*'s schema."""
    key = id(q)
    if key not in _DELEGATED:
        _DELEGATED[key] = await db.run(conn, migrate.distributed_schema(q))
    return _DELEGATED[key]


@contextmanager
def forced(q: Queries) -> Iterator[None]:
    """Send the Citus forms to *q*'s schema for the block's duration, then ask again."""
    _DELEGATED[id(q)] = True
    try:
        yield
    finally:
        _DELEGATED.pop(id(q), None)

"""The test kit's statements (``sql/queries/testing.sql``): the movable database clock, what
an execution waits for, a clean slate per test, and dropping a test's schema."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from kestrel.sql import Queries
from kestrel.statements.stmt import Stmt, command, first


def advance_clock(q: Queries, *, seconds: float) -> Stmt[datetime]:
    """Move the database clock (kestrel_now()) forward by *seconds*; the new time."""
    return Stmt(q.advance_clock, {"seconds": seconds}, first)


def skip_to_next_sleep(q: Queries) -> Stmt[float | None]:
    """If nothing can run now, move the clock to the end of the earliest durable sleep; the
    seconds skipped, or None when something can run or nothing sleeps."""
    return Stmt(q.skip_to_next_sleep, None, first)


def waiting_for(q: Queries, *, id: uuid.UUID) -> Stmt[tuple[Any, ...] | None]:
    """A live execution's (status, waiting_for, wake_at); None once it finished."""
    return Stmt(q.waiting_for, {"id": id}, lambda rows: tuple(rows[0]) if rows else None)


def reset_for_test(q: Queries) -> Stmt[None]:
    """Empty every table but the migration record; set the clock back to now()."""
    return command(q.reset_for_test)


def drop_schema(q: Queries) -> Stmt[None]:
    """Drop a test's schema with everything in it."""
    return command(q.drop_schema)

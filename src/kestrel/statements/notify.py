"""The wake-up channels: the workers', and result() waiters' (``sql/queries/notify.sql``)."""

from __future__ import annotations

from kestrel.sql import Queries
from kestrel.statements.stmt import Stmt, command


def listen(q: Queries) -> Stmt[None]:
    """LISTEN for this schema's wake-ups (on a direct, non-pooled connection)."""
    return command(q.listen)


def wake_workers(q: Queries) -> Stmt[None]:
    """Wake this schema's idle workers when the transaction commits."""
    return command(q.wake_workers)


def notify_done(q: Queries) -> Stmt[None]:
    """Wake this schema's result() waiters (after complete_batch_delegated)."""
    return command(q.notify_done)

"""The only module that executes runtime SQL: :func:`run` one statement, :func:`run_script`
several in one transaction, on an async connection (``run_sync``/``run_script_sync`` on a
blocking one).

What a statement says, its parameters and how its rows become a result, lives in
:mod:`kestrel.statements` (one module per ``sql/queries`` file); here is only how one runs:
kestrel's SQLSTATEs mapped to typed errors, the fallback of an INSERT that met a row a lost
reply had written (:attr:`Stmt.if_recorded`), and the lost-reply failpoints (FAULTS R1).
Callers run each statement on a connection in autocommit mode, so each write is its own
short transaction and no user code ever runs inside one.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import Any, ClassVar, TypeVar

import psycopg
from psycopg.pq import TransactionStatus
from psycopg_pool import AsyncConnectionPool

from kestrel import connections
from kestrel.errors import (
    ConfigError,
    DuplicateExecution,
    ExecutionNotFound,
    IdempotencyConflict,
    InvalidState,
    KestrelError,
    ParentCancelled,
    PayloadTooLarge,
    SerializationError,
)
from kestrel.failpoints import LOST_REPLIES, lost_reply
from kestrel.sql import named_statements, statement_name
from kestrel.statements import Script, Stmt

AnyConn = psycopg.AsyncConnection[Any]
T = TypeVar("T")

# -- lock_timeout on every worker statement ---------------------------------------------------


def lock_timeout_ms(seconds: float) -> int:
    """*seconds* as the whole milliseconds PostgreSQL's lock_timeout takes (at least 1: 0
    would mean no timeout at all)."""
    return max(1, round(seconds * 1000))


class LockTimeoutConnection(psycopg.AsyncConnection[Any]):
    """A pooled connection whose every statement carries lock_timeout without session state,
    for a transaction-mode pooler (PgBouncer passes no startup ``options`` and shares server
    sessions): a statement outside a transaction is sent in one pipeline after
    ``set_lock_timeout`` (a transaction-local set_config), one round trip and one Sync, so
    both run in one implicit transaction; a transaction sets it first thing. Subclassed per
    value by :func:`_timeout_classes`."""

    lock_timeout: ClassVar[str] = ""
    set_query: ClassVar[str] = ""

    async def execute(self, query: Any, params: Any = None, *, prepare: bool | None = None,
                      binary: bool = False) -> psycopg.AsyncCursor[Any]:
        """Execute *query* with lock_timeout set for it (see the class)."""
        if self.info.transaction_status is not TransactionStatus.IDLE:
            return await super().execute(query, params, prepare=prepare, binary=binary)
        async with self.pipeline():
            await super().execute(self.set_query, {"lock_timeout": self.lock_timeout})
            cur = await super().execute(query, params, prepare=prepare, binary=binary)
        return cur

    @asynccontextmanager
    async def transaction(self, savepoint_name: str | None = None,
                          force_rollback: bool = False) -> AsyncIterator[Any]:
        """A transaction whose first statement sets lock_timeout for all of it."""
        outermost = self.info.transaction_status is TransactionStatus.IDLE
        async with super().transaction(savepoint_name, force_rollback) as tx:
            if outermost:
                await super().execute(self.set_query, {"lock_timeout": self.lock_timeout})
            yield tx


class SyncLockTimeoutConnection(psycopg.Connection[Any]):
    """:class:`LockTimeoutConnection` for a blocking connection (the heartbeat's)."""

    lock_timeout: ClassVar[str] = ""
    set_query: ClassVar[str] = ""

    def execute(self, query: Any, params: Any = None, *, prepare: bool | None = None,
                binary: bool = False) -> psycopg.Cursor[Any]:
        """Execute *query* with lock_timeout set for it (see the class)."""
        if self.info.transaction_status is not TransactionStatus.IDLE:
            return super().execute(query, params, prepare=prepare, binary=binary)
        with self.pipeline():
            super().execute(self.set_query, {"lock_timeout": self.lock_timeout})
            cur = super().execute(query, params, prepare=prepare, binary=binary)
        return cur

    @contextmanager
    def transaction(self, savepoint_name: str | None = None,
                    force_rollback: bool = False) -> Iterator[Any]:
        """A transaction whose first statement sets lock_timeout for all of it."""
        outermost = self.info.transaction_status is TransactionStatus.IDLE
        with super().transaction(savepoint_name, force_rollback) as tx:
            if outermost:
                super().execute(self.set_query, {"lock_timeout": self.lock_timeout})
            yield tx


@functools.cache
def _timeout_classes(ms: int) -> tuple[type[LockTimeoutConnection],
                                       type[SyncLockTimeoutConnection]]:
    attrs = {"lock_timeout": f"{ms}ms",
             "set_query": named_statements()["set_lock_timeout"]}
    return (type(f"LockTimeoutConnection{ms}", (LockTimeoutConnection,), attrs),
            type(f"SyncLockTimeoutConnection{ms}", (SyncLockTimeoutConnection,), attrs))


def worker_connection(dsn: str, *, lock_timeout: float | None, session: bool
                      ) -> tuple[dict[str, Any], type[LockTimeoutConnection] | None,
                                 type[SyncLockTimeoutConnection] | None]:
    """How a worker's connections carry *lock_timeout* (seconds; None: they don't): on a
    *session* of their own (direct), as a startup option, free on every statement; behind a
    transaction-mode pooler, by the connection classes above. Returns the extra connection
    parameters and the (async, sync) classes to connect with (None: psycopg's own)."""
    if lock_timeout is None:
        return {}, None, None
    ms = lock_timeout_ms(lock_timeout)
    if session:
        return {"options": connections.lock_timeout_options(dsn, ms)}, None, None
    async_cls, sync_cls = _timeout_classes(ms)
    return {}, async_cls, sync_cls


def make_pool(dsn: str, *, max_size: int, name: str, prepared: bool = True,
              lock_timeout: float | None = None,
              session: bool = True) -> AsyncConnectionPool[Any]:
    """A worker's pool (:func:`kestrel.connections.make_pool`) whose every statement carries
    *lock_timeout* (see :func:`worker_connection`)."""
    extra, async_cls, _ = worker_connection(dsn, lock_timeout=lock_timeout, session=session)
    return connections.make_pool(dsn, max_size=max_size, name=name, prepared=prepared,
                                 connection_class=async_cls or psycopg.AsyncConnection,
                                 extra=extra)


def connect_sync(dsn: str, *, lock_timeout: float | None, session: bool,
                 **kwargs: Any) -> psycopg.Connection[Any]:
    """A blocking connection (the heartbeat's) whose every statement carries
    *lock_timeout*, as :func:`make_pool`'s do."""
    extra, _, sync_cls = worker_connection(dsn, lock_timeout=lock_timeout, session=session)
    return (sync_cls or psycopg.Connection).connect(dsn, **{**kwargs, **extra})


# -- running statements (kestrel.statements) -------------------------------------------------


async def run(conn: AnyConn, stmt: Stmt[T]) -> T:
    """Execute *stmt* on an async connection; map kestrel's SQLSTATEs to typed errors."""
    query = stmt.query
    try:
        try:
            cur = await conn.execute(query, stmt.params)
        except psycopg.errors.UniqueViolation:
            if stmt.if_recorded is None:
                raise
            query = stmt.if_recorded
            cur = await conn.execute(query, stmt.params)
    except psycopg.Error as exc:
        mapped = _error(exc, stmt.key)
        if mapped is None:
            raise
        raise mapped from None
    if LOST_REPLIES:
        await _lose_reply(conn, query, stmt.params)
    return stmt.decode(_rows(stmt, cur, await cur.fetchall()) if cur.description else [])


def run_sync(conn: psycopg.Connection[Any], stmt: Stmt[T]) -> T:
    """:func:`run` on a blocking connection."""
    query = stmt.query
    try:
        try:
            cur = conn.execute(query, stmt.params)
        except psycopg.errors.UniqueViolation:
            if stmt.if_recorded is None:
                raise
            query = stmt.if_recorded
            cur = conn.execute(query, stmt.params)
    except psycopg.Error as exc:
        mapped = _error(exc, stmt.key)
        if mapped is None:
            raise
        raise mapped from None
    if LOST_REPLIES:
        _lose_reply_sync(conn, query, stmt.params)
    return stmt.decode(_rows(stmt, cur, cur.fetchall()) if cur.description else [])


def _rows(stmt: Stmt[Any], cur: Any, rows: list[Any]) -> list[Any]:
    """*rows* as *stmt* decodes them: tuples, or dicts by column name (``by_name``)."""
    if not stmt.by_name:
        return rows
    names = [c.name for c in cur.description]
    return [dict(zip(names, r, strict=True)) for r in rows]


async def run_script(conn: AnyConn, script: Script[T]) -> T:
    """Run *script* in one transaction on an async connection."""
    sent: list[Stmt[Any]] = []
    async with conn.transaction():
        try:
            stmt = next(script)
            while True:
                sent.append(stmt)
                stmt = script.send(await run(conn, stmt))
        except StopIteration as done:
            result: T = done.value
    if LOST_REPLIES:
        for stmt in sent:
            await _lose_reply(conn, stmt.query, stmt.params)
    return result


def run_script_sync(conn: psycopg.Connection[Any], script: Script[T]) -> T:
    """:func:`run_script` on a blocking connection."""
    sent: list[Stmt[Any]] = []
    with conn.transaction():
        try:
            stmt = next(script)
            while True:
                sent.append(stmt)
                stmt = script.send(run_sync(conn, stmt))
        except StopIteration as done:
            result: T = done.value
    committed_sync(conn, sent)
    return result


def committed_sync(conn: psycopg.Connection[Any], sent: Sequence[Stmt[Any]]) -> None:
    """Tell the lost-reply failpoints that a transaction block which ran *sent* has just
    committed (a statement inside a block is only committed with it): if one of them is
    armed, the reply to the COMMIT is lost (see :func:`_lose_reply`)."""
    if LOST_REPLIES:
        for stmt in sent:
            _lose_reply_sync(conn, stmt.query, stmt.params)


# -- lost replies (FAULTS R1): a statement commits, then its reply never comes ---------------


async def _lose_reply(conn: AnyConn, query: str, params: Any) -> None:
    """If ``lost_reply:<name>`` is armed for this statement, which has just run, and it has
    committed (autocommit; inside a transaction block the commit comes later, and
    :func:`run_script` or the function owning the block asks again after it), close the
    connection and raise what a reply lost on its way would raise."""
    if conn.info.transaction_status != TransactionStatus.IDLE:
        return
    name = statement_name(query)
    if name is not None and lost_reply(name, params):
        await conn.close()
        raise psycopg.OperationalError(_LOST.format(name))


def _lose_reply_sync(conn: psycopg.Connection[Any], query: str, params: Any) -> None:
    """:func:`_lose_reply` on a blocking connection."""
    if conn.info.transaction_status != TransactionStatus.IDLE:
        return
    name = statement_name(query)
    if name is not None and lost_reply(name, params):
        conn.close()
        raise psycopg.OperationalError(_LOST.format(name))


_LOST = ("failpoint lost_reply:{}: the connection was lost after the statement committed, "
         "before its reply arrived")


def _error(exc: psycopg.Error, key: str | None = None) -> KestrelError | None:
    """Map the SQLSTATEs raised by kestrel's SQL functions to typed errors."""
    message = str(exc.diag.message_primary)
    if exc.sqlstate == "KS001":
        return IdempotencyConflict(message, key=key or "")
    if exc.sqlstate == "KS002":
        return ConfigError(message)
    if exc.sqlstate == "KS003":
        return ExecutionNotFound(message)
    if exc.sqlstate in ("KS004", "KS005"):
        return InvalidState(message)
    if exc.sqlstate == "KS006":
        return DuplicateExecution(message)
    if exc.sqlstate == "KS007":
        return SerializationError(message)
    if exc.sqlstate == "KS008":
        return PayloadTooLarge(message)
    if exc.sqlstate == "KS009":
        return ParentCancelled(message)
    return None

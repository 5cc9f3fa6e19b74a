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

from collections.abc import Sequence
from typing import Any, TypeVar

import psycopg
from psycopg.pq import TransactionStatus

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
from kestrel.sql import statement_name
from kestrel.statements import Script, Stmt

AnyConn = psycopg.AsyncConnection[Any]
T = TypeVar("T")

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

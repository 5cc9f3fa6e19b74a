"""Connections: every connection the runtime opens, and what a failure of the link looks like.

One home for opening one: :func:`connect` (blocking), :func:`connect_async` and
:func:`make_pool` (a worker's pool). Each applies what its caller asks of the link, the
settings each caller has always used: autocommit, the link defaults (:data:`LINK_DEFAULTS`:
connect timeout, keepalives), the orjson decoding of jsonb, the prepare threshold (None behind
a transaction-mode pooler), and a worker's lock_timeout (:func:`worker_connection`: a startup
option on a session of its own, else the :class:`LockTimeoutConnection` classes).

Statements are :mod:`kestrel.db`'s; the only things sent here are the transaction-local
settings a :class:`SettingConnection` puts in front of each statement (a worker's
``set_lock_timeout``, the HTTP door's ``set_statement_timeout``: :func:`budget`; their text is
in ``sql/queries``). :mod:`kestrel.db` re-exports the failure predicates.
"""

from __future__ import annotations

import asyncio
import functools
import os
import socket
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any, ClassVar

import orjson
import psycopg
from psycopg.pq import TransactionStatus
from psycopg.types.json import set_json_loads
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from kestrel.sql import named_statements

# SQLSTATEs that mean the server or the link went away, not that the statement is wrong.
_GONE = {"57P01", "57P02", "57P03"}  # admin shutdown, crash shutdown, cannot connect now

# SQLSTATEs of a statement that lost a race or waited too long, not of a wrong statement: the
# same statement succeeds once the other transaction (a client's, an operator's) is gone.
_CONTENDED = {
    "55P03",  # lock_not_available: lock_timeout
    "57014",  # query_canceled: statement_timeout (or a cancel request)
    "40P01",  # deadlock_detected
    "40001",  # serialization_failure
    "53300",  # too_many_connections
    "53100",  # disk_full: writes resume once space is freed (FAULTS D13)
}


def is_transient(exc: BaseException) -> bool:
    """Whether *exc* means "the database is unreachable right now": wait and try again.

    Only connection-level failures are: class 08, a server shutting down, a connection
    psycopg lost (an OperationalError with no SQLSTATE, a closed connection, a pool that gave
    no connection in time) and OS-level socket errors. Every other error came back from a
    statement that the server ran and refused: see :func:`is_contended` for the ones worth
    sending again, and :func:`is_data_error` for the ones that never are.
    """
    if isinstance(exc, OSError | psycopg.InterfaceError):
        return True
    if not isinstance(exc, psycopg.OperationalError):
        return False
    state = exc.sqlstate
    return state is None or state.startswith("08") or state in _GONE


def is_pool_timeout(exc: BaseException) -> bool:
    """Whether *exc* is this process's pool giving no connection in time: every connection
    is busy (held by statements waiting on a lock, say), or no new one could be opened. The
    database may well be answering others, this process's heartbeat among them (FAULTS R3)."""
    return isinstance(exc, PoolTimeout)


def is_contended(exc: BaseException) -> bool:
    """Whether *exc* is a statement refused because of other transactions, not because of
    what it says: a lock or statement timeout, a deadlock, a serialization failure, too many
    connections, a full disk. Sent again unchanged, after a while, it succeeds; splitting its
    batch would not help (FAULTS D10, O4, O6)."""
    return isinstance(exc, psycopg.Error) and exc.sqlstate in _CONTENDED


def is_data_error(exc: BaseException) -> bool:
    """Whether *exc* refuses a value as such (class 22 data exceptions, values psycopg
    cannot send such as a NUL in text, or text it cannot encode): the same value fails
    every time, whatever the database's state."""
    if isinstance(exc, psycopg.DataError | UnicodeError):
        return True
    return isinstance(exc, psycopg.Error) and (exc.sqlstate or "").startswith("22")


def sqlstate(exc: BaseException) -> str:
    """*exc*'s SQLSTATE and class, for a log line that quotes no data: ``55P03
    LockNotAvailable`` (``-`` for an error with no SQLSTATE)."""
    return f"{getattr(exc, 'sqlstate', None) or '-'} {type(exc).__name__}"


def configure_connection(conn: psycopg.AsyncConnection[Any] | psycopg.Connection[Any]) -> None:
    """Decode jsonb with orjson on *conn* (outputs round-trip through one codec)."""
    set_json_loads(orjson.loads, conn)


async def configure_connection_async(conn: psycopg.AsyncConnection[Any]) -> None:
    """:func:`configure_connection` for an async pool's ``configure`` hook."""
    configure_connection(conn)


POOL_WAIT_S = 2.0

# Unless the DSN says otherwise: a connection attempt gives up after 5 s (libpq's default is
# to wait for the OS, minutes against a host that drops packets), and a peer that stops
# answering is noticed by TCP keepalives within ~25 s idle, or within 30 s of unacknowledged
# data (tcp_user_timeout), instead of a statement hanging for the OS's retransmission limit.
# Ignored on Unix sockets.
LINK_DEFAULTS = {"connect_timeout": "5", "keepalives": "1", "keepalives_idle": "10",
                 "keepalives_interval": "5", "keepalives_count": "3",
                 "tcp_user_timeout": "30000"}


def link_params(dsn: str) -> dict[str, Any]:
    """LINK_DEFAULTS less whatever *dsn* sets itself."""
    from psycopg.conninfo import conninfo_to_dict

    try:
        given = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        given = {}
    return {k: v for k, v in LINK_DEFAULTS.items() if k not in given}


def lock_timeout_options(dsn: str, lock_timeout_ms: int) -> str:
    """The ``options`` startup parameter that gives a direct connection's session
    *lock_timeout_ms*: ``-c lock_timeout=…`` first, then whatever *dsn*'s own ``options``
    say (a later ``-c`` wins, so an operator's explicit setting in the DSN stands)."""
    from psycopg.conninfo import conninfo_to_dict

    try:
        given = str(conninfo_to_dict(dsn).get("options") or "")
    except psycopg.ProgrammingError:
        given = ""
    return f"-c lock_timeout={lock_timeout_ms} {given}".strip()


# -- lock_timeout on every worker statement ---------------------------------------------------


def lock_timeout_ms(seconds: float) -> int:
    """*seconds* as the whole milliseconds PostgreSQL's lock_timeout takes (at least 1: 0
    would mean no timeout at all)."""
    return max(1, round(seconds * 1000))


class SettingConnection(psycopg.AsyncConnection[Any]):
    """An async connection that puts one transaction-local setting (:meth:`setting`: a
    ``set_config(…, true)`` statement and its parameters, or None for none) in front of each
    statement, without session state, for a transaction-mode pooler (PgBouncer passes no
    startup ``options`` and shares server sessions): a statement outside a transaction is
    sent in one pipeline after it, one round trip and one Sync, so both run in one implicit
    transaction; a transaction sends it first thing."""

    def setting(self) -> tuple[str, dict[str, str]] | None:
        """The setting statement and its parameters; None: nothing to send."""
        raise NotImplementedError

    async def execute(self, query: Any, params: Any = None, *, prepare: bool | None = None,
                      binary: bool = False) -> psycopg.AsyncCursor[Any]:
        """Execute *query* with the setting set for it (see the class)."""
        setting = (self.setting() if self.info.transaction_status is TransactionStatus.IDLE
                   else None)
        if setting is None:
            return await super().execute(query, params, prepare=prepare, binary=binary)
        async with self.pipeline():
            await super().execute(*setting)
            cur = await super().execute(query, params, prepare=prepare, binary=binary)
        return cur

    @asynccontextmanager
    async def transaction(self, savepoint_name: str | None = None,
                          force_rollback: bool = False) -> AsyncIterator[Any]:
        """A transaction whose first statement sends the setting for all of it."""
        outermost = self.info.transaction_status is TransactionStatus.IDLE
        async with super().transaction(savepoint_name, force_rollback) as tx:
            setting = self.setting() if outermost else None
            if setting is not None:
                await super().execute(*setting)
            yield tx


class LockTimeoutConnection(SettingConnection):
    """A pooled connection whose every statement carries lock_timeout (``set_lock_timeout``,
    see :class:`SettingConnection`). Subclassed per value by :func:`_timeout_classes`."""

    lock_timeout: ClassVar[str] = ""
    set_query: ClassVar[str] = ""

    def setting(self) -> tuple[str, dict[str, str]]:
        """``set_lock_timeout`` with this class's value."""
        return self.set_query, {"lock_timeout": self.lock_timeout}


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


class BudgetConnection(SettingConnection):
    """An async connection whose statements carry ``statement_timeout`` (see
    :class:`SettingConnection`) while :attr:`deadline` (a ``time.monotonic()`` instant, set by
    :func:`budget`) is set: the time left until it. PostgreSQL itself then ends a statement
    that waits past the deadline (57014): nothing depends on a cancel request reaching the
    server. The HTTP door's pools are of this class."""

    deadline: float | None = None

    def setting(self) -> tuple[str, dict[str, str]] | None:
        """``set_statement_timeout`` to the time left, or None without a deadline."""
        if self.deadline is None:
            return None
        left_ms = max(1, int((self.deadline - time.monotonic()) * 1000))
        return _statement_timeout_query(), {"timeout": f"{left_ms}ms"}


@functools.cache
def _statement_timeout_query() -> str:
    """``set_statement_timeout``'s text, read once (reading every statement's costs 8 ms)."""
    return named_statements()["set_statement_timeout"]


class Overrun(Exception):
    """What ran under :func:`budget` outlived its deadline: the server ended a statement
    (statement_timeout), or the connection was cut past the grace."""


@asynccontextmanager
async def budget(conn: psycopg.AsyncConnection[Any], deadline: float,
                 grace: float) -> AsyncIterator[None]:
    """Bound what runs on *conn* (a :class:`BudgetConnection`) by *deadline*: each statement
    on the server by statement_timeout, and everything the server cannot bound (a wait in a
    pooler's queue, a link gone quiet) by closing the connection's socket *grace* seconds
    after it, which fails the statement on its way with a broken link (the pool then drops
    the connection). Either raises :class:`Overrun`; so does any failure once the socket is
    cut. No cancel request is sent: through a transaction-mode pooler one may wait without
    bound for a server connection of its own, and may reach another client's statement."""
    cut: list[bool] = []
    timer = asyncio.get_running_loop().call_later(
        max(0.0, deadline + grace - time.monotonic()), _sever, conn, cut)
    if isinstance(conn, BudgetConnection):
        conn.deadline = deadline
    try:
        yield
    except Exception as exc:
        if cut or _timed_out(exc):
            raise Overrun(f"past its deadline: {exc}") from None
        raise
    finally:
        timer.cancel()
        if isinstance(conn, BudgetConnection):
            conn.deadline = None


def _timed_out(exc: BaseException | None) -> bool:
    """Whether *exc*, or what it was raised from, is a statement the server ended."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, psycopg.errors.QueryCanceled):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def _sever(conn: psycopg.AsyncConnection[Any], cut: list[bool]) -> None:
    """Shut the socket of *conn* down in both directions (a duplicate of its descriptor, so
    the event loop's registration of the original stays valid): whatever waits on it sees
    the link end."""
    cut.append(True)
    try:
        fd = conn.pgconn.socket
    except psycopg.OperationalError:
        return  # already closed
    with socket.socket(fileno=os.dup(fd)) as sock:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


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
        return {"options": lock_timeout_options(dsn, ms)}, None, None
    async_cls, sync_cls = _timeout_classes(ms)
    return {}, async_cls, sync_cls


def connect(dsn: str, *, autocommit: bool = True, link: bool = False, configure: bool = False,
            lock_timeout: float | None = None, session: bool = True,
            **params: Any) -> psycopg.Connection[Any]:
    """Open a blocking connection to *dsn*.

    *autocommit*: each statement its own transaction (every caller but a replay's read).
    *link*: the link defaults (:func:`link_params`) under *params*, for a connection that
    lives long (the heartbeat's, the supervisor's release). *configure*: jsonb decoded with
    orjson (:func:`configure_connection`). *lock_timeout* (seconds) and *session*: as a
    worker's pool carries it (:func:`worker_connection`). *params* are psycopg's connection
    parameters (``prepare_threshold=None`` behind a transaction-mode pooler,
    ``application_name``, ``connect_timeout``...).
    """
    extra, _, sync_cls = worker_connection(dsn, lock_timeout=lock_timeout, session=session)
    conn = (sync_cls or psycopg.Connection).connect(
        dsn, **_params(dsn, autocommit=autocommit, link=link, params=params, extra=extra))
    if configure:
        configure_connection(conn)
    return conn


async def connect_async(dsn: str, *, autocommit: bool = True, link: bool = False,
                        configure: bool = False, lock_timeout: float | None = None,
                        session: bool = True, **params: Any) -> psycopg.AsyncConnection[Any]:
    """:func:`connect` for asyncio: open an async connection to *dsn* with the same
    settings."""
    extra, async_cls, _ = worker_connection(dsn, lock_timeout=lock_timeout, session=session)
    conn = await (async_cls or psycopg.AsyncConnection).connect(
        dsn, **_params(dsn, autocommit=autocommit, link=link, params=params, extra=extra))
    if configure:
        configure_connection(conn)
    return conn


def _params(dsn: str, *, autocommit: bool, link: bool, params: dict[str, Any],
            extra: dict[str, Any]) -> dict[str, Any]:
    """A connection's parameters: the link defaults (if asked) under the caller's own, under
    the lock_timeout's startup option."""
    return {**(link_params(dsn) if link else {}), "autocommit": autocommit, **params,
            **extra}


def make_pool(dsn: str, *, max_size: int, name: str, prepared: bool = True,
              lock_timeout: float | None = None,
              session: bool = True) -> AsyncConnectionPool[Any]:
    """Create (not open) a worker's pool. Call only after fork: pools don't survive it.

    *prepared*: hot statements are prepared server-side from their first use (one parse per
    connection). Off behind a transaction-mode pooler that cannot route named prepared
    statements (PgBouncer before 1.21), where a later statement may land on a server
    connection that never saw the PREPARE. Every statement carries *lock_timeout* (seconds;
    None: none), on a *session* of its own or not (see :func:`worker_connection`).
    """
    extra, async_cls, _ = worker_connection(dsn, lock_timeout=lock_timeout, session=session)
    return AsyncConnectionPool(
        dsn,
        connection_class=async_cls or psycopg.AsyncConnection,
        min_size=1,
        max_size=max_size,
        kwargs={"autocommit": True, "prepare_threshold": 0 if prepared else None,
                # Operators can tell kestrel's backends apart in pg_stat_activity.
                "application_name": "kestrel-worker", **link_params(dsn), **extra},
        configure=configure_connection_async,
        name=name,
        open=False,
        # No check at checkout: it costs a round trip on every statement (16% of a worker's
        # CPU in a profile). A connection that broke fails its statement with
        # OperationalError, which every caller retries; the pool discards it on return.
        #
        # Reconnecting after an outage: psycopg_pool's own retries back off 1, 2, 4, 8 s...
        # (a five-minute outage would leave minutes between attempts), so it gives up at
        # once (reconnect_timeout=0: after its first retry) and the callers do the retrying:
        # a new connection is attempted whenever a caller asks for one, none is there and
        # no attempt is in flight (each bounded by connect_timeout). A caller that asked
        # during the outage must not wait out psycopg_pool's 30 s default for an attempt
        # that already failed, or the process sits idle long after the database is back:
        # it gives up after POOL_WAIT_S (PoolTimeout is an OperationalError), backs off,
        # and asks again, which tries a new connection.
        reconnect_timeout=0,
        timeout=POOL_WAIT_S,
    )

"""The async client, :class:`Client`: the one hand-written client.

The blocking :class:`~kestrel.client_sync.SyncClient` is generated from this file by
``tools/unasync.py`` (``make unasync``) and checked in; a unit test fails when the two
drift apart. Statements are defined once in :mod:`kestrel.db` and run here with ``db.run``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

import psycopg
from psycopg_pool import AsyncConnectionPool

from kestrel import buckets, codec, connections, db, ids, statements
from kestrel._client_common import (
    POLL_CAP_S,
    RECONNECT_FIRST_S,
    RETRYABLE,
    ClientBase,
    Debounce,
    bulk_item_key,
    bulk_skip,
    check_bulk,
    count_submitted,
    ident,
    log,
    match_params,
    outcome,
    remaining,
    tag_filter,
)
from kestrel.definitions import WorkflowFn
from kestrel.errors import (
    ConfigError,
    ExecutionNotFound,
    InvalidState,
    ParentCancelled,
)
from kestrel.outage import reason
from kestrel.sql import Queries
from kestrel.types import (
    BulkResult,
    Execution,
    ExecutionSummary,
    LiveWorker,
    Match,
    PatchUse,
    Stats,
    Status,
    StepRow,
    Unclaimable,
)
from kestrel.versions import check_app_version

if TYPE_CHECKING:
    from collections.abc import Callable

T = TypeVar("T")


class Client(ClientBase):
    """Async client.

    Short calls borrow from a small connection pool (``pool_size``, opened on first use;
    0 = a connection per call); waits for results and events use a connection of their own,
    since LISTEN is session state that must not go back to a pool. Close it with
    ``close()`` or use it as a context manager."""

    _connection_class: type[psycopg.AsyncConnection[Any]] = psycopg.AsyncConnection
    """The class of the pool's connections (the HTTP door's carry its statement budget)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pool: AsyncConnectionPool[Any] | None = None
        self._lock = asyncio.Lock()

    async def _connect(self, dsn: str | None = None) -> psycopg.AsyncConnection[Any]:
        kwargs = self._conn_kwargs
        return await connections.connect_async(dsn or self.dsn, configure=True, **kwargs)

    @asynccontextmanager
    async def _borrow(self, timeout: float | None = None,
                      ) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        if self._pool_size == 0:
            async with await self._connect() as conn:
                yield conn
            return
        async with self._lock:
            if self._pool is None:
                pool = AsyncConnectionPool(
                    self.dsn, connection_class=self._connection_class,
                    min_size=1, max_size=self._pool_size, open=False,
                    kwargs=self._conn_kwargs, configure=connections.configure_connection_async,
                    name=f"kestrel-client-{self.schema}")
                await pool.open()
                self._pool = pool
        async with self._pool.connection(timeout=timeout) as conn:
            yield conn

    async def close(self) -> None:
        """Close the connection pool (a later call opens a new one)."""
        async with self._lock:
            if self._pool is not None:
                await self._pool.close()
                self._pool = None

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _run(self, stmt: statements.Stmt[T],
                   conn: psycopg.AsyncConnection[Any] | None = None) -> T:
        if conn is not None:
            return await db.run(conn, stmt)
        async with self._borrow() as own:
            return await db.run(own, stmt)

    async def _namespace(self, conn: psycopg.AsyncConnection[Any] | None = None,
                         ) -> list[Queries]:
        """The namespace's schemas by bucket, read on the first call (:mod:`kestrel.buckets`)
        on *conn* or a connection of the pool."""
        if self._qs is None:
            try:
                made = await self._run(statements.migrate.read_bucket(self._q), conn)
            except psycopg.errors.UndefinedTable:
                # A schema not made yet (asked again next call) or older than buckets.
                return [self._q]
            self._qs = self._namespace_of(made)
        return self._qs

    async def _submit_to(self, params: dict[str, Any]) -> tuple[Queries, int | None]:
        """The schema a top-level submit with *params* goes to and, in a namespace, its
        bucket (None for an ordinary schema): the one :func:`kestrel.buckets.choose` picks
        from the submit's keys alone.

        Raises:
            ConfigError: in a namespace, both an idempotency key and a dedup key."""
        qs = await self._namespace()
        if len(qs) == 1:
            return qs[0], None
        bucket = self._for_submit(qs, params)
        return qs[bucket], bucket

    async def _of(self, execution_id: uuid.UUID,
                  conn: psycopg.AsyncConnection[Any] | None = None) -> Queries:
        """The schema holding *execution_id* (the namespace read on *conn* if not known yet)."""
        return self._by_id(await self._namespace(conn), execution_id)

    async def _every(self, make: Any) -> list[Any]:
        """What the statement *make(q)* returns in each bucket's schema, bucket 0 first."""
        return [await self._run(make(q)) for q in await self._namespace()]

    async def submit(
        self, wf: WorkflowFn | str, *args: Any, queue: str = "default", priority: int = 0,
        idempotency_key: str | None = None, timeout: float | None = None,
        delay: float | None = None, start_at: datetime | None = None,
        dedup_key: str | None = None, on_duplicate: str = "return",
        debounce_key: str | None = None, debounce: float | None = None,
        debounce_max: float | None = None, concurrency_key: str | None = None,
        tags: dict[str, str] | None = None,
        conn: psycopg.AsyncConnection[Any] | None = None,
    ) -> Handle:
        """Enqueue *wf* with *args*; return its handle once the row is committed (or, with
        *conn*, written in that connection's transaction).

        *priority*: higher first within the queue. *timeout*: seconds after which the
        execution ends failed. *delay* (seconds) or *start_at* (a time, as the database clock
        reads it): not claimed before then. Both count from the call, also inside a
        transaction of *conn* that began long before it.
        *dedup_key*: at most one live execution per key in the queue; a duplicate returns the
        live one (``on_duplicate="return"``) or raises ``DuplicateExecution`` ("reject").
        *debounce_key* and *debounce* (seconds): it starts after *debounce* seconds without
        another submit of the key in the queue; each such submit before then replaces the
        pending one's arguments and returns its id, and once it has started the next submit
        starts the next one. *debounce_max* (default ten windows) bounds how long submits
        that never stop can push the start back.
        *concurrency_key*: in a queue declared with ``per_key``, at most that many
        executions of the key run at once, and the keys take turns.
        *tags*: names to text (``{"customer": "acme"}``, at most 32) to find it by
        (``list --tag``); the workflow may change them with ``ctx.set_tags``.

        The rules are those of the SQL function ``submit`` (one set at every door), checked
        here before the round trip; nothing is written when one is broken.

        Raises:
            ConfigError: an invalid queue name, priority, timeout, delay, on_duplicate,
                debounce or tag name, or more than 32 tags.
            SerializationError: the workflow name, a key or a tag's value is empty, too long
                or holds NUL or a lone surrogate; an argument cannot round-trip through JSON.
            PayloadTooLarge: the encoded arguments are over ``max_payload_bytes``.
            IdempotencyConflict: *idempotency_key* belongs to an execution submitted with
                other arguments or options (the key covers the whole call but ``conn``).
            DuplicateExecution: *dedup_key* is live and *on_duplicate* is "reject", or
                *debounce_key* is pending for another workflow.
        """
        params = self._submit_params(wf, args, queue, priority, idempotency_key, timeout,
                                     delay, start_at, dedup_key, on_duplicate,
                                     Debounce.of(debounce_key, debounce, debounce_max),
                                     concurrency_key=concurrency_key, tags=tags)
        q, _ = await self._submit_to(params)
        eid = await self._run(statements.client.submit(q, params), conn)
        count_submitted(params["workflow"])
        return Handle(self, eid)

    async def signal(self, execution_id: uuid.UUID | str, name: str, payload: Any = None, *,
                     idempotency_key: str | None = None,
                     conn: psycopg.AsyncConnection[Any] | None = None) -> bool:
        """Send signal *name*; False if *idempotency_key* was used already (counted once).
        With *conn* it is part of that connection's transaction.

        Raises:
            SerializationError: the name, key or payload breaks the rules of ``submit``.
            ExecutionNotFound: no such execution.
            InvalidState: it has already finished.
        """
        params = self._signal_params(execution_id, name, payload, idempotency_key)
        q = await self._of(params["id"])
        return await self._run(statements.client.signal(q, **params), conn)

    async def cancel(self, execution_id: uuid.UUID | str, *,
                     conn: psycopg.AsyncConnection[Any] | None = None) -> str:
        """Cancel it and its live children; return ``cancelled``, ``cancelling`` (running:
        stops at its next step boundary) or the terminal status it already had."""
        eid = ident(execution_id)
        return await self._run(statements.client.cancel(await self._of(eid), id=eid), conn)

    async def retry(self, execution_id: uuid.UUID | str, *,
                    idempotency_key: str | None = None,
                    conn: psycopg.AsyncConnection[Any] | None = None) -> Handle:
        """Re-run a failed, cancelled or quarantined execution from its last good
        checkpoint (the checkpoints before its first failed step), as a fresh run from
        there: signals consumed and child results taken after that point are given back.

        *idempotency_key*: the same call with the same key, sent again because the first
        one's reply was lost (a connection error), returns as the first did instead of
        raising InvalidState for the execution it already brought back.

        Raises:
            ExecutionNotFound: no execution has that id.
            InvalidState: it is not failed, cancelled or quarantined (and no retry used
                *idempotency_key*).
            ParentCancelled: its parent was cancelled (retry the parent).
            IdempotencyConflict: *idempotency_key* names another operation.
        """
        eid = ident(execution_id)
        if idempotency_key is not None:
            codec.check_text(idempotency_key, what="idempotency key")
        await self._run(statements.client.retry(await self._of(eid), id=eid,
                                                idempotency_key=idempotency_key), conn)
        return Handle(self, eid)

    async def fork(self, execution_id: uuid.UUID | str, from_step: int, *,
                   idempotency_key: str | None = None) -> Handle:
        """Start a new execution that replays the first *from_step* positions of this one
        (their checkpoints, caught failures included, patch markers and events) and runs
        the rest afresh, with this one's signals not consumed below *from_step* pending.

        The fork's id is chosen here, so a resend after a lost reply returns the fork the
        first call made. *idempotency_key*: the same for a key the caller names (a key
        names one operation, as submit's does).

        Raises:
            ExecutionNotFound: no execution has that id.
            ConfigError: *from_step* is negative or past the end (more than one past the
                last recorded position).
            InvalidState: a child started below *from_step* has not ended yet (its end
                would reach this execution only); the message names the step.
            IdempotencyConflict: *idempotency_key* names another operation.
        """
        if idempotency_key is not None:
            codec.check_text(idempotency_key, what="idempotency key")
        eid = ident(execution_id)
        qs = await self._namespace()
        # In the source's bucket, where its checkpoints are.
        bucket = buckets.bucket_of(eid, len(qs)) if len(qs) > 1 else None
        new = await self._run(statements.client.fork(
            self._by_id(qs, eid), id=eid, from_step=from_step,
            new_id=ids.new_id(bucket=bucket), idempotency_key=idempotency_key))
        return Handle(self, new)

    async def forked_from(self, execution_id: uuid.UUID | str
                          ) -> tuple[uuid.UUID, int] | None:
        """The execution this one was forked from and the step the fork started at, or None
        when it was not made by :meth:`fork`."""
        eid = ident(execution_id)
        source: tuple[uuid.UUID, int] | None = await self._run(
            statements.client.fork_source(await self._of(eid), id=eid))
        return source

    async def get(self, execution_id: uuid.UUID | str) -> Execution:
        """Return the execution, live or finished.

        Raises:
            ExecutionNotFound: no execution has that id.
        """
        eid = ident(execution_id)
        ex: Execution | None = await self._run(statements.client.get_execution(
            await self._of(eid), id=eid))
        if ex is None:
            raise ExecutionNotFound(f"no execution {eid}")
        return ex

    async def steps(self, execution_id: uuid.UUID | str) -> list[StepRow]:
        """The execution's checkpoints in step order, live or finished."""
        eid = ident(execution_id)
        rows: list[StepRow] = await self._run(statements.client.list_steps(
            await self._of(eid), id=eid))
        return rows

    async def counts(self) -> dict[str, int]:
        """Executions by status, live and finished."""
        return buckets.merge_counts(await self._every(statements.client.count_by_status))

    async def unclaimable(self, *, limit: int = 100) -> list[Unclaimable]:
        """Live executions that no live worker can claim (no worker registers their workflow
        and queue), by workflow and queue, the most first, at most *limit* lines. They wait
        for a worker that knows them; none is ever failed for it."""
        return buckets.merge_unclaimable(await self._every(
            lambda q: statements.versions.unclaimable_by_workflow(q, limit=limit)), limit)

    async def workers(self) -> list[LiveWorker]:
        """The live workers: what each claims, and its app version."""
        parts: list[list[LiveWorker]] = await self._every(statements.versions.live_workers)
        return [w for part in parts for w in part]

    async def patches(self, patch: str | None = None) -> list[PatchUse]:
        """Every recorded patch (or only *patch*) by workflow: executions with its marker,
        and live executions without it, which may still need the old code path."""
        if patch is not None:
            codec.check_text(patch, what="patch id")
        return buckets.merge_patches(await self._every(
            lambda q: statements.versions.patch_summary(q, patch=patch)))

    async def remove_queue_limits(self, queue: str) -> bool:
        """Remove *queue*'s limits in every bucket (``kestrel-runtime remove-limits``): workers
        claim it unlimited from their next look at the limits (a heartbeat interval), and one
        whose code declares them declares them again when it starts. Whether it had any."""
        name = self._queue_name(queue)
        return any(await self._every(
            lambda q: statements.queues.remove_queue_limit(q, queue=name)))

    async def list(self, *, status: str | None = None, workflow: str | None = None,
                   since: datetime | None = None, limit: int = 50,
                   app_version: str | None = None, patch: str | None = None,
                   with_patch: bool = True, tags: dict[str, str] | None = None,
                   ) -> list[ExecutionSummary]:
        """Executions newest first, live and finished, optionally filtered.

        *app_version*: only those first claimed by that version. *patch*: only those that
        recorded that patch's marker (``with_patch=False``: only those of the same workflows
        that did not, which may still need the old code path). *tags*: only those carrying
        every one of these tags (a lookup in the tags' index).
        """
        if status is not None and status not in {s.value for s in Status}:
            raise ConfigError(f"unknown status {status!r}; one of "
                              f"{', '.join(s.value for s in Status)}")
        if app_version is not None:
            check_app_version(app_version)
        if patch is not None:
            codec.check_text(patch, what="patch id")
        tagged = tag_filter(tags)
        return buckets.merge_list(await self._every(
            lambda q: statements.client.list_executions(
                q, status=status, workflow=workflow, since=since, limit=limit,
                app_version=app_version, patch=patch, with_patch=with_patch,
                tags=tagged)), limit)

    async def bulk(self, action: str, match: Match, *, signal: str | None = None,
                   payload: Any = None, key: str | None = None, dry_run: bool = False,
                   after: tuple[datetime, uuid.UUID] | None = None, pages: int | None = None,
                   page_size: int = 200,
                   progress: Callable[[BulkResult], None] | None = None) -> BulkResult:
        """Cancel, retry or signal (*action*) every execution *match* matches, live or
        finished, in every bucket: a page of *page_size* at a time, newest first, each
        execution its own call (as ``cancel``, ``retry`` and ``signal`` of one id do).

        *key* names the action: a retry or signal is sent under a key made of it and the
        execution's id, so a run stopped half way and run again with the same *key* acts on
        nothing twice (a cancel needs none: cancelling is idempotent). None makes one; the
        result carries it. *dry_run*: only count what matches and return a sample. *after*
        and *pages*: start after that cursor, stop after that many pages (the result's
        cursor goes on; None once every page was done). *progress* is called after each page.

        Raises:
            ConfigError: an unknown action or status, no filter, or a filter, key, signal
                name or payload that cannot be stored: before anything is read or written.
        """
        key = check_bulk(action, match, key)
        if action == "signal" and not dry_run:
            if signal is None:
                raise ConfigError("a bulk signal needs the signal's name")
            none = uuid.UUID(int=0)  # checks the name, key and payload, for no execution
            self._signal_params(none, signal, payload, bulk_item_key(key, none))
        done = BulkResult(action=action, key=key, dry_run=dry_run)
        filters = match_params(match)
        if dry_run:
            counts = await self._every(lambda q: statements.http.count_executions(q, **filters))
            done.matched = sum(counts)
            rows = buckets.merge_pages(await self._every(
                lambda q: statements.http.page_executions(q, **filters, after=None, limit=10)),
                10)
            done.sample = [uuid.UUID(r["id"]) for r, _ in rows]
            return done
        cursor, turned = after, 0
        while True:
            rows = buckets.merge_pages(await self._every(
                lambda q, at=cursor: statements.http.page_executions(
                    q, **filters, after=at, limit=page_size)), page_size)
            for row, _created in rows:
                await self._act(done, match, row, signal, payload)
            done.matched += len(rows)
            done.sample += [uuid.UUID(r["id"]) for r, _ in rows[:10 - len(done.sample)]]
            cursor = (rows[-1][1], uuid.UUID(rows[-1][0]["id"])) if len(rows) == page_size \
                else None
            done.cursor, turned = cursor, turned + 1
            if progress is not None:
                progress(done)
            if cursor is None or (pages is not None and turned >= pages):
                return done

    async def _act(self, done: BulkResult, match: Match, row: dict[str, Any],
                   signal: str | None, payload: Any) -> None:
        """One execution of a bulk action (*row*, as a page lists it): act, or count why
        not (done.skipped)."""
        eid = uuid.UUID(row["id"])
        why = bulk_skip(done.action, row["status"])
        if why is not None:
            done.skip(why)
            return
        try:
            if done.action == "cancel" and row["parent_id"] is not None:
                # Its parent's cancel takes it (in one transaction, the whole tree): cancelled
                # first, it would wake the parent, which could react before its own turn.
                parent = await self.get(row["parent_id"])
                if not parent.status.terminal and match.surely_matches(parent):
                    done.skip("its parent matches too: cancelled with it")
                    return
            if done.action == "signal":
                ex = await self.get(eid)
                if ex.status.value != "waiting" or ex.waiting_for != signal:
                    # Kept, it would be taken by a later wait of that name, one nobody chose.
                    done.skip(f"not waiting for signal {signal!r}")
                    return
            if done.action == "cancel":
                now = await self.cancel(eid)
                if now not in ("cancelled", "cancelling"):
                    done.skip(f"already {now}")
                    return
            elif done.action == "retry":
                await self.retry(eid, idempotency_key=bulk_item_key(done.key, eid))
                if (await self.get(eid)).status.value in RETRYABLE:
                    # Under this key it was retried before (and ended so again): the keyed
                    # retry did nothing now.
                    done.skip("retried under this key already")
                    return
            elif not await self.signal(eid, str(signal), payload,
                                       idempotency_key=bulk_item_key(done.key, eid)):
                done.skip("signalled under this key already")
                return
        except ExecutionNotFound:
            done.skip("gone")
            return
        except ParentCancelled:
            done.skip("its parent was cancelled")
            return
        except InvalidState:
            done.skip("not failed, cancelled or quarantined" if done.action == "retry"
                      else "finished")
            return
        done.acted += 1

    async def stats(self) -> Stats:
        """Live work by queue and status, running by worker, totals by status."""
        parts = []
        for q in await self._namespace():
            async with self._borrow() as conn:
                parts.append(await db.run_script(conn, statements.client.stats(q)))
        return parts[0] if len(parts) == 1 else buckets.merge_stats(parts)

    async def result(self, execution_id: uuid.UUID | str, timeout: float | None = None) -> Any:
        """Wait for the execution to finish and return its result.

        A restart of PostgreSQL while waiting is ridden out: the wait reconnects and goes on.

        Raises:
            WorkflowFailed: it ended failed, cancelled or quarantined.
            TimeoutError: it did not finish within *timeout* seconds (also when the
                database was unreachable until then; the message says so).
        """
        eid = ident(execution_id)

        async def check(conn: psycopg.AsyncConnection[Any], q: Queries) -> tuple[bool, Any]:
            ex = await db.run(conn, statements.client.get_execution(q, id=eid))
            if ex is None:
                raise ExecutionNotFound(f"no execution {eid}")
            return ex.status.terminal, ex

        ex = await self._wait(eid, check, statements.client.listen_done, timeout,
                              lambda: f"execution {eid} did not finish in {timeout}s")
        return outcome(ex)

    async def get_event(self, execution_id: uuid.UUID | str, key: str,
                        timeout: float | None = None) -> Any:
        """Return the latest value of event *key*, waiting up to *timeout* for one.

        Raises:
            TimeoutError: no value was published in time.
        """
        eid = ident(execution_id)

        async def check(conn: psycopg.AsyncConnection[Any], q: Queries) -> tuple[bool, Any]:
            return await db.run(conn, statements.client.get_event(q, id=eid, key=key))

        return await self._wait(eid, check, statements.client.listen_events, timeout,
                                lambda: f"no event {key!r} on {eid} after {timeout}s")

    async def _wait(self, eid: uuid.UUID, check: Any, listen: Any, timeout: float | None,
                    message: Any) -> Any:
        """Re-run *check(conn, q)* on each notification (or poll) until it says done; *q* is
        the schema holding *eid*, *listen(q)* the statement that subscribes to its news.

        A lost connection (PostgreSQL restarted, failed over, or a pooler restarted) does not
        end the wait, wherever it lands (the namespace lookup included): it reconnects with
        backoff and goes on until *timeout*, then raises TimeoutError saying the database was
        unreachable.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.02
        retry = RECONNECT_FIRST_S
        waiter: psycopg.AsyncConnection[Any] | None = None
        try:
            while True:
                try:
                    # The schema is looked up inside the loop, on the wait's own connection:
                    # a restart landing on the lookup is ridden out like any other.
                    if waiter is None and self._listen_dsn:
                        waiter = await self._connect(self._listen_dsn)
                        await db.run(waiter, listen(await self._of(eid, waiter)))
                    # Same connection when it is direct; a pooled one otherwise.
                    if waiter is not None and self._listen_dsn == self.dsn:
                        done, value = await check(waiter, await self._of(eid, waiter))
                    else:
                        async with self._borrow(timeout=max(0.1, remaining(deadline))) as conn:
                            done, value = await check(conn, await self._of(eid, conn))
                    if done:
                        return value
                    if deadline is not None and time.monotonic() >= deadline:
                        raise TimeoutError(message())
                    if waiter is not None:
                        async for _ in waiter.notifies(timeout=remaining(deadline),
                                                       stop_after=1):
                            pass
                    else:
                        await asyncio.sleep(min(delay, remaining(deadline)))
                        delay = min(delay * 1.5, POLL_CAP_S)
                    retry = RECONNECT_FIRST_S
                except TimeoutError:
                    raise  # ours, above (an OSError, which is_transient would take for a link)
                except Exception as exc:
                    if not connections.is_transient(exc):
                        raise
                    if waiter is not None:
                        await waiter.close()
                        waiter = None
                    if deadline is not None and time.monotonic() >= deadline:
                        raise TimeoutError(f"{message()}; the database was unreachable "
                                           f"({reason(exc)})") from None
                    log.debug("waiting: connection lost (%s); reconnecting in %.2fs",
                              reason(exc), retry)
                    await asyncio.sleep(min(retry, remaining(deadline)))
                    retry = min(retry * 2, POLL_CAP_S)
        finally:
            if waiter is not None:
                await waiter.close()


@dataclass(frozen=True, slots=True)
class Handle:
    """A submitted execution."""

    client: Client
    id: uuid.UUID

    async def result(self, timeout: float | None = None) -> Any:
        """Wait for it to finish and return its result (see :meth:`Client.result`)."""
        return await self.client.result(self.id, timeout)

    async def get(self) -> Execution:
        """The execution as it is now (see :meth:`Client.get`)."""
        return await self.client.get(self.id)

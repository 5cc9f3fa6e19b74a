"""What a group commit does with each kind of failure (FAULTS P1, P3, D10, O4, O6).

A refusal of what the batch says (P1/P3: a data exception, a program limit) is isolated to
the one item that causes it: the batch is split in halves sent concurrently, O(log n)
statements, the poison item's caller alone gets the error, at once and never retried, and its
batch-mates do not wait for the isolation to end. Contention (a lock or statement timeout, a
deadlock, a serialization failure, too many connections) is no fault of any item: the whole
batch is sent again with backoff, every caller gets its result, and only an item whose lease
is no longer trusted leaves the batch, its caller told LeaseLost. Before issue 22 a lock
timeout was bisected and each item failed after two tries (an execution lost an attempt, one
was quarantined), and data errors were retried with sleeps, halves one after the other.

The flushes here are fakes that fail as PostgreSQL would; the assertions count statements and
order results, never time them.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable

import psycopg
import pytest
from psycopg import errors

from kestrel.errors import LeaseLost
from kestrel.writer import GroupCommit

POISON = 37
N = 64

DATA_ERRORS = [
    psycopg.DataError("PostgreSQL text fields cannot contain NUL (0x00) bytes"),
    errors.ProgramLimitExceeded("total size of jsonb array elements exceeds the maximum"),
    errors.InvalidTextRepresentation('invalid input syntax for type json: "secret-37"'),
]

CONTENTION = [
    errors.LockNotAvailable("canceling statement due to lock timeout"),  # 55P03
    errors.QueryCanceled("canceling statement due to statement timeout"),  # 57014
    errors.DeadlockDetected("deadlock detected"),  # 40P01
    errors.SerializationFailure("could not serialize access"),  # 40001
    errors.TooManyConnections("sorry, too many clients already"),  # 53300
]


def _ids(e: Exception) -> str:
    return type(e).__name__


def run_writer(flush: Callable[[list[int]], Awaitable[list[int]]],
               body: Callable[[GroupCommit[int, int]], Awaitable[None]],
               **kwargs: object) -> None:
    async def main() -> None:
        writer: GroupCommit[int, int] = GroupCommit("test", flush, retry_delay=0.001,
                                                    **kwargs)  # type: ignore[arg-type]
        runner = asyncio.create_task(writer.run())
        try:
            await asyncio.wait_for(body(writer), 10)
            assert not runner.done()  # the writer is still running
            assert await asyncio.wait_for(writer.submit(500), 5) == 1000
        finally:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)

    asyncio.run(main())


@pytest.mark.parametrize("error", DATA_ERRORS, ids=_ids)
def test_a_poison_item_costs_log_n_statements_and_is_never_retried(
        error: Exception, caplog: pytest.LogCaptureFixture) -> None:
    batches: list[list[int]] = []

    async def flush(items: list[int]) -> list[int]:
        batches.append(list(items))
        await asyncio.sleep(0)
        if POISON in items:
            raise error
        return [i * 2 for i in items]

    async def body(writer: GroupCommit[int, int]) -> None:
        outcomes = await asyncio.gather(*(writer.submit(i) for i in range(N)),
                                        return_exceptions=True)
        for i, got in enumerate(outcomes):
            assert got is error if i == POISON else got == i * 2, (i, got)

    caplog.set_level(logging.WARNING, logger="kestrel.writer")
    run_writer(flush, body)
    batches.remove([500])  # run_writer's last check
    assert batches[0] == list(range(N))  # they shared one group commit
    # One statement for the batch, then two per level of halving down to the poison.
    assert len(batches) == 1 + 2 * math.ceil(math.log2(N))
    assert batches.count([POISON]) == 1  # refused once, never sent again
    # One line: the SQLSTATE, and nothing of the batch's data.
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert str(error.sqlstate or "-") in lines[0] and "secret" not in lines[0]


def test_batch_mates_are_answered_while_the_poison_item_is_still_being_isolated() -> None:
    """The poison item's own statement hangs until every other item has its result: with
    halves sent one after the other (the code before issue 22), the items behind the
    poison's half would wait for it, and this would never finish."""
    error = DATA_ERRORS[0]

    async def body(writer: GroupCommit[int, int]) -> None:
        futures = [asyncio.ensure_future(writer.submit(i)) for i in range(N)]
        mates = [f for i, f in enumerate(futures) if i != POISON]
        await asyncio.gather(*mates)
        assert not futures[POISON].done()  # its isolation has not ended
        released.set()
        with pytest.raises(type(error)):
            await futures[POISON]

    released = asyncio.Event()

    async def flush(items: list[int]) -> list[int]:
        await asyncio.sleep(0)
        if items == [POISON]:
            await released.wait()
        if POISON in items:
            raise error
        return [i * 2 for i in items]

    run_writer(flush, body)


def test_many_poison_items_each_fail_alone_and_are_sent_alone_once() -> None:
    poisons = set(range(0, N, 2))
    batches: list[list[int]] = []

    async def flush(items: list[int]) -> list[int]:
        batches.append(list(items))
        await asyncio.sleep(0)
        if poisons & set(items):
            raise DATA_ERRORS[0]
        return [i * 2 for i in items]

    async def body(writer: GroupCommit[int, int]) -> None:
        outcomes = await asyncio.gather(*(writer.submit(i) for i in range(N)),
                                        return_exceptions=True)
        for i, got in enumerate(outcomes):
            assert isinstance(got, psycopg.DataError) if i in poisons else got == i * 2

    run_writer(flush, body)
    batches.remove([500])
    for p in poisons:
        assert batches.count([p]) == 1
    assert len(batches) < 2 * N  # a binary tree's nodes, no retries


@pytest.mark.parametrize("error", CONTENTION, ids=_ids)
def test_contention_retries_the_whole_batch_and_fails_nobody(error: Exception) -> None:
    batches: list[list[int]] = []

    async def flush(items: list[int]) -> list[int]:
        batches.append(list(items))
        await asyncio.sleep(0)
        if len(batches) <= 1:  # the first try meets the lock
            raise error
        return [i * 2 for i in items]

    async def body(writer: GroupCommit[int, int]) -> None:
        assert await asyncio.gather(*(writer.submit(i) for i in range(N))) == [
            i * 2 for i in range(N)]

    run_writer(flush, body)
    assert batches == [list(range(N))] * 2 + [[500]]  # the same batch again, not halves


def test_a_lock_held_for_a_long_time_keeps_every_item_waiting_then_all_succeed(
        caplog: pytest.LogCaptureFixture) -> None:
    """An operator's table lock (FAULTS O6): every try fails until it goes; no item fails,
    and the log says it once, with the SQLSTATE."""
    tries = 0

    async def flush(items: list[int]) -> list[int]:
        nonlocal tries
        tries += 1
        await asyncio.sleep(0)
        if tries <= 30:
            raise errors.LockNotAvailable("canceling statement due to lock timeout")
        return [i * 2 for i in items]

    async def body(writer: GroupCommit[int, int]) -> None:
        assert await asyncio.gather(*(writer.submit(i) for i in range(8))) == [
            i * 2 for i in range(8)]

    caplog.set_level(logging.WARNING, logger="kestrel.writer")
    run_writer(flush, body)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "55P03" in warnings[0]


def test_one_row_a_client_holds_delays_only_its_own_half() -> None:
    """A lock timeout that keeps coming back for one item (its row is held by a client's open
    transaction) splits the batch: the other items go through while that one retries."""
    held = asyncio.Event()

    async def flush(items: list[int]) -> list[int]:
        await asyncio.sleep(0)
        if POISON in items and not held.is_set():
            raise errors.LockNotAvailable("canceling statement due to lock timeout")
        return [i * 2 for i in items]

    async def body(writer: GroupCommit[int, int]) -> None:
        futures = [asyncio.ensure_future(writer.submit(i)) for i in range(N)]
        assert await asyncio.gather(*(f for i, f in enumerate(futures) if i != POISON)) == [
            i * 2 for i in range(N) if i != POISON]
        assert not futures[POISON].done()  # still retried, not failed
        held.set()  # the client commits
        assert await futures[POISON] == POISON * 2

    run_writer(flush, body)


def test_contention_past_the_lease_tells_only_those_items_lease_lost() -> None:
    untrusted = {3, 5}
    tries = 0

    async def flush(items: list[int]) -> list[int]:
        nonlocal tries
        tries += 1
        await asyncio.sleep(0)
        if untrusted & set(items):
            raise errors.DeadlockDetected("deadlock detected")
        return [i * 2 for i in items]

    async def body(writer: GroupCommit[int, int]) -> None:
        outcomes = await asyncio.gather(*(writer.submit(i) for i in range(8)),
                                        return_exceptions=True)
        for i, got in enumerate(outcomes):
            assert isinstance(got, LeaseLost) if i in untrusted else got == i * 2, (i, got)

    run_writer(flush, body, trusted=lambda i: i not in untrusted)
    assert tries == 2 + 1  # the whole batch, then the trusted items alone (+ run_writer's)


def test_a_pool_timeout_counts_as_a_stall_and_a_contended_batch_does_not() -> None:
    """FAULTS R3: a batch waiting for a pool connection keeps the watchdog's clock running
    (and says why); a batch backing off on contention does not (another worker would meet
    the same lock)."""
    from psycopg_pool import PoolTimeout

    async def main() -> None:
        error: Exception = PoolTimeout("couldn't get a connection after 2.00 sec")
        gate = asyncio.Event()

        async def flush(items: list[int]) -> list[int]:
            await asyncio.sleep(0)
            if not gate.is_set():
                raise error
            return items

        writer: GroupCommit[int, int] = GroupCommit("test", flush, retry_delay=0.001)
        runner = asyncio.create_task(writer.run())
        try:
            pending = asyncio.create_task(writer.submit(1))
            await asyncio.sleep(0.05)
            import time

            stalled, why = writer.stall(time.monotonic() + 100)
            assert stalled >= 100 and why == "no connection"
            error = errors.LockNotAvailable("canceling statement due to lock timeout")
            await asyncio.sleep(0.3)  # backing off on contention now
            waits = [writer.stall(time.monotonic() + 100)[0] for _ in range(50)
                     if not await asyncio.sleep(0.001)]
            assert min(waits) == 0.0
            gate.set()
            assert await asyncio.wait_for(pending, 5) == 1
        finally:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)

    asyncio.run(main())


def test_legs_queued_behind_the_flights_gate_are_not_a_stall() -> None:
    """A batch split under contention queues its legs behind the flight's gate (two
    statements at a time). Only the legs holding it are measured by the watchdog: before,
    every queued leg's clock ran while it waited its turn, and 32 executions behind a 5 s
    operator lock tripped the watchdog, which gave their leases up (FAULTS O6)."""
    release = asyncio.Event()
    two_held = asyncio.Event()
    held = 0

    async def flush(items: list[int]) -> list[int]:
        nonlocal held
        if len(items) > 1 and not release.is_set():
            raise errors.LockNotAvailable("canceling statement due to lock timeout")
        held += 1
        if held == 2:
            two_held.set()
        await release.wait()  # each leg's single statement hangs until the lock goes
        return [i * 2 for i in items]

    async def body(writer: GroupCommit[int, int]) -> None:
        import time

        futures = [asyncio.ensure_future(writer.submit(i)) for i in range(8)]
        await two_held.wait()
        await asyncio.sleep(0.05)
        legs = list(writer._legs)
        measured = [leg for leg in legs if not leg.backing_off]
        assert len(legs) > 2 and len(measured) == 2, (len(legs), len(measured))
        assert writer.stall(time.monotonic())[0] < 1000  # finite: only the holders count
        release.set()
        assert await asyncio.gather(*futures) == [i * 2 for i in range(8)]

    run_writer(flush, body)

"""Several group commits in flight per writer (issue 16, item 3).

A writer with ``in_flight=N`` sends a new batch while up to N-1 earlier ones are still on
their way, instead of letting items wait a whole round trip; every item still gets its own
result, a stuck flight still shows in ``stalled_for`` while the others complete (the lease
watchdog relies on it), and a flight that crashes still ends the writer (crash-only).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from kestrel.writer import GroupCommit


def test_a_second_batch_is_sent_while_the_first_is_still_in_flight() -> None:
    batches: list[list[int]] = []
    concurrent: list[int] = []

    async def main() -> None:
        gate = asyncio.Event()
        active = 0

        async def flush(items: list[int]) -> list[int]:
            nonlocal active
            batches.append(list(items))
            active += 1
            concurrent.append(active)
            try:
                if 0 in items:
                    await gate.wait()  # the first batch stays on its way
                return [i * 10 for i in items]
            finally:
                active -= 1

        writer: GroupCommit[int, int] = GroupCommit("test", flush, in_flight=2)
        runner = asyncio.create_task(writer.run())
        try:
            first = asyncio.create_task(writer.submit(0))
            await asyncio.sleep(0.01)
            # Sent and answered while the first batch has not come back.
            assert await asyncio.wait_for(writer.submit(1), 5) == 10
            assert await asyncio.wait_for(writer.submit(2), 5) == 20
            assert not first.done()
            gate.set()
            assert await asyncio.wait_for(first, 5) == 0
        finally:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)

    asyncio.run(main())
    assert batches == [[0], [1], [2]]
    assert max(concurrent) == 2


def test_one_flight_at_a_time_when_in_flight_is_one() -> None:
    concurrent: list[int] = []

    async def main() -> None:
        active = 0

        async def flush(items: list[int]) -> list[int]:
            nonlocal active
            active += 1
            concurrent.append(active)
            await asyncio.sleep(0.005)
            active -= 1
            return items

        writer: GroupCommit[int, int] = GroupCommit("test", flush, in_flight=1)
        runner = asyncio.create_task(writer.run())
        try:
            for wave in range(5):
                got = await asyncio.wait_for(asyncio.gather(
                    *(writer.submit(wave * 10 + i) for i in range(10))), 5)
                assert got == [wave * 10 + i for i in range(10)]
        finally:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)

    asyncio.run(main())
    assert max(concurrent) == 1


def test_a_stuck_flight_shows_as_stalled_while_other_flights_complete() -> None:
    async def main() -> None:
        gate = asyncio.Event()

        async def flush(items: list[int]) -> list[int]:
            if 0 in items:
                await gate.wait()  # a statement that never returns
            return items

        writer: GroupCommit[int, int] = GroupCommit("test", flush, in_flight=3)
        runner = asyncio.create_task(writer.run())
        try:
            assert writer.stalled_for(time.monotonic() + 100) == 0.0  # idle
            stuck = asyncio.create_task(writer.submit(0))
            await asyncio.sleep(0.01)
            for i in range(1, 20):  # the others keep completing
                assert await asyncio.wait_for(writer.submit(i), 5) == i
            assert writer.stalled_for(time.monotonic() + 100) >= 100
            gate.set()
            assert await asyncio.wait_for(stuck, 5) == 0
            await asyncio.sleep(0.01)
            assert writer.stalled_for(time.monotonic() + 100) == 0.0
        finally:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)

    asyncio.run(main())


def test_a_flight_that_crashes_ends_the_writer_and_cancels_every_waiter() -> None:
    async def main() -> None:
        gate = asyncio.Event()

        async def flush(items: list[int]) -> list[int]:
            if 0 in items:
                await gate.wait()
                return items
            return []  # one result short: a bug, not a database error

        writer: GroupCommit[int, int] = GroupCommit("test", flush, in_flight=2)
        runner = asyncio.create_task(writer.run())
        waiting = asyncio.create_task(writer.submit(0))
        await asyncio.sleep(0.01)
        broken = asyncio.create_task(writer.submit(1))
        with pytest.raises(ValueError):
            await asyncio.wait_for(runner, 5)
        # Neither waiter is left hanging, and neither is given an execution's failure.
        for task in (waiting, broken):
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(task, 5)

    asyncio.run(main())

"""A worker's stop ends every service even when a cancellation is lost on its way (psycopg_pool
can hand a connection to a waiting client at the moment its task is cancelled, and the task
goes on without seeing it: the CI run that hung in test_r3 had its registration service so)."""

from __future__ import annotations

import asyncio

from kestrel.worker import _cancel_all


async def _loses_its_first_cancellation(rounds: list[int]) -> None:
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        current = asyncio.current_task()
        assert current is not None
        current.uncancel()  # what a swallowed cancellation leaves: the task goes on
    while True:
        rounds.append(1)
        await asyncio.sleep(0.05)


def test_a_service_that_lost_its_cancellation_is_cancelled_again_and_ends() -> None:
    async def main() -> tuple[bool, int]:
        rounds: list[int] = []
        task = asyncio.create_task(_loses_its_first_cancellation(rounds))
        await asyncio.sleep(0)
        await asyncio.wait_for(_cancel_all([task]), timeout=10)
        return task.cancelled(), len(rounds)

    cancelled, rounds = asyncio.run(main())
    assert cancelled
    assert rounds > 0  # it did go on after the first cancellation


def test_one_cancellation_alone_would_not_end_it() -> None:
    async def main() -> bool:
        task = asyncio.create_task(_loses_its_first_cancellation([]))
        await asyncio.sleep(0)
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=0.5)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return bool(done)

    assert asyncio.run(main()) is False

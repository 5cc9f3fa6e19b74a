"""P1/P3: a group commit isolates a non-transient failure to the one item that causes it.

The flush here refuses any batch holding the poisoned item, as PostgreSQL (or psycopg)
refuses a whole statement for one value it cannot store. Only that item's caller gets the
error; every other caller gets its result; the writer keeps running. Before the fix the
writer handed the error to every waiter in the batch and died (a DataError), or retried the
same batch for ever (ProgramLimitExceeded, an OperationalError subclass).
"""

from __future__ import annotations

import asyncio

import psycopg
import pytest
from psycopg import errors

from kestrel.writer import GroupCommit

POISON = 37


@pytest.mark.parametrize("error", [
    psycopg.DataError("PostgreSQL text fields cannot contain NUL (0x00) bytes"),
    errors.ProgramLimitExceeded("total size of jsonb array elements exceeds the maximum"),
], ids=lambda e: type(e).__name__)
def test_one_refused_item_fails_only_its_own_caller(error: Exception) -> None:
    batches: list[list[int]] = []

    async def flush(items: list[int]) -> list[int]:
        batches.append(list(items))
        await asyncio.sleep(0)
        if POISON in items:
            raise error
        return [i * 2 for i in items]

    async def main() -> None:
        writer: GroupCommit[int, int] = GroupCommit("test", flush, retry_delay=0.001)
        runner = asyncio.create_task(writer.run())
        try:
            outcomes = await asyncio.wait_for(
                asyncio.gather(*(writer.submit(i) for i in range(100)),
                               return_exceptions=True), 10)
            # They shared one group commit, the poisoned item among them.
            assert batches[0] == list(range(100))
            for i, got in enumerate(outcomes):
                if i == POISON:
                    assert got is error
                else:
                    assert got == i * 2, f"item {i} got {got!r}"
            # Bounded: the poisoned item alone was sent a few times, not for ever.
            assert 1 <= sum(1 for b in batches if b == [POISON]) <= 5
            # The writer is still running and takes new work.
            assert not runner.done()
            assert await asyncio.wait_for(writer.submit(500), 5) == 1000
        finally:
            runner.cancel()

    asyncio.run(main())

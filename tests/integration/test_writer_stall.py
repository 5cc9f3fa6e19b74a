"""The lease watchdog's reason for a stalled writer (FAULTS R3): a flush that is waiting for
a pool connection says so while it waits, not only once its wait has timed out. The
watchdog's limit (the lease) and the pool's timeout can be equal, and the first "not
extending leases" line must name the reason (it once raced the pool's timeout)."""

from __future__ import annotations

import asyncio
import time
import uuid

from kestrel import connections
from kestrel.commits import CheckpointCommits
from kestrel.lease import Leases
from kestrel.sql import queries
from kestrel.types import StepWrite


def test_a_flush_waiting_for_a_pool_connection_says_so_before_its_wait_times_out(
        pg_dsn: str, schema: str) -> None:
    async def main() -> None:
        pool = connections.make_pool(pg_dsn, max_size=1, name="stall-test")
        await pool.open(wait=True)
        commits = CheckpointCommits(pool, queries(schema), Leases(), in_flight=1)
        flushing = asyncio.create_task(commits.writer.run())
        held = await pool.getconn()  # the pool's only connection
        try:
            write = StepWrite(uuid.uuid4(), 1, 0, "s", "1", None, 1, 0.0)
            item = asyncio.create_task(commits.writer.submit(write))
            await asyncio.sleep(0.5)
            stalled, why = commits.writer.stall(time.monotonic())
            assert stalled >= 0.4
            assert why == "no connection"  # the pool's timeout (30 s) is far off
        finally:
            await pool.putconn(held)
        saved = await asyncio.wait_for(item, 30)
        assert not saved.owned  # no such execution: written nowhere
        assert commits.writer.stall(time.monotonic()) == (0.0, "")
        flushing.cancel()
        await pool.close()

    asyncio.run(main())

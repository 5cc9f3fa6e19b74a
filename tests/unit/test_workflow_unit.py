"""Workflow registration, retry delays and the group-commit writer (no database)."""

from __future__ import annotations

import asyncio
import uuid

import psycopg
import pytest

import kestrel
from kestrel.workflow import RetryPolicy, registry, workflow_name
from kestrel.writer import GroupCommit


def _unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@pytest.mark.parametrize("attempt", range(1, 12))
def test_retry_delay_within_equal_jitter_bounds(attempt: int) -> None:
    policy = RetryPolicy(attempts=20, base_delay=0.25, max_delay=10.0)
    cap = min(10.0, 0.25 * 2 ** (attempt - 1))
    for _ in range(200):
        assert 0.5 * cap <= policy.delay(attempt) <= cap


@pytest.mark.parametrize("attempts", [0, -1])
def test_retry_policy_rejects_fewer_than_one_attempt(attempts: int) -> None:
    with pytest.raises(ValueError):
        RetryPolicy(attempts=attempts)


def test_retry_policy_rejects_negative_delays() -> None:
    with pytest.raises(ValueError):
        RetryPolicy(base_delay=-1)


def test_workflow_registers_under_own_or_given_name() -> None:
    name = _unique("named")

    @kestrel.workflow(name=name)
    async def flow(ctx: object) -> None: ...

    @kestrel.workflow
    async def bare_flow(ctx: object) -> None: ...

    assert workflow_name(flow) == name
    assert registry()[name] is flow
    assert workflow_name(bare_flow) == "bare_flow"
    assert workflow_name("plain") == "plain"
    # Registering the same function again is allowed (module re-import).
    assert kestrel.workflow(name=name)(flow) is flow


def test_workflow_rejects_non_async_function() -> None:
    name = _unique("sync")

    def sync_flow(ctx: object) -> None: ...

    with pytest.raises(TypeError):
        kestrel.workflow(name=name)(sync_flow)
    assert name not in registry()


def test_workflow_rejects_other_function_under_existing_name() -> None:
    name = _unique("dup")

    @kestrel.workflow(name=name)
    async def first(ctx: object) -> None: ...

    async def second(ctx: object) -> None: ...

    with pytest.raises(ValueError, match=name):
        kestrel.workflow(name=name)(second)
    assert registry()[name] is first


def test_workflow_name_of_non_workflow_raises() -> None:
    async def not_registered(ctx: object) -> None: ...

    with pytest.raises(TypeError):
        workflow_name(not_registered)


async def _run_batcher(flush, items: list[int]) -> tuple[list[int], GroupCommit[int, int]]:
    batcher: GroupCommit[int, int] = GroupCommit("test", flush)
    runner = asyncio.create_task(batcher.run())
    try:
        results = await asyncio.wait_for(
            asyncio.gather(*(batcher.submit(i) for i in items)), timeout=10
        )
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
    return list(results), batcher


def test_batcher_coalesces_concurrent_submits() -> None:
    sizes: list[int] = []

    async def flush(batch: list[int]) -> list[int]:
        sizes.append(len(batch))
        await asyncio.sleep(0.01)
        return [i * 2 for i in batch]

    results, batcher = asyncio.run(_run_batcher(flush, list(range(50))))
    assert results == [i * 2 for i in range(50)]
    assert sum(sizes) == 50
    assert len(sizes) <= 3, sizes
    assert (batcher.flushes, batcher.items) == (len(sizes), 50)


def test_batcher_retries_transient_flush_error() -> None:
    calls: list[int] = []

    async def flush(batch: list[int]) -> list[int]:
        calls.append(len(batch))
        await asyncio.sleep(0.01)
        if len(calls) == 1:
            raise psycopg.OperationalError("connection lost")
        return [i + 100 for i in batch]

    results, batcher = asyncio.run(_run_batcher(flush, list(range(20))))
    assert results == [i + 100 for i in range(20)]
    assert len(calls) >= 2
    assert batcher.items == 20


def test_group_commit_bounds_a_batch_by_bytes_as_well_as_count() -> None:
    """A batch never carries more than max_bytes of items (one item alone may exceed it), so
    a burst of large checkpoints never approaches PostgreSQL's 1 GB message limit."""
    sizes: list[list[int]] = []

    async def flush(batch: list[int]) -> list[int]:
        sizes.append(list(batch))
        await asyncio.sleep(0.01)
        return batch

    async def main() -> list[int]:
        writer: GroupCommit[int, int] = GroupCommit("test", flush, max_items=1000,
                                                    max_bytes=100, size=lambda item: item)
        runner = asyncio.create_task(writer.run())
        try:
            # 40-byte items: at most two a batch; the 150-byte one goes alone.
            return list(await asyncio.wait_for(asyncio.gather(
                *(writer.submit(n) for n in [40] * 7 + [150] + [40] * 3)), timeout=10))
        finally:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)

    assert asyncio.run(main()) == [40] * 7 + [150] + [40] * 3
    assert all(sum(b) <= 100 or len(b) == 1 for b in sizes), sizes
    assert [150] in sizes
    assert max(len(b) for b in sizes) == 2

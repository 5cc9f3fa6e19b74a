"""The benchmark workload: one workflow of k steps whose bodies are no-op, sleep or CPU."""

from __future__ import annotations

import asyncio
import hashlib

import kestrel


@kestrel.step(name="noop")
async def noop(i: int) -> int:
    return i


@kestrel.step(name="sleep")
async def sleep(i: int, seconds: float) -> int:
    await asyncio.sleep(seconds)
    return i


@kestrel.step(name="cpu")
def cpu(i: int, rounds: int) -> str:
    """Plain def: runs in the worker's thread pool."""
    digest = str(i).encode()
    for _ in range(rounds):
        digest = hashlib.sha256(digest).digest()
    return digest.hex()[:16]


@kestrel.workflow(name="bench")
async def bench(ctx: kestrel.Context, steps: int, kind: str, work: float) -> int:
    for i in range(steps):
        if kind == "sleep":
            await ctx.step(sleep, i, work)
        elif kind == "cpu":
            await ctx.step(cpu, i, int(work))
        else:
            await ctx.step(noop, i)
    return steps


# Limited queues for `bench.run --with-limited`: work waits in them the whole run, and a
# few of their executions hold slots sleeping (little CPU), so what the unlimited queue
# loses is the cost of the limit machinery itself.
kestrel.queue("bench-limited-a", concurrency=2)
kestrel.queue("bench-limited-b", rate=2, period=1.0)


@kestrel.workflow(name="bench_limited")
async def bench_limited(ctx: kestrel.Context, seconds: float) -> int:
    await ctx.step(sleep, 0, seconds)
    return 0

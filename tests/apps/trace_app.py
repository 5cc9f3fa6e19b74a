"""Workflows for the trace tests (tests/integration/test_traces.py)."""

from __future__ import annotations

from typing import Any

import kestrel

_tries: dict[str, int] = {}


@kestrel.step(name="traces.add_one")
async def add_one(n: int) -> int:
    return n + 1


@kestrel.step(name="traces.flaky", retries=2, base_delay=0.01, max_delay=0.01)
def flaky(key: str) -> str:
    """Fails on its first try in this process (a plain step: it runs in a thread)."""
    _tries[key] = _tries.get(key, 0) + 1
    if _tries[key] == 1:
        raise ConnectionError("the first try fails")
    return key


@kestrel.workflow(name="traces.steps")
async def steps(ctx: kestrel.Context, n: int) -> int:
    """Two steps, the second retried once."""
    a = await ctx.step(add_one, n)
    await ctx.step(flaky, f"{ctx.execution_id}")
    return a


@kestrel.workflow(name="traces.approval")
async def approval(ctx: kestrel.Context, n: int) -> int:
    """A step, a durable wait for the signal ``go``, another step."""
    a = await ctx.step(add_one, n)
    got = await ctx.wait_for_signal("go")
    return int(await ctx.step(add_one, a + int(got.payload or 0)))


@kestrel.workflow(name="traces.parent")
async def parent(ctx: kestrel.Context, n: int) -> int:
    """A step, then a child (traces.steps) and its result."""
    a = await ctx.step(add_one, n)
    return int(await ctx.child("traces.steps", a))


@kestrel.workflow(name="traces.hooked")
async def hooked(ctx: kestrel.Context, body: Any) -> Any:
    """A webhook's workflow: one step over the delivery."""
    return await ctx.step(add_one, int(body["n"]))

"""Workflows that make kestrel calls in parallel (FAULTS C1; docs/reference/workflows.md,
"Parallel steps").

Every body appends to the side-effect ledger (tests.apps.ledger_app), so a test counts how
often each ran; a durable sleep after the fan-out makes the next claim replay it from its
checkpoints, where a position handed to the wrong call, or one never recorded, shows.
"""

from __future__ import annotations

import asyncio
from typing import Any

import kestrel
from tests.apps.ledger_app import ledger


@kestrel.step(name="par_g")
async def g(x: Any, pause: float = 0.0) -> str:
    ledger()
    if pause:
        await asyncio.sleep(pause)
    return f"g({x})"


@kestrel.step(name="par_h")
def h(x: Any) -> str:
    ledger()
    return f"h({x})"


@kestrel.step(name="par_flaky", retries=2, base_delay=0.01)
async def flaky(x: Any) -> str:
    ledger()
    if kestrel.current_step().attempt < 2:
        raise RuntimeError(f"flaky({x}) fails its first try")
    return f"flaky({x})"


@kestrel.step(name="par_boom")
async def boom(x: Any) -> str:
    ledger()
    raise ValueError(f"boom({x})")


@kestrel.workflow(name="par_child")
async def child(ctx: kestrel.Context, n: int) -> int:
    return len(await ctx.step(g, n)) + n


@kestrel.workflow(name="par_fan")
async def fan(ctx: kestrel.Context, n: int) -> list[str]:
    """n steps at once, alternating two step functions with the same and different
    arguments and bodies that finish in reverse order; then a replay."""
    calls = [ctx.step(g, i % 5, (n - i) * 0.002) if i % 2 else ctx.step(h, i % 5)
             for i in range(n)]
    out = list(await asyncio.gather(*calls))
    await ctx.sleep(0.05)
    return out


@kestrel.workflow(name="par_after_step")
async def after_step(ctx: kestrel.Context) -> list[str]:
    """A step, then two of the same step function at once (issue 38, row 2)."""
    a = await ctx.step(g, 1)
    b = list(await asyncio.gather(ctx.step(g, "x", 0.02), ctx.step(g, "y")))
    await ctx.sleep(0.05)
    return [a, *b]


@kestrel.workflow(name="par_nested")
async def nested(ctx: kestrel.Context, key: str) -> dict[str, Any]:
    """Nested fan-outs mixed with a flaky step, an event, a signal wait, a sleep and
    children started and then waited for in parallel."""
    first = await ctx.step(g, "start")
    inner, flaked, _, got, kids = await asyncio.gather(
        asyncio.gather(ctx.step(g, "a", 0.01), ctx.step(h, "b")),
        ctx.step(flaky, "c"),
        ctx.set_event("progress", key),
        ctx.wait_for_signal("go", timeout=60),
        asyncio.gather(*(ctx.start_child(child, i) for i in range(3))),
    )
    async with asyncio.TaskGroup() as tg:
        waits = [tg.create_task(ctx.wait_child(k)) for k in kids]
        tg.create_task(ctx.sleep(0.05))
    return {"first": first, "inner": list(inner), "flaky": flaked,
            "signal": got.payload, "children": [w.result() for w in waits]}


@kestrel.workflow(name="par_fan_children")
async def fan_children(ctx: kestrel.Context, n: int) -> dict[str, Any]:
    """Children started at once, then n steps (bodies finishing in reverse order) beside a
    durable sleep, then the children waited for at once: the process machine's fan-out."""
    kids = await asyncio.gather(*(ctx.start_child(child, i) for i in range(2)))
    steps, _ = await asyncio.gather(
        asyncio.gather(*(ctx.step(g, i, 0.01 * (n - i)) for i in range(n))), ctx.sleep(0.5))
    done = await asyncio.gather(*(ctx.wait_child(k) for k in kids))
    return {"steps": list(steps), "children": list(done)}


def model_fan_children(n: int) -> dict[str, Any]:
    """What par_fan_children(n) returns."""
    return {"steps": [f"g({i})" for i in range(n)],
            "children": [len(f"g({i})") + i for i in range(2)]}


@kestrel.workflow(name="par_waits")
async def waits(ctx: kestrel.Context) -> list[Any]:
    """Two signal waits and a sleep at once: each parks in turn, at its own position."""
    a, b, _ = await asyncio.gather(ctx.wait_for_signal("a"), ctx.wait_for_signal("b"),
                                   ctx.sleep(0.05))
    return [a.payload, b.payload]


@kestrel.workflow(name="par_caught")
async def caught(ctx: kestrel.Context) -> str:
    """One branch fails while another still runs: gather does not stop it; the workflow
    goes on once both are done (return_exceptions)."""
    results = await asyncio.gather(ctx.step(boom, 1), ctx.step(g, 2, 0.05),
                                   return_exceptions=True)
    await ctx.sleep(0.05)
    return "|".join(type(r).__name__ if isinstance(r, BaseException) else r
                    for r in results)


async def _pipeline(ctx: kestrel.Context, x: int) -> str:
    a = await ctx.step(g, x)
    return str(await ctx.step(h, a))


@kestrel.workflow(name="par_branch_sequence")
async def branch_sequence(ctx: kestrel.Context) -> list[str]:
    """Refused: a branch that makes a second call after its first returned."""
    return list(await asyncio.gather(_pipeline(ctx, 1), _pipeline(ctx, 2)))


@kestrel.workflow(name="par_parent_went_on")
async def parent_went_on(ctx: kestrel.Context) -> str:
    """Refused: a task started, then the workflow made a call before it made its own."""
    task = asyncio.create_task(ctx.step(g, "late"))
    first = await ctx.step(h, "first")
    return first + await task

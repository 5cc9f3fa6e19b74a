"""Workflows whose steps fail some tries before their outcome (issue 42, item 5): each
failed try is kept with the checkpoint and listed by ``show``, the HTTP API and the UI."""

from __future__ import annotations

import asyncio

import kestrel

HOSTILE_MESSAGES = [
    "NUL \x00 inside",
    "lone surrogate \ud800 here",
    "\x1b[31mred\x1b[0m and a\nnew line",
    "'); DROP TABLE operation_outputs; --",
    "</span><script>alert(1)</script>",
    "x" * 1_000_000,
]


class OddError(Exception):
    pass


OddError.__qualname__ = "Odd\x00Error"  # a class can be named anything


def _fail_until(good: int, message: str) -> None:
    attempt = kestrel.current_step().attempt
    if attempt < good:
        raise ConnectionError(f"{message}: try {attempt} refused")


@kestrel.step(name="tries_flaky", retries=4, base_delay=0.001, max_delay=0.001)
async def flaky(label: str, good: int) -> str:
    _fail_until(good, label)
    return f"{label} ok"


@kestrel.step(name="tries_doomed", retries=2, base_delay=0.001, max_delay=0.001)
async def doomed() -> str:
    raise ValueError(f"doomed, try {kestrel.current_step().attempt}")


@kestrel.step(name="tries_hostile", retries=30, base_delay=0.001, max_delay=0.001)
async def hostile() -> str:
    # Tries 1-23 raise an exception whose class name holds a NUL, 24-29 hostile messages.
    attempt, first = kestrel.current_step().attempt, 30 - len(HOSTILE_MESSAGES)
    if attempt < first:
        raise OddError(f"odd {attempt}")
    if attempt < 30:
        raise RuntimeError(HOSTILE_MESSAGES[attempt - first])
    return "survived"


@kestrel.workflow(name="tries_middle")
async def middle(ctx: kestrel.Context) -> list[str]:
    # The flaky step's checkpoint goes in a checkpoint batch (a step follows it).
    first = await ctx.step(flaky, "middle", 3)
    return [first, await ctx.step(flaky, "after", 1)]


@kestrel.workflow(name="tries_last")
async def last(ctx: kestrel.Context) -> str:
    # The flaky step is the last: its checkpoint is the tail the completion writes.
    return await ctx.step(flaky, "last", 2)


@kestrel.workflow(name="tries_doomed")
async def doomed_wf(ctx: kestrel.Context) -> str:
    return await ctx.step(doomed)


@kestrel.workflow(name="tries_hostile")
async def hostile_wf(ctx: kestrel.Context) -> str:
    return await ctx.step(hostile)


@kestrel.workflow(name="tries_parallel")
async def parallel(ctx: kestrel.Context) -> list[str]:
    return list(await asyncio.gather(ctx.step(flaky, "a", 2), ctx.step(flaky, "b", 4),
                                     ctx.step(flaky, "c", 1)))

"""Three versions of one workflow, for tests/integration/test_replay_cli.py.

The bodies are plain functions so that one process can hold all of them: each app module
(replay_v1, replay_v2, replay_v3) registers one of them as ``replay_app.flow``, as three
releases of the same code would, and ``kestrel.testing.replay`` takes any of them by name.

* v1: step ``a``, wait for the signal ``go``, step ``b``.
* v2: v1 plus, at the end, ``if ctx.patched("audit"): step audit`` (a safe change).
* v3: step ``b`` renamed ``c`` (a non-deterministic change).
"""

from __future__ import annotations

import kestrel


@kestrel.step(name="replay_app.a")
async def step_a(n: int) -> int:
    return n + 1


@kestrel.step(name="replay_app.b")
async def step_b(n: int) -> int:
    return n * 10


@kestrel.step(name="replay_app.c")
async def step_c(n: int) -> int:
    return n * 10


@kestrel.step(name="replay_app.audit")
async def step_audit(n: int) -> int:
    return n


async def flow_v1(ctx: kestrel.Context, n: int) -> int:
    a = await ctx.step(step_a, n)
    got = await ctx.wait_for_signal("go")
    return await ctx.step(step_b, a + (got.payload or 0))


async def flow_v2(ctx: kestrel.Context, n: int) -> int:
    a = await ctx.step(step_a, n)
    got = await ctx.wait_for_signal("go")
    b = await ctx.step(step_b, a + (got.payload or 0))
    if await ctx.patched("audit"):
        await ctx.step(step_audit, b)
    return b


async def flow_v3(ctx: kestrel.Context, n: int) -> int:
    a = await ctx.step(step_a, n)
    got = await ctx.wait_for_signal("go")
    return await ctx.step(step_c, a + (got.payload or 0))


async def gone(ctx: kestrel.Context, n: int) -> int:
    return await ctx.step(step_a, n)

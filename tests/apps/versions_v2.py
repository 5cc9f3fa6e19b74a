"""Version 2 of the app of versions_v1: the same names, an audit step added before the wait
behind ``ctx.patched``, and a workflow v1 does not know (``versions.v2_only``).

Executions parked at the wait by v1 passed the patch point without a marker: v2 replays them
down the old path. Executions that reach the point under v2 record the marker and audit.
"""

from __future__ import annotations

from typing import Any

import kestrel

PATCH = "audit-before-wait"


@kestrel.step(name="versions.prepare")
async def prepare(n: int) -> int:
    return n * 10


@kestrel.step(name="versions.audit")
async def audit(x: int) -> dict[str, int]:
    return {"audited": x}


@kestrel.step(name="versions.finish")
async def finish(x: int, payload: Any) -> dict[str, Any]:
    return {"x": x, "payload": payload}


@kestrel.workflow(name="versions.approval_flow")
async def approval_flow(ctx: kestrel.Context, n: int) -> dict[str, Any]:
    x = await ctx.step(prepare, n)
    if await ctx.patched(PATCH):
        await ctx.step(audit, x)
    got = await ctx.wait_for_signal("go")
    return await ctx.step(finish, x, got.payload)


@kestrel.workflow(name="versions.v2_only")
async def v2_only(ctx: kestrel.Context, n: int) -> dict[str, int]:
    return {"v2": await ctx.step(prepare, n)}

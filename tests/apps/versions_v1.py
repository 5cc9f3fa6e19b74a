"""Version 1 of an app, for tests/integration/test_rolling_deploy.py (v2 is versions_v2).

``approval_flow`` prepares, waits for the signal ``go`` and finishes.
"""

from __future__ import annotations

from typing import Any

import kestrel


@kestrel.step(name="versions.prepare")
async def prepare(n: int) -> int:
    return n * 10


@kestrel.step(name="versions.finish")
async def finish(x: int, payload: Any) -> dict[str, Any]:
    return {"x": x, "payload": payload}


@kestrel.workflow(name="versions.approval_flow")
async def approval_flow(ctx: kestrel.Context, n: int) -> dict[str, Any]:
    x = await ctx.step(prepare, n)
    got = await ctx.wait_for_signal("go")
    return await ctx.step(finish, x, got.payload)

"""Version 1 of an app for tests/integration/test_mixed_versions.py (v2 is mixed_v2): the
workflows as they were before v2 added a patch to each. Run by a v1 worker, an execution
that v2 recorded a marker for must never take these paths (FAULTS O5)."""

from __future__ import annotations

from typing import Any

import kestrel


@kestrel.step(name="mixed.prepare")
async def prepare(n: int) -> int:
    return n * 10


@kestrel.step(name="mixed.finish")
async def finish(x: int, extra: Any) -> dict[str, Any]:
    return {"x": x, "extra": extra}


@kestrel.workflow(name="mixed.park_after_patch")
async def park_after_patch(ctx: kestrel.Context, n: int) -> dict[str, Any]:
    x = await ctx.step(prepare, n)
    return await ctx.step(finish, x, None)


@kestrel.workflow(name="mixed.die_after_marker")
async def die_after_marker(ctx: kestrel.Context, n: int) -> dict[str, Any]:
    x = await ctx.step(prepare, n)
    return await ctx.step(finish, x, None)

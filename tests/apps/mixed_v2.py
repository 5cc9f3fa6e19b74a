"""Version 2 of the app of mixed_v1: each workflow gained a patch right after its first step.

``mixed.park_after_patch`` parks at a signal wait right after its marker (FAULTS O5 A);
``mixed.die_after_marker`` runs a new step after its marker, which holds for ever while the
file named by ``MIXED_HOLD_FILE`` exists, so a test can kill v2 between the marker and the new
step (FAULTS O5 B).
"""

from __future__ import annotations

import os
import time
from typing import Any

import kestrel


@kestrel.step(name="mixed.prepare")
async def prepare(n: int) -> int:
    return n * 10


@kestrel.step(name="mixed.check")
def check(x: int) -> dict[str, int]:
    hold = os.environ.get("MIXED_HOLD_FILE")
    while hold and os.path.exists(hold):
        time.sleep(0.1)
    return {"checked": x}


@kestrel.step(name="mixed.finish")
async def finish(x: int, extra: Any) -> dict[str, Any]:
    return {"x": x, "extra": extra}


@kestrel.workflow(name="mixed.park_after_patch")
async def park_after_patch(ctx: kestrel.Context, n: int) -> dict[str, Any]:
    x = await ctx.step(prepare, n)
    extra = None
    if await ctx.patched("approve-first"):
        extra = (await ctx.wait_for_signal("approve")).payload
    return await ctx.step(finish, x, extra)


@kestrel.workflow(name="mixed.die_after_marker")
async def die_after_marker(ctx: kestrel.Context, n: int) -> dict[str, Any]:
    x = await ctx.step(prepare, n)
    extra = None
    if await ctx.patched("check-first"):
        extra = await ctx.step(check, x)
    return await ctx.step(finish, x, extra)

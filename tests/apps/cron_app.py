"""A schedule, in its own module so only the tests that want ticks get them."""

from __future__ import annotations

import kestrel


@kestrel.scheduled("* * * * * *", name="every-second", catch_up=True)
@kestrel.workflow(name="tick")
async def tick(ctx: kestrel.Context, at: str) -> str:
    return at

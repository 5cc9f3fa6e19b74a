"""Workflows for tests/integration/test_doors.py."""

from __future__ import annotations

import kestrel

# The downstream service of `branching`: down until a test brings it up.
service = {"up": False}


@kestrel.step(name="doors.call_service")
async def call_service() -> str:
    if not service["up"]:
        raise RuntimeError("service down")
    return "served"


@kestrel.step(name="doors.fallback")
async def fallback() -> str:
    return "fell back"


@kestrel.step(name="doors.finish")
async def finish(got: str) -> str:
    return f"finished after {got}"


@kestrel.workflow(name="doors.branching")
async def branching(ctx: kestrel.Context) -> str:
    """Catches the failed step and takes another branch, which fails the execution later:
    a retry must replay the first branch, not the fallback's checkpoints (FAULTS X7)."""
    try:
        got = await ctx.step(call_service)
    except kestrel.StepFailed:
        await ctx.step(fallback)
        raise RuntimeError("the fallback is not enough") from None
    return await ctx.step(finish, got)

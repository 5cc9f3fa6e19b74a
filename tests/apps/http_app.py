"""Workflows for the HTTP door's tests (tests/integration/test_http_*.py)."""

from __future__ import annotations

from typing import Any

import kestrel


@kestrel.step(name="http.double")
async def double(n: int) -> int:
    return n * 2


@kestrel.step(name="http.explode")
async def explode() -> None:
    raise RuntimeError("exploded on purpose")


@kestrel.workflow(name="http.echo")
async def echo(ctx: kestrel.Context, body: Any) -> Any:
    """A webhook's workflow: returns what it was given."""
    return body


@kestrel.workflow(name="http.steps")
async def steps(ctx: kestrel.Context, n: int) -> int:
    """Two steps and a child: a timeline and a child tree for the execution page."""
    a = await ctx.step(double, n)
    await ctx.set_event("stage", "doubled")
    b = await ctx.child(echo, a)
    return int(b) + await ctx.step(double, 1)


@kestrel.workflow(name="http.approval")
async def approval(ctx: kestrel.Context, alert: Any) -> dict[str, Any]:
    """Waits for a human: the incident's approval step."""
    await ctx.set_event("stage", "awaiting_approval")
    decision = await ctx.wait_for_signal("approval", timeout=3600)
    if decision.timed_out:
        return {"outcome": "timed out"}
    return {"outcome": "approved" if decision.payload["approved"] else "rejected",
            "by": decision.payload.get("by")}


@kestrel.workflow(name="http.fails")
async def fails(ctx: kestrel.Context) -> None:
    """Fails at its only step: something to retry."""
    await ctx.step(explode)


@kestrel.workflow(name="http.number")
async def number(ctx: kestrel.Context, value: Any) -> dict[str, str]:
    """The number it was given, exactly as it arrived: its repr and type (a webhook's body
    holds it under "n")."""
    if isinstance(value, dict):
        value = value["n"]
    return {"repr": repr(value), "type": type(value).__name__}

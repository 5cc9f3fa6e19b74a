"""Workflows for the web UI's tests (tests/integration/test_ui.py, tests/browser): the HTTP
tests' workflows, the demo's incident_response, and one whose arguments, output and step
error carry whatever hostile text it is given; waits of every kind (a signal with any
name, a sleep, a child) for the executions list."""

from __future__ import annotations

from typing import Any

import kestrel
import kestrel.demo
import tests.apps.http_app  # noqa: F401  (registers http.*)


@kestrel.step(name="ui.echo")
async def echo(value: Any) -> Any:
    return value


@kestrel.step(name="ui.explode")
async def explode(text: str) -> None:
    raise RuntimeError(text)


@kestrel.workflow(name="ui.hostile")
async def hostile(ctx: kestrel.Context, text: str) -> None:
    """Records *text* as a step output and an event, then fails with it as the error."""
    await ctx.step(echo, {"html": text})
    await ctx.set_event("note", text)
    await ctx.step(explode, text)


@kestrel.workflow(name="ui.many")
async def many(ctx: kestrel.Context, n: int, size: int) -> int:
    """*n* steps, each with an output of *size* characters: a long, heavy timeline."""
    for i in range(n):
        await ctx.step(echo, f"{i}:" + "x" * size)
    return n


@kestrel.workflow(name="ui.waits_for")
async def waits_for(ctx: kestrel.Context, name: str) -> Any:
    """Waits for the signal *name* (any text a workflow may choose); returns its payload."""
    decision = await ctx.wait_for_signal(name, timeout=3600)
    return decision.payload


@kestrel.workflow(name="ui.sleeps")
async def sleeps(ctx: kestrel.Context, seconds: float) -> None:
    """A durable sleep: a row the executions list shows as sleeping."""
    await ctx.sleep(seconds)


@kestrel.workflow(name="ui.parent")
async def parent(ctx: kestrel.Context, name: str) -> Any:
    """Waits for a child that waits for the signal *name*."""
    return await ctx.child(waits_for, name)


@kestrel.step(name="ui.breaks_badly")
async def breaks_badly(text: str) -> None:
    raise RuntimeError(text + "\x00\ud800")  # what no argument can carry: NUL, a surrogate


@kestrel.workflow(name="ui.breaks")
async def breaks(ctx: kestrel.Context, text: str) -> None:
    """Fails with *text*, a NUL and a lone surrogate as its error message."""
    await ctx.step(breaks_badly, text)

"""Workflows for tests/integration/test_testing_kit.py: the manual's incident response
(docs/reference/workflows.md) in small, with in-process counters of how often each step body
ran (the kit runs its worker in the test's process, so a dict is an honest ledger)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import kestrel

bodies: Counter[str] = Counter()


@kestrel.step(name="kit.analyze", retries=3, base_delay=0.01, max_delay=0.02,
              retry_on=(TimeoutError,))
async def analyze(alert: dict[str, Any]) -> dict[str, Any]:
    bodies["kit.analyze"] += 1
    return {"cause": f"{alert['workload']} ran out of memory"}


@kestrel.step(name="kit.generate_fix")
def generate_fix(alert: dict[str, Any], rca: dict[str, Any]) -> dict[str, Any]:
    bodies["kit.generate_fix"] += 1
    return {"patch": f"raise the memory limit of {alert['workload']}", "rca": rca["cause"]}


@kestrel.step(name="kit.open_pr")
async def open_pr(fix: dict[str, Any]) -> str:
    bodies["kit.open_pr"] += 1
    return f"PR: {fix['patch']}"


@kestrel.workflow(name="kit.incident")
async def incident(ctx: kestrel.Context, alert: dict[str, Any]) -> dict[str, Any]:
    try:
        rca = await ctx.step(analyze, alert)
    except kestrel.StepFailed:
        return {"outcome": "analysis failed"}
    fix = await ctx.step(generate_fix, alert, rca)
    decision = await ctx.wait_for_signal("approval", timeout=7 * 24 * 3600)
    if decision.timed_out or not decision.payload["approved"]:
        return {"outcome": "not approved"}
    return {"outcome": await ctx.step(open_pr, fix)}


@kestrel.workflow(name="kit.cooldown")
async def cooldown(ctx: kestrel.Context, days: int) -> dict[str, Any]:
    """Analyse, sleep *days* days (durably), then open the PR."""
    alert = {"workload": "api"}
    rca = await ctx.step(analyze, alert)
    started = await ctx.now()
    await ctx.sleep(days * 24 * 3600)
    woke = await ctx.now()
    fix = await ctx.step(generate_fix, alert, rca)
    return {"slept_s": (woke - started).total_seconds(), "pr": await ctx.step(open_pr, fix)}


@kestrel.step(name="kit.flaky", retries=3, base_delay=0.01, max_delay=0.02,
              retry_on=(TimeoutError,))
async def flaky() -> list[int]:
    """The manual's "fail twice, then succeed" (docs/reference/workflows.md), by
    ``kestrel.current_step().attempt``."""
    tries.append(kestrel.current_step().attempt)
    if kestrel.current_step().attempt < 3:
        raise TimeoutError()
    return list(tries)


tries: list[int] = []


@kestrel.workflow(name="kit.flaky_twice")
async def flaky_twice(ctx: kestrel.Context) -> list[int]:
    return await ctx.step(flaky)  # type: ignore[no-any-return]


kestrel.queue("kit-ai", concurrency=1, rate=100, period=60)


@kestrel.workflow(name="kit.in_a_queue")
async def in_a_queue(ctx: kestrel.Context, alert: dict[str, Any]) -> str:
    rca = await ctx.step(analyze, alert)
    return str(rca["cause"])


@kestrel.workflow(name="kit.wait_named")
async def wait_named(ctx: kestrel.Context, signal: str) -> Any:
    """Wait for the signal named by the caller (tests of the waiting gauge's bound)."""
    return (await ctx.wait_for_signal(signal)).payload


@kestrel.workflow(name="kit.parent_of_a_sleeper")
async def parent_of_a_sleeper(ctx: kestrel.Context, days: int) -> dict[str, Any]:
    """A child that sleeps *days* days: the parent waits on the child, the child sleeps."""
    return dict(await ctx.child(cooldown, days))


@kestrel.workflow(name="kit.every_internal")
async def every_internal(ctx: kestrel.Context, alert: dict[str, Any]) -> dict[str, Any]:
    """Every context call that records a step of its own, around two steps of the workflow's
    (the timeline's internal names: kestrel.testing.INTERNAL_STEPS,
    docs/tutorials/testing.md)."""
    new = await ctx.patched("kit-v2")
    rca = await ctx.step(analyze, alert)
    await ctx.now()
    await ctx.random()
    await ctx.uuid()
    await ctx.set_event("stage", "analysed")
    await ctx.set_tags(stage="analysed")
    await ctx.signal(ctx.execution_id, "note", {"new": new})
    note = await ctx.wait_for_signal("note")
    await ctx.sleep(60)
    child = await ctx.start_child(in_a_queue, alert)
    cause = await ctx.wait_child(child)
    fix = await ctx.step(generate_fix, alert, rca)
    return {"note": note.payload, "cause": cause, "fix": fix["patch"], "child": str(child.id)}


@kestrel.workflow(name="kit.sleep_then_wait")
async def sleep_then_wait(ctx: kestrel.Context, days: int) -> str:
    """Sleep *days* days, then wait a day for "go" (run_until_waiting stops at the wait, or
    with skip_sleeps=False at the sleep)."""
    await ctx.sleep(days * 24 * 3600)
    got = await ctx.wait_for_signal("go", timeout=24 * 3600)
    return "timed out" if got.timed_out else f"went {got.payload}"


@kestrel.workflow(name="kit.parent_of_a_waiter")
async def parent_of_a_waiter(ctx: kestrel.Context) -> str:
    """A child that sleeps a day and then waits for "go": the parent waits for the child."""
    return str(await ctx.child(sleep_then_wait, 1))

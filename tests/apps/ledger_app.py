"""Workflows for the integration and fault tests.

Step bodies append one line per run to an unfenced side-effect ledger, a file named by
``KESTREL_TEST_LEDGER`` (O_APPEND writes of one short line are atomic), so tests can count how
often bodies ran independently of the checkpoints the runtime recorded. Every output is a
pure function of the arguments (``model``), so results are checkable.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import kestrel


def ledger(kind: str = "body", **extra: Any) -> None:
    path = os.environ.get("KESTREL_TEST_LEDGER")
    if not path:
        return
    info = kestrel.current_step()
    line = json.dumps({
        "kind": kind, "execution_id": str(info.execution_id), "step_id": info.step_id,
        "name": info.name, "attempt": info.attempt, "epoch": info.lease_epoch,
        "pid": os.getpid(), "t": time.time(), **extra,
    })
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def read_ledger(path: str | Path, **match: Any) -> list[dict[str, Any]]:
    """The ledger's entries, or those whose fields equal every *match* given."""
    p = Path(path)
    if not p.exists():
        return []
    entries = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    return [e for e in entries if all(e[k] == v for k, v in match.items())]


def model_step(n: int, k: int) -> int:
    return n * 10 + k


def model(n: int, steps: int = 3) -> int:
    return sum(model_step(n, k) for k in range(steps))


@kestrel.step(name="add")
async def add(n: int, k: int) -> int:
    ledger()
    return model_step(n, k)


@kestrel.step(name="add_sync")
def add_sync(n: int, k: int) -> int:
    ledger()
    return model_step(n, k)


@kestrel.workflow(name="three_steps")
async def three_steps(ctx: kestrel.Context, n: int) -> int:
    total = 0
    for k in range(3):
        total += await ctx.step(add, n, k)
    return total


@kestrel.workflow(name="three_sync_steps")
async def three_sync_steps(ctx: kestrel.Context, n: int) -> int:
    total = 0
    for k in range(3):
        total += await ctx.step(add_sync, n, k)
    return total


@kestrel.step(name="slow_add")
async def slow_add(n: int, k: int, seconds: float) -> int:
    ledger("start")
    await asyncio.sleep(seconds)
    ledger()
    return model_step(n, k)


@kestrel.workflow(name="slow_middle")
async def slow_middle(ctx: kestrel.Context, n: int, seconds: float) -> int:
    """Step 1 is slow: long enough for a test to SIGKILL the process running it."""
    a = await ctx.step(add, n, 0)
    b = await ctx.step(slow_add, n, 1, seconds)
    c = await ctx.step(add, n, 2)
    return a + b + c


@kestrel.workflow(name="slow_child_in")
async def slow_child_in(ctx: kestrel.Context, n: int, seconds: float, queue: str) -> int:
    """A parent whose child (slow_middle) runs in *queue*, in the parent's bucket."""
    return int(await ctx.child(slow_middle, n, seconds, queue=queue))


@kestrel.step(name="slow_sync")
def slow_sync(n: int, seconds: float) -> int:
    """A long ``def`` step (it runs on a thread): start and end in the ledger."""
    ledger("start")
    time.sleep(seconds)
    ledger()
    return n


@kestrel.workflow(name="long_def")
async def long_def(ctx: kestrel.Context, n: int, seconds: float) -> int:
    return int(await ctx.step(slow_sync, n, seconds))


@kestrel.step(name="short")
async def short(n: int, k: int) -> int:
    """A short step (0-19 ms, fixed by its arguments) that records its body in the ledger."""
    await asyncio.sleep(((n * 7 + k * 13) % 20) / 1000)
    ledger()
    return model_step(n, k)


@kestrel.workflow(name="short_steps")
async def short_steps(ctx: kestrel.Context, n: int, steps: int) -> int:
    """*steps* short steps one after another: checkpoint batches hold the row most of the
    time (FAULTS C2)."""
    total = 0
    for k in range(steps):
        total += await ctx.step(short, n, k)
    return total


@kestrel.step(name="long_async")
async def long_async(n: int, seconds: float) -> int:
    """A long ``async`` step: its start, its end and a cancellation in the ledger."""
    ledger("start")
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        ledger("stopped")
        raise
    ledger()
    return n


@kestrel.workflow(name="long_async_wf")
async def long_async_wf(ctx: kestrel.Context, n: int, seconds: float) -> int:
    return int(await ctx.step(long_async, n, seconds))


@kestrel.step(name="die")
def die() -> None:
    ledger()
    os.kill(os.getpid(), signal.SIGKILL)


@kestrel.workflow(name="poison")
async def poison(ctx: kestrel.Context) -> None:
    await ctx.step(die)


@kestrel.step(name="crash")
def crash(how: str) -> None:
    """A step that takes its whole process down, every time: os._exit or a segfault."""
    ledger()
    if how == "exit":
        os._exit(1)
    import ctypes

    ctypes.string_at(0)  # SIGSEGV: a read of address 0


@kestrel.workflow(name="crasher")
async def crasher(ctx: kestrel.Context, how: str) -> None:
    await ctx.step(crash, how)


_failures: dict[str, int] = {}


@kestrel.step(name="flaky", retries=3, base_delay=0.01, max_delay=0.02, retry_on=(ConnectionError,))
async def flaky(key: str, fail_times: int) -> str:
    ledger()
    _failures[key] = _failures.get(key, 0) + 1
    if _failures[key] <= fail_times:
        raise ConnectionError(f"attempt {_failures[key]} failed")
    return f"ok after {_failures[key]}"


@kestrel.workflow(name="flaky_wf")
async def flaky_wf(ctx: kestrel.Context, key: str, fail_times: int) -> str:
    return await ctx.step(flaky, key, fail_times)


@kestrel.step(name="not_retried", retries=3, base_delay=0.01, retry_on=(ConnectionError,))
async def not_retried() -> None:
    ledger()
    raise ValueError("a bug, not a transient error")


@kestrel.workflow(name="fails_in_step")
async def fails_in_step(ctx: kestrel.Context) -> None:
    await ctx.step(not_retried)


@kestrel.workflow(name="raises")
async def raises(ctx: kestrel.Context, message: str) -> None:
    raise RuntimeError(message)


@kestrel.step(name="returns_bad")
async def returns_bad(kind: str) -> Any:
    ledger()
    return {"set": {1, 2}, "nan": float("nan"), "nul": "a\x00b", "obj": object()}[kind]


@kestrel.workflow(name="bad_output")
async def bad_output(ctx: kestrel.Context, kind: str) -> str:
    try:
        await ctx.step(returns_bad, kind)
    except kestrel.StepFailed as exc:
        return f"caught {exc.error_type}: {exc.error_message}"
    return "no error"


@kestrel.step(name="float_value")
async def float_value() -> Any:
    ledger()
    return {"big": 1e20, "tuple": (1, 2), "small": 0.1}


@kestrel.workflow(name="echo_float")
async def echo_float(ctx: kestrel.Context) -> Any:
    return {"live": await ctx.step(float_value)}


# -- waits, signals, events, children (issue 6) ---------------------------------------------

@kestrel.workflow(name="approval")
async def approval(ctx: kestrel.Context, n: int) -> dict[str, Any]:
    pre = await ctx.step(add, n, 0)
    sig = await ctx.wait_for_signal("approve")
    post = await ctx.step(add, n, 2)
    return {"pre": pre, "payload": sig.payload, "post": post}


@kestrel.workflow(name="waiter")
async def waiter(ctx: kestrel.Context) -> Any:
    sig = await ctx.wait_for_signal("go")
    return sig.payload


@kestrel.workflow(name="wait_with_timeout")
async def wait_with_timeout(ctx: kestrel.Context, timeout: float) -> dict[str, Any]:
    sig = await ctx.wait_for_signal("never", timeout=timeout)
    return {"timed_out": sig.timed_out, "payload": sig.payload}


@kestrel.workflow(name="sleeper")
async def sleeper(ctx: kestrel.Context, n: int, seconds: float) -> int:
    a = await ctx.step(add, n, 0)
    await ctx.sleep(seconds)
    b = await ctx.step(add, n, 1)
    return a + b


@kestrel.workflow(name="progress")
async def progress(ctx: kestrel.Context) -> str:
    await ctx.set_event("stage", "analyzing")
    await ctx.wait_for_signal("go")
    await ctx.set_event("stage", "fixing")
    return "done"


@kestrel.workflow(name="parent")
async def parent(ctx: kestrel.Context, n: int) -> int:
    return int(await ctx.child(three_steps, n))


@kestrel.workflow(name="replaying_parent")
async def replaying_parent(ctx: kestrel.Context, n: int) -> int:
    """Starts a child, then parks three times: each wake-up replays the start_child call."""
    handle = await ctx.start_child(three_steps, n)
    for _ in range(3):
        await ctx.sleep(0)
    return int(await ctx.wait_child(handle))


@kestrel.workflow(name="parent_of_waiter")
async def parent_of_waiter(ctx: kestrel.Context) -> Any:
    return await ctx.child(waiter)


seen_values: dict[str, list[list[str]]] = {}


@kestrel.workflow(name="deterministic")
async def deterministic(ctx: kestrel.Context) -> list[str]:
    values = [(await ctx.now()).isoformat(), repr(await ctx.random()), str(await ctx.uuid())]
    seen_values.setdefault(str(ctx.execution_id), []).append(values)
    await ctx.sleep(0)  # park and come back: the second run replays the three helpers
    return values


@kestrel.workflow(name="quick")
async def quick(ctx: kestrel.Context, n: int) -> int:
    return int(await ctx.step(add, n, 0))


# -- queues, limits and schedules (issue 10) ------------------------------------------------

kestrel.queue("ai-model", concurrency=3)
kestrel.queue("rate-limited", rate=5, period=2.0)
kestrel.queue("per-proc", per_process=1)
kestrel.queue("ns-limited", concurrency=2, rate=50, period=1.0)  # both limits, in a namespace
kestrel.queue("deploys", concurrency=3, per_key=1)  # concurrency keys (issue 42)


@kestrel.workflow(name="retag")
async def retag(ctx: kestrel.Context, stage: str) -> str:
    """Moves its tags on during the run (tags, issue 42)."""
    await ctx.set_tags(stage=stage, customer=None)
    return str(await ctx.step(add, 1, 0)) + stage


@kestrel.step(name="hold")
async def hold(seconds: float) -> None:
    await asyncio.sleep(seconds)


@kestrel.workflow(name="busy")
async def busy(ctx: kestrel.Context, seconds: float) -> None:
    await ctx.step(hold, seconds)



@kestrel.step(name="hog")
async def hog_step(seconds: float) -> int:
    """CPU-bound code in an async step: blocks the event loop for *seconds*."""
    ledger("start")
    time.sleep(seconds)  # noqa: ASYNC251 - blocking the loop is the point of this step
    ledger()
    return 1


@kestrel.workflow(name="hog")
async def hog(ctx: kestrel.Context, seconds: float) -> int:
    return int(await ctx.step(hog_step, seconds))

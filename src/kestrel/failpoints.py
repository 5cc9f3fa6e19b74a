"""Fault injection for the fault suite (FAULTS.md), off unless ``KESTREL_FAILPOINTS`` is set.

``KESTREL_FAILPOINTS=name[=raise|exit|sleep(S)][:N],…`` is read once, at import: a malformed
value raises ValueError then (the CLI imports this module before forking, so a typo stops the
start instead of every worker). Each point fires at most N times per process (default 1).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import time
from typing import Any

import psycopg

log = logging.getLogger("kestrel.failpoints")


def _parse_failpoints(spec: str) -> dict[str, list[Any]]:
    """``name[=mode][:N]`` items, comma-separated: mode is ``raise`` (the default), ``crash``,
    ``exit``, ``sleep(SECONDS)`` or ``hang(SECONDS)``; N is how many times it fires in each
    process (default 1)."""
    points: dict[str, list[Any]] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        head, _, times = item.partition(":")
        name, _, mode = head.partition("=")
        mode = mode or "raise"
        match = re.fullmatch(r"raise|crash|exit|(?:sleep|hang)\((\d+(?:\.\d+)?)\)", mode)
        if name not in FAILPOINTS or match is None or not (times or "1").isdigit():
            raise ValueError(f"KESTREL_FAILPOINTS: cannot read {item!r}; expected "
                             f"NAME[=raise|crash|exit|sleep(SECONDS)|hang(SECONDS)][:N] with NAME "
                             f"one of "
                             f"{', '.join(FAILPOINTS)}")
        points[name] = [mode.partition("(")[0], float(match.group(1) or 0), int(times or 1)]
    return points


# Where the fault suite can inject a fault. ``raise`` at an ``after_*`` point is Temporal's
# ExecuteAndTimeout: the statement committed, the worker hears an error instead of the reply.
FAILPOINTS = ("after_claim_commit", "before_checkpoint_commit",
              "after_checkpoint_commit_before_ack", "before_complete", "after_complete_commit",
              "after_park_commit", "sweeper_round")
_FAILPOINTS = _parse_failpoints(os.environ.get("KESTREL_FAILPOINTS", ""))


def _fire(name: str) -> tuple[str, float] | None:
    point = _FAILPOINTS.get(name)
    if point is None or point[2] <= 0:
        return None
    point[2] -= 1
    log.warning("failpoint %s fired (%s)", name, point[0])
    return point[0], point[1]


def failpoint(name: str) -> None:
    """Fire *name* if ``KESTREL_FAILPOINTS`` names it. ``raise`` raises the error a lost
    connection would; ``crash`` raises a RuntimeError (a bug in the code at that point);
    ``exit`` kills this process with SIGKILL (no cleanup, as a crash); ``sleep(S)`` blocks
    the event loop for S seconds (the heartbeat thread keeps the leases, as in a CPU-bound
    stall); ``hang(S)`` is ``sleep`` here (see :func:`afailpoint`)."""
    fired = _fire(name)
    if fired is not None:
        _act(name, *fired)


async def afailpoint(name: str) -> None:
    """:func:`failpoint` in a coroutine, where ``hang(S)`` suspends only this coroutine for S
    seconds (a statement that never returns) while the event loop runs on."""
    fired = _fire(name)
    if fired is None:
        return
    if fired[0] == "hang":
        import asyncio

        await asyncio.sleep(fired[1])
        return
    _act(name, *fired)


def _act(name: str, mode: str, seconds: float) -> None:
    if mode == "exit":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode in ("sleep", "hang"):
        time.sleep(seconds)
        return
    if mode == "crash":
        raise RuntimeError(f"failpoint {name}: crash")
    raise psycopg.OperationalError(f"failpoint {name}: connection lost")

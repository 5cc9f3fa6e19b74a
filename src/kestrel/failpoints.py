"""Fault injection for the fault suite (FAULTS.md), off unless ``KESTREL_FAILPOINTS`` is set.

``KESTREL_FAILPOINTS=name[=raise|exit|sleep(S)][:N],…`` is read once, at import: a malformed
value raises ValueError then (the CLI imports this module before forking, so a typo stops the
start instead of every worker). Each point fires at most N times per process (default 1).

In-process, :func:`arm` sets a point from code, optionally only for the subject a point is
fired with (the step that is about to run, the checkpoints a group commit just wrote), with
two more modes: ``error`` raises a given exception and ``halt`` raises :class:`Halt`, which
ends the worker as a crash would. ``kestrel.testing`` injects its faults this way.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
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
# ``step_body`` fires just before a step's body runs, with the step's StepInfo as subject.
FAILPOINTS = ("after_claim_commit", "before_checkpoint_commit",
              "after_checkpoint_commit_before_ack", "before_complete", "after_complete_commit",
              "before_park", "after_park_commit", "sweeper_round", "step_body")
_FAILPOINTS = _parse_failpoints(os.environ.get("KESTREL_FAILPOINTS", ""))


class Halt(BaseException):
    """The worker dies at this point: an in-process stand-in for SIGKILL.

    A BaseException, so neither workflow code nor a writer's error isolation catches it: it
    ends the writer (or the task) it is raised in, so the worker's task group ends and
    :meth:`kestrel.worker.Worker.run` raises without draining or releasing its leases, which
    then expire as a killed process's would.
    """


@dataclass
class _Armed:
    mode: str
    times: int
    match: Callable[[Any], bool] | None
    error: BaseException | type[BaseException] | None


_ARMED: dict[str, list[_Armed]] = {}


def arm(name: str, mode: str = "raise", *, times: int = 1,
        match: Callable[[Any], bool] | None = None,
        error: BaseException | type[BaseException] | None = None) -> None:
    """Make *name* fire *times* times in this process, when *match* (if given) accepts the
    subject the point is fired with.

    *mode* is ``raise`` (a lost connection), ``crash`` (a RuntimeError), ``error`` (raise
    *error*, e.g. the TimeoutError a step body would raise) or ``halt`` (:class:`Halt`).

    Raises:
        ValueError: an unknown point or mode, or ``error`` without an exception.
        TypeError: *error* is neither an exception nor an exception class.
    """
    if error is not None and not (isinstance(error, BaseException) or (
            isinstance(error, type) and issubclass(error, BaseException))):
        raise TypeError(f"failpoint error must be an exception, not {type(error).__name__}")
    if name not in FAILPOINTS:
        raise ValueError(f"unknown failpoint {name!r}; expected one of {', '.join(FAILPOINTS)}")
    if mode not in ("raise", "crash", "error", "halt") or (mode == "error") != (error is not None):
        raise ValueError(f"failpoint mode {mode!r}: expected raise, crash, halt, or error "
                         "with an exception")
    if times < 1:
        raise ValueError("a failpoint fires at least once")
    _ARMED.setdefault(name, []).append(_Armed(mode, times, match, error))


def disarm() -> None:
    """Forget every point set with :func:`arm` (those of ``KESTREL_FAILPOINTS`` stay)."""
    _ARMED.clear()


def _fire_armed(name: str, subject: Any) -> None:
    for armed in _ARMED.get(name, ()):
        if armed.times > 0 and (armed.match is None or armed.match(subject)):
            armed.times -= 1
            log.warning("failpoint %s fired (%s)", name, armed.mode)
            if armed.mode == "halt":
                raise Halt(f"failpoint {name}: the worker halts here")
            if armed.error is not None:
                raise armed.error
            _act(name, armed.mode, 0.0)


def _fire(name: str) -> tuple[str, float] | None:
    point = _FAILPOINTS.get(name)
    if point is None or point[2] <= 0:
        return None
    point[2] -= 1
    log.warning("failpoint %s fired (%s)", name, point[0])
    return point[0], point[1]


def failpoint(name: str, subject: Any = None) -> None:
    """Fire *name* if ``KESTREL_FAILPOINTS`` names it or :func:`arm` set it for *subject*.
    ``raise`` raises the error a lost
    connection would; ``crash`` raises a RuntimeError (a bug in the code at that point);
    ``exit`` kills this process with SIGKILL (no cleanup, as a crash); ``sleep(S)`` blocks
    the event loop for S seconds (the heartbeat thread keeps the leases, as in a CPU-bound
    stall); ``hang(S)`` is ``sleep`` here (see :func:`afailpoint`)."""
    if _ARMED:
        _fire_armed(name, subject)
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

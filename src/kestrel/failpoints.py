"""Fault injection for the fault suite (FAULTS.md), off unless ``KESTREL_FAILPOINTS`` is set.

``KESTREL_FAILPOINTS=name[=raise|exit|sleep(S)][:N],…`` is read once, at import: a malformed
value raises ValueError then (the CLI imports this module before forking, so a typo stops the
start instead of every worker). Each point fires at most N times per process (default 1).

``lost_reply:<statement>[:N]`` (in the variable or with :func:`arm`) names one of the
statements of ``sql/queries`` instead of a point: the next N times that statement commits,
:mod:`kestrel.db` closes the connection and raises the OperationalError a reply lost on its
way back would (FAULTS R1). Unarmed, that costs the statement runner one truthiness test of
:data:`LOST_REPLIES`.

In-process, :func:`arm` sets a point from code, optionally only for the subject a point is
fired with (the step that is about to run, the checkpoints a group commit just wrote), with
two more modes: ``error`` raises a given exception and ``halt`` raises :class:`Halt`, which
ends the worker as a crash would. ``kestrel.testing`` injects its faults this way.
"""

from __future__ import annotations

import functools
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
        if item.startswith(LOST_REPLY):
            statement, _, times = item[len(LOST_REPLY):].partition(":")
            if statement not in _statement_names() or not (times or "1").isdigit():
                raise ValueError(f"KESTREL_FAILPOINTS: cannot read {item!r}; expected "
                                 f"{LOST_REPLY}STATEMENT[:N] with STATEMENT a name of "
                                 "sql/queries")
            points[LOST_REPLY + statement] = ["lost_reply", 0.0, int(times or 1)]
            continue
        head, _, times = item.partition(":")
        name, _, mode = head.partition("=")
        mode = mode or "raise"
        match = re.fullmatch(r"raise|crash|exit|(?:sleep|hang)\((\d+(?:\.\d+)?)\)", mode)
        if name not in FAILPOINTS or match is None or not (times or "1").isdigit():
            raise ValueError(f"KESTREL_FAILPOINTS: cannot read {item!r}; expected "
                             f"NAME[=raise|crash|exit|sleep(SECONDS)|hang(SECONDS)][:N] with NAME "
                             f"one of "
                             f"{', '.join(FAILPOINTS)}, or {LOST_REPLY}STATEMENT[:N]")
        points[name] = [mode.partition("(")[0], float(match.group(1) or 0), int(times or 1)]
    return points


# Where the fault suite can inject a fault. ``raise`` at an ``after_*`` point is Temporal's
# ExecuteAndTimeout: the statement committed, the worker hears an error instead of the reply.
# ``step_body`` fires just before a step's body runs, with the step's StepInfo as subject;
# ``after_consume_signal_commit`` with what consume_signal returned.
FAILPOINTS = ("after_claim_commit", "before_checkpoint_commit",
              "after_checkpoint_commit_before_ack", "before_complete", "after_complete_commit",
              "before_park", "after_park_commit", "sweeper_round", "step_body",
              "after_consume_signal_commit", "before_notify_done")
LOST_REPLY = "lost_reply:"
"""The prefix of a lost-reply point: ``lost_reply:submit`` loses the reply to ``submit``."""


@dataclass
class _Armed:
    mode: str
    times: int
    match: Callable[[Any], bool] | None
    error: BaseException | type[BaseException] | None


LOST_REPLIES: dict[str, list[_Armed]] = {}
"""Statement name -> the lost replies armed for it (KESTREL_FAILPOINTS and :func:`arm`).
Empty unless something is armed: :mod:`kestrel.db` tests it after every statement. Only
ever changed in place (db holds this very dict)."""

LOST_REPLIES_FIRED: dict[str, int] = {}
"""How many replies each statement lost in this process (for tests)."""


@functools.cache
def _statement_names() -> frozenset[str]:
    from kestrel.sql import named_statements

    return frozenset(named_statements())


def _parse_env(spec: str) -> dict[str, list[Any]]:
    points = _parse_failpoints(spec)
    for name in [n for n in points if n.startswith(LOST_REPLY)]:
        LOST_REPLIES.setdefault(name[len(LOST_REPLY):], []).append(
            _Armed("env", points.pop(name)[2], None, None))
    return points


_FAILPOINTS = _parse_env(os.environ.get("KESTREL_FAILPOINTS", ""))


class Halt(BaseException):
    """The worker dies at this point: an in-process stand-in for SIGKILL.

    A BaseException, so neither workflow code nor a writer's error isolation catches it: it
    ends the writer (or the task) it is raised in, so the worker's task group ends and
    :meth:`kestrel.worker.Worker.run` raises without draining or releasing its leases, which
    then expire as a killed process's would.
    """


_ARMED: dict[str, list[_Armed]] = {}


def arm(name: str, mode: str = "raise", *, times: int = 1,
        match: Callable[[Any], bool] | None = None,
        error: BaseException | type[BaseException] | None = None) -> None:
    """Make *name* fire *times* times in this process, when *match* (if given) accepts the
    subject the point is fired with.

    *mode* is ``raise`` (a lost connection), ``crash`` (a RuntimeError), ``error`` (raise
    *error*, e.g. the TimeoutError a step body would raise) or ``halt`` (:class:`Halt`).
    ``lost_reply:<statement>`` takes ``raise`` only: that statement commits, then its reply
    is lost (see :func:`lost_reply`); its subject is the statement's parameters.

    Raises:
        ValueError: an unknown point or mode, or ``error`` without an exception.
        TypeError: *error* is neither an exception nor an exception class.
    """
    if error is not None and not (isinstance(error, BaseException) or (
            isinstance(error, type) and issubclass(error, BaseException))):
        raise TypeError(f"failpoint error must be an exception, not {type(error).__name__}")
    if name.startswith(LOST_REPLY):
        statement = name[len(LOST_REPLY):]
        if statement not in _statement_names():
            raise ValueError(f"unknown statement {statement!r} in failpoint {name!r}")
        if mode != "raise" or error is not None or times < 1:
            raise ValueError(f"failpoint {name}: a lost reply takes mode raise and times >= 1")
        LOST_REPLIES.setdefault(statement, []).append(_Armed("raise", times, match, None))
        return
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
    for statement in list(LOST_REPLIES):
        kept = [a for a in LOST_REPLIES[statement] if a.mode == "env"]
        if kept:
            LOST_REPLIES[statement] = kept
        else:
            del LOST_REPLIES[statement]


def lost_reply(statement: str | None, params: Any) -> bool:
    """Whether the reply to *statement* (a name of ``sql/queries``), which has just
    committed with *params*, is to be lost now; counts the firing. The caller
    (:mod:`kestrel.db`) then closes the connection and raises."""
    for armed in LOST_REPLIES.get(statement or "", ()):
        if armed.times > 0 and (armed.match is None or armed.match(params)):
            armed.times -= 1
            LOST_REPLIES_FIRED[statement or ""] = LOST_REPLIES_FIRED.get(statement or "", 0) + 1
            log.warning("failpoint %s%s fired: committed, reply lost", LOST_REPLY, statement)
            return True
    return False


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

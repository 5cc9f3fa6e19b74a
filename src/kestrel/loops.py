"""The shape of a worker's services, and how the runtime's loops wait: exponential backoff
with full jitter for a retry, and a round every interval for a periodic service (the
sweeper, upkeep, registration).

Every service has one shape (:class:`Service`): a ``name``, ``run()`` for the life of the
process and ``run_once()``, one round, which ``run()`` repeats and tests call. Every service
that repeats uses :class:`Backoff` and :func:`every`, so a round the database refused is
reported the same way everywhere: an unreachable database through
:data:`kestrel.outage.OUTAGE` (one line per outage), contention (a lock or statement
timeout, a deadlock: :func:`kestrel.connections.is_contended`) as a warning, any other
database error as an error line naming the service.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from typing import Any, NoReturn, Protocol

import psycopg

from kestrel import connections
from kestrel.outage import OUTAGE

log = logging.getLogger("kestrel.worker")


class Service(Protocol):
    """A worker's service: the claimer, the heartbeat, the group commits (checkpoints,
    completions), the sweeper, partition upkeep, the scheduler, stats, the LISTEN connection,
    registration, the event loop's ticker.

    ``run()`` runs for the life of the process (the claimer's, until the worker stops):
    a service that returns or raises ends the worker (:class:`kestrel.worker.ServiceEnded`).
    ``run_once()`` is one round, what ``run()`` repeats: one sweep, one beat, one batch
    committed, one connection listened on; what a round takes and returns is the service's
    own (a group commit's round takes its batch).
    """

    name: str
    """The service's name in the worker's log lines and task names."""

    async def run(self) -> None:
        """Run for the life of the process."""

    def run_once(self, *args: Any, **kwargs: Any) -> Any:
        """One round of what :meth:`run` repeats (awaitable, but for the heartbeat's, which
        blocks on its thread, and the ticker's)."""


class Backoff:
    """Exponential backoff with full jitter, reset on success."""

    def __init__(self, base: float = 0.1, cap: float = 5.0) -> None:
        self.base, self.cap, self.failures = base, cap, 0

    def next_delay(self) -> float:
        """Count a failure; return the seconds to wait before the next try."""
        self.failures += 1
        return random.uniform(0, min(self.cap, self.base * 2 ** self.failures))

    def reset(self) -> None:
        """Forget the failures: the next delay starts from *base* again."""
        self.failures = 0


async def every(interval: Callable[[], float], round_: Callable[[], Any], what: str
                ) -> NoReturn:
    """Call *round_* forever, *interval()* seconds apart (the wait comes first); a round the
    database refused is reported (see the module) and the next one comes at its time."""
    while True:
        await asyncio.sleep(interval())
        try:
            await round_()
        except psycopg.Error as exc:
            if connections.is_transient(exc):
                OUTAGE.failed(exc, what)
            elif connections.is_contended(exc):
                # Other transactions held it up (a client holding a row, a Citus move
                # blocking writes): nothing is wrong, and the next round does the work.
                log.warning("%s round waited too long on other transactions (%s: %s); the "
                            "next round comes at its time", what, type(exc).__name__,
                            str(exc).strip()[:200])
            else:
                log.error("%s round failed (%s: %s)", what, type(exc).__name__,
                          str(exc).strip()[:200])
        else:
            OUTAGE.succeeded()

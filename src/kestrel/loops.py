"""How the runtime's loops wait: exponential backoff with full jitter for a retry, and a
round every interval for a periodic service (the sweeper, upkeep, registration).

Every service that repeats uses these two, so a round the database refused is reported the
same way everywhere: an unreachable database through :data:`kestrel.outage.OUTAGE` (one line
per outage), any other database error as one line naming the service.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from typing import Any, NoReturn

import psycopg

from kestrel import connections
from kestrel.outage import OUTAGE

log = logging.getLogger("kestrel.worker")


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
            else:
                log.error("%s round failed (%s: %s)", what, type(exc).__name__,
                          str(exc).strip()[:200])
        else:
            OUTAGE.succeeded()

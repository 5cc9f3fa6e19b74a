"""The outage log: one line when the database becomes unreachable, a reminder while it
stays so, one line when it is back.

Every service of a worker (claims, group commits, heartbeats, sweeps, LISTEN) retries a
connection-level failure on its own, with backoff. Logging each retry drowned an 18-second
outage in 169 warnings (issue 18) and never said when it ended. Instead each service reports
to the process's :data:`OUTAGE`:

* the first failure logs ``database unreachable (<reason>)``;
* while failures go on, a reminder every ``reminder_s`` (30 s) with the latest reason;
* the first success after that logs ``database reconnected after 12.3 s``.

A pool that gives no connection in time while no outage is under way is not an outage: the
connections are all busy (statements waiting on a lock a client holds, say) or a new one was
refused, while the database answers others, this process's heartbeat among them. That says
``no connection from the pool (<where>)`` instead, once and then every ``reminder_s``, and
``got connections from the pool again after 4.5 s`` when it ends (FAULTS R3); the lease
watchdog decides whether the process still makes progress.

After a restart of PostgreSQL the connections opened before it fail once each as they are
used (a pooled one, the heartbeat's own): such a failure within ``grace_s`` of a
reconnection is kept quiet unless failures go on for ``escalate_s``, so one restart is one
pair of lines, not one pair per stale connection.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kestrel.connections import is_pool_timeout

log = logging.getLogger("kestrel.outage")


def reason(exc: BaseException) -> str:
    """The first line of *exc* with its type, at most 200 characters: what an operator needs
    to tell a refused connection from a shutdown or a timeout."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return text if len(text) <= 200 else text[:199] + "…"


class OutageLog:
    """Tracks whether this process can reach the database, and says so in the log.

    Thread-safe: the heartbeat reports from its own thread. :meth:`succeeded` costs one
    attribute read while the database is reachable, so callers report every success.
    """

    def __init__(self, *, reminder_s: float = 30.0, grace_s: float = 15.0,
                 escalate_s: float = 2.0, clock: Callable[[], float] = time.monotonic,
                 logger: logging.Logger = log) -> None:
        self.reminder_s, self.grace_s, self.escalate_s = reminder_s, grace_s, escalate_s
        self._clock, self._log = clock, logger
        self._lock = threading.Lock()
        self._since: float | None = None  # when the current outage began
        self._quiet = False  # failing, but maybe only a stale connection after a reconnect
        self._said = 0.0  # when the last line about this outage was logged
        self._failures = 0
        self._back_at = float("-inf")  # when the last outage ended
        self._starved: float | None = None  # since when the pool gave no connection
        self._starved_said = 0.0

    @property
    def down(self) -> bool:
        """Whether the last report was a failure."""
        return self._since is not None

    def failed(self, exc: BaseException, where: str) -> None:
        """Report that *where* (``claim``, ``heartbeat``…) could not reach the database."""
        now = self._clock()
        with self._lock:
            if self._since is None and is_pool_timeout(exc):
                self._no_connection(exc, where, now)
                return
            self._failures += 1
            if self._since is None:
                self._since, self._failures = now, 1
                self._quiet = now - self._back_at < self.grace_s
                if not self._quiet:
                    self._begin(exc, where, now)
                return
            if self._quiet:
                if now - self._since >= self.escalate_s:
                    self._quiet = False
                    self._begin(exc, where, now)
                return
            if now - self._said >= self.reminder_s:
                self._said = now
                self._log.warning("database still unreachable after %.1f s (%d failed "
                                  "attempts; latest in %s: %s)", now - self._since,
                                  self._failures, where, reason(exc))

    def _no_connection(self, exc: BaseException, where: str, now: float) -> None:
        if self._starved is None:
            self._starved = self._starved_said = now
            self._log.warning("no connection from the pool (in %s, %s): its connections are "
                              "busy or a new one was refused", where, reason(exc))
        elif now - self._starved_said >= self.reminder_s:
            self._starved_said = now
            self._log.warning("still no connection from the pool after %.1f s (latest in %s)",
                              now - self._starved, where)

    def _begin(self, exc: BaseException, where: str, now: float) -> None:
        self._said = now
        self._log.warning("database unreachable (%s, in %s); work pauses and every service "
                          "retries with backoff", reason(exc), where)

    def succeeded(self, *, pooled: bool = True) -> None:
        """Report a statement that reached the database; ends the outage if there is one.
        *pooled*: it ran on a connection from the pool (the heartbeat's is its own), so the
        pool gives connections again."""
        if self._since is None:
            if self._starved is not None and pooled:
                self._fed()
            return
        now = self._clock()
        with self._lock:
            if self._since is None:
                return
            took, quiet = now - self._since, self._quiet
            self._since, self._back_at = None, now
        if quiet:
            self._log.debug("a connection opened before the reconnect failed once; "
                            "replaced after %.1f s", took)
        else:
            self._log.warning("database reconnected after %.1f s", took)

    def _fed(self) -> None:
        now = self._clock()
        with self._lock:
            if self._starved is None:
                return
            took, self._starved = now - self._starved, None
        self._log.warning("got connections from the pool again after %.1f s", took)


OUTAGE = OutageLog()
"""This process's outage log (each forked worker has its own)."""

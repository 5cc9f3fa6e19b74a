"""``kestrel-runtime --procs N``: fork N worker processes and keep them running.

The parent never creates an event loop, a pool or a metric before forking: each child builds
its own after fork, so no connection or loop state is shared across processes. The parent
only waits for children, restarts a dead one (see :class:`RestartPlanner`: the backoff belongs
to a crash-looping slot, never to the whole fleet), and on SIGTERM/SIGINT forwards the signal
and waits for the children to drain. Children get ``PR_SET_PDEATHSIG``: if the parent is
SIGKILLed they are told at once, stop claiming, release their leases and exit.

When it reaps a dead worker it releases that worker's leases at once (FAULTS O8): each child
gets an id of its own incarnation (``host:pid:nonce``), the lease owner of every row it
claims, and the supervisor re-queues the rows still owned by that id (quarantining those out
of attempts, as the sweeper would), so a crashed worker's executions run again within about
a second instead of after their lease.
"""

from __future__ import annotations

import logging
import math
import os
import random
import secrets
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from kestrel.config import Config, incarnation_id
from kestrel.definitions import WorkflowFn
from kestrel.errors import ConfigError
from kestrel.parentage import set_parent_death_signal

log = logging.getLogger("kestrel.supervisor")

RELEASE_CONNECT_TIMEOUT_S = 2
"""How long the supervisor waits for the database to release a dead worker's leases; past
that (the database is down) they expire as before and the sweeper recovers them."""


@dataclass(frozen=True)
class RestartPolicy:
    """How long a dead worker's slot waits before the supervisor forks a new child for it.

    A slot whose children die young, again and again, is crash looping: it waits
    ``base_s * 2**(failures - 1)`` (equal-ish jitter, at most ``cap_s``), so a poison
    execution that kills every worker that claims it costs at most one fork per backoff
    period. A child that lived ``healthy_after_s`` resets its slot. And however many slots are
    backing off, at least ``floor`` of them are running or restart within ``prompt_s`` of
    their child's death: a fleet whose children are being killed from outside (OOM killer, an
    operator, a chaos test) keeps working instead of every slot waiting out the cap at once.
    """

    base_s: float = 0.25
    cap_s: float = 10.0
    healthy_after_s: float = 10.0
    prompt_s: float = 1.0
    floor: int = 1

    @classmethod
    def for_procs(cls, procs: int) -> RestartPolicy:
        """The default policy for *procs* workers: half of them (rounded up) kept running."""
        return cls(floor=max(1, math.ceil(procs / 2)))

    def backoff(self, failures: int, jitter: float) -> float:
        """The wait after the *failures*-th quick death in a row; *jitter* in [0, 1]."""
        raw = min(self.cap_s, self.base_s * 2.0 ** max(0, failures - 1))
        return raw * (0.5 + 0.5 * jitter)


@dataclass(frozen=True)
class Restart:
    """One slot's restart, as decided when a child died (or when the floor pulled it in)."""

    slot: int
    delay: float
    """Seconds from the decision until the slot's new child is forked."""
    failures: int
    """Quick deaths of this slot in a row (0: the child had lived long enough)."""
    early: bool
    """The floor cut the slot's backoff short to keep enough workers running."""


@dataclass
class _SlotState:
    running: bool = False
    started: float = 0.0
    died: float = 0.0
    failures: int = 0
    restart_at: float = 0.0


class RestartPlanner:
    """The supervisor's restart decisions for *procs* slots, without processes or clocks:
    the caller says when a slot's child started and exited, and asks which slots are due."""

    def __init__(self, procs: int, policy: RestartPolicy | None = None, *,
                 jitter: Callable[[], float] = random.random) -> None:
        self.policy = policy or RestartPolicy.for_procs(procs)
        self._jitter = jitter
        self._slots = [_SlotState() for _ in range(procs)]

    def failures(self, slot: int) -> int:
        """How many times in a row *slot*'s child died before living ``healthy_after_s``."""
        return self._slots[slot].failures

    def restart_at(self, slot: int) -> float | None:
        """When *slot* is due, or None while its child runs."""
        state = self._slots[slot]
        return None if state.running else state.restart_at

    def started(self, slot: int, now: float) -> None:
        """Record that *slot*'s child started at *now*."""
        state = self._slots[slot]
        state.running, state.started = True, now

    def exited(self, slot: int, now: float) -> list[Restart]:
        """*slot*'s child died at *now*: schedule its restart. Returns that decision first,
        then any other slot whose backoff the floor cut short as a result."""
        p = self.policy
        state = self._slots[slot]
        lived = now - state.started
        state.running, state.died = False, now
        state.failures = 0 if lived >= p.healthy_after_s else state.failures + 1
        delay = p.backoff(state.failures, self._jitter()) if state.failures else 0.0
        state.restart_at = now + delay
        mine = Restart(slot, delay, state.failures, early=False)
        pulled = self._keep_floor(now)
        if slot in pulled:
            mine = Restart(slot, state.restart_at - now, state.failures, early=True)
        return [mine, *(Restart(i, self._slots[i].restart_at - now, self._slots[i].failures,
                                early=True) for i in pulled if i != slot)]

    def due(self, now: float) -> list[int]:
        """The dead slots whose restart time has come."""
        return [i for i, s in enumerate(self._slots) if not s.running and now >= s.restart_at]

    def _keep_floor(self, now: float) -> list[int]:
        """Pull the earliest-due waiting slots in until ``floor`` slots are running or due
        within ``prompt_s``; return the slots pulled in.

        Promptly means ``prompt_s`` from *now*, when the fleet fell short, not from the pulled
        slot's own death: a fleet where every child dies young forks about ``floor`` children
        per ``prompt_s`` plus their short lives, never one on the heels of the last."""
        p = self.policy
        soon = now + p.prompt_s

        def prompt(s: _SlotState) -> bool:
            return s.running or s.restart_at <= max(soon, s.died + p.prompt_s)

        short = p.floor - sum(1 for s in self._slots if prompt(s))
        waiting = sorted((i for i, s in enumerate(self._slots) if not prompt(s)),
                         key=lambda i: self._slots[i].restart_at)
        pulled = waiting[:max(0, short)]
        for i in pulled:
            self._slots[i].restart_at = soon
        return pulled


@dataclass
class _Slot:
    index: int
    schema: str = ""
    pid: int = 0
    started: float = 0.0
    worker_id: str = ""


class Supervisor:
    """Fork and watch *cfg.procs* workers running *workflows* against *dsn*.

    *schemas*: the schemas the workers serve, one each, in turn (slot *i* serves
    ``schemas[i % len(schemas)]``): a namespace's buckets, bucket 0 first (kestrel.buckets);
    by default *cfg.schema* alone. Only bucket 0's workers start cron ticks."""

    def __init__(self, cfg: Config, workflows: dict[str, WorkflowFn], *, dsn: str,
                 http: Callable[[], None] | None = None,
                 schemas: list[str] | None = None) -> None:
        self.cfg = cfg
        self.schemas = schemas or [cfg.schema]
        if len(self.schemas) > cfg.procs:
            raise ConfigError(
                f"invalid setting --procs={cfg.procs}: namespace {cfg.schema} has "
                f"{len(self.schemas)} buckets, and each needs a worker process of its own; "
                f"use --procs {len(self.schemas)} or more (a multiple spreads them evenly)")
        # The HTTP door (--http-port) runs in a child of its own, restarted if it dies; the
        # workers never share a process, a loop or a pool with it.
        self.http = http
        self.http_slot = _Slot(-1)
        self._http_due = 0.0
        self._http_failures = 0
        self.dsn = dsn
        self.workflows = workflows
        self.slots = [_Slot(i, self.schemas[i % len(self.schemas)]) for i in range(cfg.procs)]
        self.planner = RestartPlanner(cfg.procs)
        self.restarts = 0
        self._stopping = False
        self._signalled_children = False

    def _on_signal(self, signum: int, _frame: object) -> None:
        if not self._stopping:
            log.info("received %s: draining workers (up to %.0fs)",
                     signal.Signals(signum).name, self.cfg.drain_timeout)
        self._stopping = True

    def run(self) -> int:
        """Run until SIGTERM/SIGINT and every child has exited; return the exit code."""
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        log.info("supervisor %d starting %d worker processes", os.getpid(), self.cfg.procs)
        for slot in self.slots:
            self._spawn(slot)
        if self.http is not None:
            self._spawn(self.http_slot)
        deadline = 0.0
        while True:
            self._reap()
            now = time.monotonic()
            if self._stopping:
                if not self._signalled_children:
                    self._signalled_children = True
                    deadline = now + self.cfg.drain_timeout + 10.0
                    for slot in [*self.slots, self.http_slot]:
                        if slot.pid:
                            _kill(slot.pid, signal.SIGTERM)
                if not any(s.pid for s in [*self.slots, self.http_slot]):
                    log.info("all workers exited; supervisor done (%d restarts)", self.restarts)
                    return 0
                if now > deadline:
                    for slot in [*self.slots, self.http_slot]:
                        if slot.pid:
                            log.warning("worker %d did not drain in time; killing it", slot.pid)
                            _kill(slot.pid, signal.SIGKILL)
                    deadline = now + 5.0
            else:
                for index in self.planner.due(now):
                    self._spawn(self.slots[index])
                if self.http is not None and not self.http_slot.pid and now >= self._http_due:
                    self._spawn(self.http_slot)
            time.sleep(0.05)

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if self.http_slot.pid and pid == self.http_slot.pid:
                self._http_exited(pid, os.waitstatus_to_exitcode(status))
                continue
            slot = next((s for s in self.slots if s.pid == pid), None)
            if slot is None:
                continue
            slot.pid = 0
            from kestrel import metrics

            metrics.mark_dead(pid)
            code = os.waitstatus_to_exitcode(status)
            self._release(slot.worker_id, pid, slot.schema)
            if self._stopping:
                log.info("worker %d exited (%s)", pid, _describe(code))
                continue
            now = time.monotonic()
            lived = now - slot.started
            mine, *pulled = self.planner.exited(slot.index, now)
            self.restarts += 1
            metrics.get().worker_restarts.inc()
            log.warning("worker %d (slot %d) exited (%s) after %.1fs; restarting in %.2fs%s",
                        pid, slot.index, _describe(code), lived, mine.delay, _why(mine))
            for other in pulled:
                log.warning("slot %d cut its backoff short: back in %.2fs to keep at least %d "
                            "of %d workers running", other.slot, other.delay,
                            self.planner.policy.floor, len(self.slots))

    def _release(self, worker_id: str, pid: int, schema: str) -> None:
        """Re-queue the executions the dead worker *worker_id* still held (FAULTS O8).

        Runs before its slot is restarted. A worker that drained released its own; what it
        could not (it was killed, or its release failed) is recovered here. If the database
        cannot be reached within RELEASE_CONNECT_TIMEOUT_S, the leases expire as before.
        """
        if not worker_id:
            return
        import psycopg

        from kestrel import connections, db, metrics, statements
        from kestrel.sql import queries

        try:
            with connections.connect(self.dsn, link=True, prepare_threshold=None,
                                     application_name="kestrel-supervisor",
                                     connect_timeout=RELEASE_CONNECT_TIMEOUT_S) as conn:
                done = db.run_script_sync(conn, statements.sweeper.recover_dead_worker(
                    queries(schema), worker_id=worker_id,
                    max_attempts=self.cfg.max_attempts))
        except psycopg.Error as exc:
            log.warning("could not release the leases of worker %d (%s); they will be "
                        "recovered when they expire", pid, type(exc).__name__)
            return
        if done.requeued:
            metrics.get().leases_expired.inc(done.requeued)
        if done.quarantined:
            metrics.get().quarantined.inc(done.quarantined)
        if done.examined:
            log.warning("released the %d leases worker %d held: %d executions re-queued, "
                        "%d quarantined (out of max_attempts=%d)", done.examined, pid,
                        done.requeued, done.quarantined, self.cfg.max_attempts)

    def _http_exited(self, pid: int, code: int) -> None:
        from kestrel import metrics

        self.http_slot.pid = 0
        metrics.mark_dead(pid)
        if self._stopping:
            log.info("HTTP server %d exited (%s)", pid, _describe(code))
            return
        # 1 s, doubling while it dies young (its port taken, say), at most 30 s.
        now = time.monotonic()
        self._http_failures = 0 if now - self.http_slot.started >= 10.0 else (
            self._http_failures + 1)
        delay = min(30.0, 2.0 ** self._http_failures)
        self._http_due = now + delay
        log.warning("HTTP server %d exited (%s); restarting in %.0fs", pid, _describe(code),
                    delay)

    def _spawn(self, slot: _Slot) -> None:
        parent = os.getpid()
        nonce = secrets.token_hex(4)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                set_parent_death_signal(parent)
                if slot.index < 0 and self.http is not None:
                    self.http()
                    os._exit(0)
                from kestrel.worker import run_worker

                # One process of each schema reads its queue depth, waits and finishes for
                # the metrics (the first of each bucket's, in a namespace); not all of them.
                cfg = replace(self.cfg, schema=slot.schema,
                              worker_id=incarnation_id(os.getpid(), nonce))
                run_worker(cfg, self.workflows, dsn=self.dsn,
                           collect_queue_stats=slot.index < len(self.schemas),
                           cron=slot.schema == self.schemas[0], namespace=self.schemas)
                code = 0
            except BaseException:
                log.exception("worker crashed")
            finally:
                logging.shutdown()
                os._exit(code)
        slot.pid = pid
        slot.worker_id = incarnation_id(pid, nonce)
        slot.started = time.monotonic()
        if slot.index < 0:
            log.info("started HTTP server %d", pid)
            return
        self.planner.started(slot.index, slot.started)
        log.info("started worker %d (slot %d%s)", pid, slot.index,
                 f", schema {slot.schema}" if len(self.schemas) > 1 else "")


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _why(r: Restart) -> str:
    if not r.failures:
        return " (it had run long enough: backoff reset)"
    if r.early:
        return f" (quick death {r.failures} in a row; restarted early to keep workers running)"
    return f" (quick death {r.failures} in a row)"


def _describe(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"

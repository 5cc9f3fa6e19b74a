"""``kestrel-runtime --procs N``: fork N worker processes and keep them running.

The parent never creates an event loop, a pool or a metric before forking: each child builds
its own after fork, so no connection or loop state is shared across processes. The parent
only waits for children, restarts a dead one with exponential backoff (a crash loop costs at
most one fork per backoff period), and on SIGTERM/SIGINT forwards the signal and waits for the
children to drain. Children get ``PR_SET_PDEATHSIG``: if the parent is SIGKILLed they are told
at once, stop claiming, release their leases and exit.
"""

from __future__ import annotations

import ctypes
import logging
import os
import random
import signal
import sys
import time
from dataclasses import dataclass

from kestrel.config import Config
from kestrel.workflow import WorkflowFn

log = logging.getLogger("kestrel.supervisor")

PR_SET_PDEATHSIG = 1
HEALTHY_AFTER_S = 10.0
"""A child that lived this long resets its slot's backoff."""


@dataclass
class _Slot:
    index: int
    pid: int = 0
    started: float = 0.0
    failures: int = 0
    restart_at: float = 0.0


def _set_parent_death_signal(expected_parent: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGUSR1)
    except (OSError, AttributeError):  # not Linux: the ppid check below still runs once
        pass
    if os.getppid() != expected_parent:  # the parent died before prctl took effect
        os._exit(0)


class Supervisor:
    """Fork and watch *cfg.procs* workers running *workflows* against *dsn*."""

    def __init__(self, cfg: Config, workflows: dict[str, WorkflowFn], *, dsn: str) -> None:
        self.cfg = cfg
        self.dsn = dsn
        self.workflows = workflows
        self.slots = [_Slot(i) for i in range(cfg.procs)]
        self.restarts = 0
        self._stopping = False
        self._signalled_children = False

    def _on_signal(self, signum: int, _frame: object) -> None:
        if not self._stopping:
            log.info("received %s: draining workers (up to %.0fs)",
                     signal.Signals(signum).name, self.cfg.drain_timeout)
        self._stopping = True

    def ready(self) -> tuple[bool, str]:
        """/readyz: the database answers and the schema is at this code's version."""
        import psycopg

        from kestrel.migrate import current_version
        from kestrel.sql import migrations

        try:
            with psycopg.connect(self.dsn, autocommit=True, connect_timeout=3) as conn:
                have = current_version(conn, self.cfg.schema)
        except psycopg.Error as exc:
            return False, f"database unreachable: {type(exc).__name__}"
        want = len(migrations(self.cfg.schema))
        if have != want:
            return False, f"schema {self.cfg.schema} is at migration {have}, code needs {want}"
        return True, f"schema {self.cfg.schema} at migration {have}"

    def run(self) -> int:
        """Run until SIGTERM/SIGINT and every child has exited; return the exit code."""
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        if self.cfg.metrics_port:
            from kestrel import metrics

            self._http = metrics.serve(self.cfg.metrics_host, self.cfg.metrics_port,
                                       ready=self.ready,
                                       certfile=self.cfg.metrics_certfile or None,
                                       keyfile=self.cfg.metrics_keyfile or None)
            log.info("serving /metrics, /healthz and /readyz on %s://%s:%d",
                     "https" if self.cfg.metrics_certfile else "http",
                     self.cfg.metrics_host, self.cfg.metrics_port)
        log.info("supervisor %d starting %d worker processes", os.getpid(), self.cfg.procs)
        for slot in self.slots:
            self._spawn(slot)
        deadline = 0.0
        while True:
            self._reap()
            now = time.monotonic()
            if self._stopping:
                if not self._signalled_children:
                    self._signalled_children = True
                    deadline = now + self.cfg.drain_timeout + 10.0
                    for slot in self.slots:
                        if slot.pid:
                            _kill(slot.pid, signal.SIGTERM)
                if not any(s.pid for s in self.slots):
                    log.info("all workers exited; supervisor done (%d restarts)", self.restarts)
                    return 0
                if now > deadline:
                    for slot in self.slots:
                        if slot.pid:
                            log.warning("worker %d did not drain in time; killing it", slot.pid)
                            _kill(slot.pid, signal.SIGKILL)
                    deadline = now + 5.0
            else:
                for slot in self.slots:
                    if not slot.pid and now >= slot.restart_at:
                        self._spawn(slot)
            time.sleep(0.05)

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            slot = next((s for s in self.slots if s.pid == pid), None)
            if slot is None:
                continue
            slot.pid = 0
            from kestrel import metrics

            metrics.mark_dead(pid)
            code = os.waitstatus_to_exitcode(status)
            if self._stopping:
                log.info("worker %d exited (%s)", pid, _describe(code))
                continue
            lived = time.monotonic() - slot.started
            slot.failures = 0 if lived > HEALTHY_AFTER_S else slot.failures + 1
            delay = min(30.0, 0.25 * 2 ** slot.failures) * random.uniform(0.5, 1.0)
            slot.restart_at = time.monotonic() + delay
            self.restarts += 1
            metrics.get().worker_restarts.inc()
            log.warning("worker %d exited (%s) after %.1fs; restarting in %.2fs",
                        pid, _describe(code), lived, delay)

    def _spawn(self, slot: _Slot) -> None:
        parent = os.getpid()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                _set_parent_death_signal(parent)
                from kestrel.worker import run_worker

                # One process reads fleet-wide queue depth for the metrics; not all of them.
                run_worker(self.cfg, self.workflows, dsn=self.dsn,
                           collect_queue_stats=slot.index == 0)
                code = 0
            except BaseException:
                log.exception("worker crashed")
            finally:
                logging.shutdown()
                os._exit(code)
        slot.pid = pid
        slot.started = time.monotonic()
        log.info("started worker %d (slot %d)", pid, slot.index)


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _describe(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"

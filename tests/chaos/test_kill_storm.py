"""A kill storm against the real supervisor: worker children SIGKILLed every 0.5-1 s for
long enough that a per-slot backoff which only resets after a long life climbs to its cap in
every slot at once (issue 14, bug 20: 2,818 of 3,000 done at 30 s, still 2,818 at 150 s).

The supervisor must back off a crash-looping slot, not the fleet: some worker is always
back within about a second of the last one dying, and work goes on during and right after
the storm. No timing of performance here: the bounds are on "is anybody running at all".
"""

from __future__ import annotations

import random
import signal
import threading
import time

import psutil

from tests.helpers import finished_count, kill, runtime, submit_many, wait_until

STORM_S = 25.0
"""Long enough for a slot that never lives 10 s to reach a 30 s backoff (0.5+1+2+4+8+16 s)."""
NO_WORKER_BOUND_S = 3.0
"""The longest the fleet may sit with no live worker: one prompt restart (at most 1 s), the
supervisor's tick and fork, with slack for a shared two-core machine."""


def live_children(pid: int) -> list[int]:
    """The supervisor's children that are alive (not zombies waiting to be reaped)."""
    try:
        children = psutil.Process(pid).children()
    except psutil.NoSuchProcess:
        return []
    live = []
    for child in children:
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                live.append(child.pid)
        except psutil.NoSuchProcess:
            pass
    return live


class NoWorkerWatch(threading.Thread):
    """Samples the supervisor's live children; records the longest stretch with none."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.longest = 0.0
        self._done = threading.Event()

    def run(self) -> None:
        empty_since: float | None = None
        while not self._done.is_set():
            now = time.monotonic()
            if live_children(self.pid):
                empty_since = None
            else:
                empty_since = now if empty_since is None else empty_since
                self.longest = max(self.longest, now - empty_since)
            time.sleep(0.05)

    def stop(self) -> float:
        self._done.set()
        self.join()
        return self.longest


def test_a_kill_storm_backs_off_slots_not_the_fleet(pg_dsn: str, schema: str) -> None:
    # Enough work that it cannot run out before the storm ends (8 at a time per process,
    # each at least 0.2 s); kills count as attempts, so quarantine must not end any of it.
    n = 3000
    submit_many(pg_dsn, schema, "slow_middle", "jsonb_build_array(i, 0.2)", n)
    rng = random.Random(20)
    with runtime(pg_dsn, schema, procs=2,
                 args=["--concurrency", "8", "--max-attempts", "1000"]) as proc:
        wait_until(lambda: len(live_children(proc.pid)) == 2, timeout=20, what="two workers")
        wait_until(lambda: finished_count(pg_dsn, schema) >= 20, timeout=30,
                   what="work before the storm")
        watch = NoWorkerWatch(proc.pid)
        watch.start()
        start = time.monotonic()
        kills = 0
        marks = [finished_count(pg_dsn, schema)]  # at the start and each third of the storm
        while (elapsed := time.monotonic() - start) < STORM_S:
            if len(marks) < 1 + int(3 * elapsed / STORM_S):
                marks.append(finished_count(pg_dsn, schema))
            children = live_children(proc.pid)
            if children:
                kill(rng.choice(children), signal.SIGKILL)
                kills += 1
            time.sleep(rng.uniform(0.5, 1.0))
        marks.append(finished_count(pg_dsn, schema))
        # Right after the storm: work goes on within a bounded window.
        try:
            wait_until(lambda: finished_count(pg_dsn, schema) >= marks[-1] + 50, timeout=10,
                       what="work right after the storm")
            resumed = True
        except AssertionError:
            resumed = False
        after = finished_count(pg_dsn, schema)
        longest = watch.stop()
    report = (f"{kills} kills in {STORM_S:.0f}s; finished at the start and each third of the "
              f"storm {marks}, {after} 10s after it; longest stretch with no live worker "
              f"{longest:.1f}s")
    assert longest <= NO_WORKER_BOUND_S, report
    assert marks[-1] > marks[-2], report  # work completed in the storm's last third
    assert resumed, report

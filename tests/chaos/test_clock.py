"""D14: the worker host's wall clock is skewed, then jumps back and forward an hour. A
preloaded shim (fakeclock.c, libfaketime's mechanism; see there why not libfaketime itself)
shifts CLOCK_REALTIME in the real supervisor and workers and leaves the monotonic clock
alone, as an NTP step does. Every decision the runtime takes uses the database clock or the
monotonic clock: no lease is judged expired early, no timer fires early, and no row carries
the worker's wall-clock time.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from kestrel.client import SyncClient
from tests.apps import ledger_app as app
from tests.helpers import q, q1, runtime, wait_until


def fake_clock(folder: Path) -> str:
    """Build the shim (gcc: .ci/run installs it) and return the library's path."""
    gcc = shutil.which("gcc")
    assert gcc, "gcc is missing: .ci/run installs it"
    lib = folder / "fakeclock.so"
    subprocess.run([gcc, "-shared", "-fPIC", "-O2", "-o", str(lib),
                    str(Path(__file__).with_name("fakeclock.c")), "-ldl"], check=True)
    return str(lib)


def test_d14_clock_skew_and_jumps_on_the_worker_host_change_no_decision(
    pg_dsn: str, schema: str, ledger_path: Path, tmp_path: Path
) -> None:
    clock = tmp_path / "offset"
    clock.write_text("600")  # the worker host runs ten minutes ahead
    env = {"LD_PRELOAD": fake_clock(tmp_path), "KESTREL_FAKE_CLOCK_FILE": str(clock)}
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    # Steps of 3 s under a 2 s lease: only heartbeats keep them; a lease judged by the
    # worker's wall clock would expire (or never) with each jump.
    slow = [client.submit(app.slow_middle, n, 3.0) for n in range(3)]
    # Durable sleeps of 8 s: a timer judged by the worker's wall clock would fire at once
    # (ten minutes ahead) or an hour late (after the jump back).
    sleepers = [client.submit(app.sleeper, n, 8.0) for n in range(10, 13)]
    stamped = client.submit(app.deterministic)
    with runtime(pg_dsn, schema, procs=2, env=env, log=tmp_path / "rt.log"):
        first = wait_until(lambda: app.read_ledger(ledger_path, kind="start"), timeout=30,
                           what="a slow step to start")[0]
        assert 500 < first["t"] - time.time() < 700  # the skew reached the workers
        clock.write_text("-3000")  # jump back an hour
        wait_until(lambda: len(app.read_ledger(ledger_path, kind="body", name="slow_add")) == 3,
                   timeout=30, what="the slow steps to finish after the jump back")
        clock.write_text("4200")  # and forward two hours
        for h in sleepers:
            assert h.result(timeout=60) == app.model_step(h_n(client, h.id), 0) + \
                app.model_step(h_n(client, h.id), 1)
        for n, h in enumerate(slow):
            assert h.result(timeout=30) == app.model(n)
        stamped.result(timeout=30)
    bodies = app.read_ledger(ledger_path, kind="body")
    assert any(e["t"] < time.time() - 2900 for e in bodies)  # the jump back happened
    assert any(e["t"] > time.time() + 4000 for e in bodies)  # and the jump forward
    for h in slow:  # no lease expired early: one claim, one run of the slow body
        assert client.get(h.id).attempts == 1
        assert len(app.read_ledger(ledger_path, kind="start", execution_id=str(h.id))) == 1
    for h in sleepers:  # no timer fired early, by the database clock
        slept = q1(pg_dsn, schema, "SELECT extract(epoch FROM b.started_at - a.finished_at) "
                   "FROM {s}.step_history a, {s}.step_history b WHERE a.execution_id = %s "
                   "AND b.execution_id = a.execution_id AND a.step_id = 0 AND b.step_id = 2",
                   [h.id])
        assert slept >= 8.0
    # No row holds the worker's wall-clock time: every recorded instant is within a few
    # seconds of the database's own clock, not ten minutes or an hour away.
    worst = q1(pg_dsn, schema, "SELECT max(greatest(abs(extract(epoch FROM now() - "
               "started_at)), abs(extract(epoch FROM now() - finished_at)))) "
               "FROM {s}.step_history")
    assert worst < 120
    recorded_now = datetime.fromisoformat(stamped.result(timeout=1)[0])
    db_now = q(pg_dsn, schema, "SELECT now()")[0][0]
    assert abs((db_now - recorded_now).total_seconds()) < 120  # ctx.now() is database time


def h_n(client: SyncClient, execution_id: Any) -> int:
    return int(client.get(execution_id).args[0])

"""How many executions a real worker process runs at once (kestrel.slots): by default a
limit that climbs while more in flight gets more done; with --concurrency N, exactly N."""

from __future__ import annotations

import time
import urllib.error
from pathlib import Path

from tests.helpers import metric, q1, runtime, submit_many, wait_until
from tests.http_helpers import free_port


def running(dsn: str, schema: str) -> int:
    return int(q1(dsn, schema,
                  "SELECT count(*) FROM {s}.workflow_executions WHERE status = 'running'"))


def limit(port: int) -> float:
    """The process's concurrency limit; 0 while its metrics endpoint is not up yet."""
    try:
        return metric(port, "kestrel_concurrency_limit_executions")
    except urllib.error.URLError:
        return 0.0


def test_the_default_limit_climbs_while_more_in_flight_gets_more_done(
    pg_dsn: str, schema: str, tmp_path: Path
) -> None:
    # Each workflow waits a second in a step (an API call): the work done per second is the
    # executions in flight, so a doubling from the start (256) pays, and the limit climbs.
    submit_many(pg_dsn, schema, "slow_middle", "jsonb_build_array(i, 1.0)", 8000)
    port = free_port()
    with runtime(pg_dsn, schema, procs=1, args=["--metrics-port", str(port)],
                 log=tmp_path / "rt.log"):
        wait_until(lambda: limit(port) >= 512, timeout=60,
                   what="the adaptive limit to reach 512")
        wait_until(lambda: running(pg_dsn, schema) > 300, timeout=10,
                   what="more than the start's 256 executions to run at once")


def test_a_fixed_concurrency_is_never_exceeded(pg_dsn: str, schema: str,
                                               tmp_path: Path) -> None:
    submit_many(pg_dsn, schema, "slow_middle", "jsonb_build_array(i, 1.0)", 2000)
    port = free_port()
    with runtime(pg_dsn, schema, procs=1,
                 args=["--metrics-port", str(port), "--concurrency", "100"],
                 log=tmp_path / "rt.log"):
        wait_until(lambda: running(pg_dsn, schema) == 100, timeout=20,
                   what="the process to fill its 100 slots")
        seen = []
        for _ in range(20):  # about 4 s, past the first probe an adaptive limit would make
            seen.append(running(pg_dsn, schema))
            time.sleep(0.2)
        assert max(seen) == 100, seen
        assert metric(port, "kestrel_concurrency_limit_executions") == 100

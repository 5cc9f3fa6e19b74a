"""An outage of PostgreSQL in the runtime's log: one line when it begins (with the reason),
one when it ends, and none of psycopg_pool's per-attempt warnings (issue 18: an 18-second
outage printed 169 warnings and never said it was over). A real server is stopped and
started under a real runtime."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from kestrel.migrate import migrate
from tests.helpers import finished_count, runtime, submit_many, wait_until
from tests.pgcluster import Cluster


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    c = Cluster("outage")
    c.start()
    yield c
    c.destroy()


def _records(log: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]


def _count(log: Path, start: str) -> int:
    return sum(1 for r in _records(log) if str(r["msg"]).startswith(start))


def test_an_outage_logs_one_line_when_it_begins_and_one_when_it_ends(
        cluster: Cluster, tmp_path: Path) -> None:
    dsn, schema = cluster.dsn, "outage"
    migrate(dsn, schema)
    submit_many(dsn, schema, "three_steps", "jsonb_build_array(i)", 20)
    log = tmp_path / "rt.log"
    with runtime(dsn, schema, procs=1, log=log, args=["--log-format", "json"]):
        wait_until(lambda: finished_count(dsn, schema) == 20, timeout=60, what="first batch")
        cluster.stop("fast")
        wait_until(lambda: _count(log, "database unreachable (") >= 1, timeout=60,
                   what="the line that says the outage began")
        # Every service keeps failing for a while (heartbeats every 0.5 s, claims, LISTEN,
        # sweeps): none of it may reach the log.
        time.sleep(5)
        cluster.start()

        def done() -> bool:
            try:
                return finished_count(dsn, schema) == 40
            except psycopg.OperationalError:
                return False

        submit_many(dsn, schema, "three_steps", "jsonb_build_array(i)", 20)
        wait_until(done, timeout=120, interval=0.5, what="work after the outage")
        wait_until(lambda: _count(log, "database reconnected after ") >= 1, timeout=30,
                   what="the line that says it is over")
    records = _records(log)
    begun = [r for r in records if str(r["msg"]).startswith("database unreachable (")]
    assert len(begun) == 1, begun
    # The reason is PostgreSQL's or libpq's own: a shutdown, or a refused connection.
    assert any(word in str(begun[0]["msg"]) for word in
               ("terminating connection", "refused", "shutting down", "closed", "shutdown"))
    assert _count(log, "database reconnected after ") == 1
    # Well under 30 s down: no reminder is due; the pool's warnings stay silent.
    assert _count(log, "database still unreachable") <= 1
    assert not [r for r in records if str(r["logger"]).startswith("psycopg")]
    noise = [r for r in records if r["level"] in ("warning", "error")
             and not str(r["msg"]).startswith(("database unreachable", "database reconnected",
                                               "database still unreachable"))]
    assert len(noise) <= 2, noise  # e.g. a lease lost to the sweeper; not one per retry

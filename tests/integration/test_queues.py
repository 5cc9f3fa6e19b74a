"""Queues: global concurrency and rate limits under contention, priorities, dedup, delayed
start, and cron schedules run by several processes."""

from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
import pytest
from psycopg import sql as pgsql

import kestrel
from kestrel.client import SyncClient
from kestrel.config import Config
from kestrel.errors import ConfigError
from kestrel.schedule import Cron
from tests.apps import ledger_app as app
from tests.helpers import (
    config,
    finished_count,
    q,
    q1,
    run_worker_until,
    runtime,
    submit_many,
    wait_until,
)

QUEUES = ["--queues", "default,ai-model,rate-limited,per-proc"]


def test_global_concurrency_limit_holds_across_processes(
    pg_dsn: str, schema: str, tmp_path: Path
) -> None:
    q(pg_dsn, schema, "SELECT {s}.submit('busy', '[0.3]', 'ai-model') "
      "FROM generate_series(1, 40)")
    samples, stop, sampler = _peak_running(pg_dsn, schema, "ai-model")
    try:
        with runtime(pg_dsn, schema, procs=4, args=QUEUES, log=tmp_path / "rt.log"):
            wait_until(lambda: finished_count(pg_dsn, schema) == 40, timeout=60,
                       what="40 limited executions")
    finally:
        stop.set()
        sampler.join()
    assert max(samples) == 3, max(samples)  # reached, never exceeded
    assert len(samples) > 100


def test_rate_limit_holds_over_every_window(pg_dsn: str, schema: str, tmp_path: Path) -> None:
    q(pg_dsn, schema, "SELECT {s}.submit('quick', jsonb_build_array(i), 'rate-limited') "
      "FROM generate_series(1, 15) AS i")
    with runtime(pg_dsn, schema, procs=3, args=QUEUES, log=tmp_path / "rt.log"):
        wait_until(lambda: finished_count(pg_dsn, schema) == 15, timeout=60,
                   what="15 rate-limited executions")
    starts = [r[0] for r in q(pg_dsn, schema, "SELECT started_at FROM {s}.workflow_history "
                                              "ORDER BY started_at")]
    for i, first in enumerate(starts):
        in_window = [t for t in starts[i:] if t < first + timedelta(seconds=2)]
        assert len(in_window) <= 5, (first, in_window)
    assert starts[-1] - starts[0] >= timedelta(seconds=4)  # 15 at 5 per 2 s: 3 windows


def test_per_process_limit(pg_dsn: str, schema: str) -> None:
    q(pg_dsn, schema, "SELECT {s}.submit('busy', '[0.2]', 'per-proc') FROM generate_series(1, 4)")
    peak = 0

    def done() -> bool:
        nonlocal peak
        peak = max(peak, q1(pg_dsn, schema, "SELECT count(*) FROM {s}.workflow_executions "
                            "WHERE status = 'running'"))
        return finished_count(pg_dsn, schema) == 4

    run_worker_until(pg_dsn, config(schema, queues=("per-proc",)), done)
    assert peak == 1


def test_unlimited_queues_never_touch_the_limits_table(pg_dsn: str, schema: str) -> None:
    submit_many(pg_dsn, schema, "quick", "jsonb_build_array(i)", 50)
    run_worker_until(pg_dsn, config(schema), lambda: finished_count(pg_dsn, schema) == 50)
    assert q1(pg_dsn, schema, "SELECT count(*) FROM {s}.queue_limits") == 0


def test_priorities_order_claims(pg_dsn: str, schema: str) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    low = [client.submit(app.quick, n, priority=0).id for n in range(10)]
    high = [client.submit(app.quick, n, priority=10).id for n in range(5)]
    run_worker_until(pg_dsn, config(schema, concurrency=1, batch_size=1),
                     lambda: finished_count(pg_dsn, schema) == 15)
    order = [r[0] for r in q(pg_dsn, schema, "SELECT id FROM {s}.workflow_history "
                                             "ORDER BY started_at")]
    assert set(order[:5]) == set(high)
    assert order[5:] == low  # equal priority: oldest first here (not promised under load)


def test_dedup_key_holds_under_concurrent_submits(pg_dsn: str, schema: str) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    with ThreadPoolExecutor(max_workers=16) as pool:
        ids = list(pool.map(lambda n: client.submit(app.quick, n, dedup_key="incident-7").id,
                            range(50)))
    assert len(set(ids)) == 1
    assert q1(pg_dsn, schema, "SELECT count(*) FROM {s}.workflow_executions") == 1
    with pytest.raises(kestrel.DuplicateExecution):
        client.submit(app.quick, 99, dedup_key="incident-7", on_duplicate="reject")
    other_queue = client.submit(app.quick, 1, dedup_key="incident-7", queue="ai-model")
    assert other_queue.id != ids[0]  # the key is per queue
    run_worker_until(pg_dsn, config(schema), lambda: finished_count(pg_dsn, schema) == 1)
    again = client.submit(app.quick, 2, dedup_key="incident-7")  # finished: key is free
    assert again.id != ids[0]


def test_delayed_start(pg_dsn: str, schema: str) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    late = client.submit(app.quick, 1, delay=1.5)
    at = client.submit(app.quick, 2, start_at=datetime.now(UTC) + timedelta(seconds=1.5))
    now = client.submit(app.quick, 3)
    run_worker_until(pg_dsn, config(schema), lambda: finished_count(pg_dsn, schema) == 3)
    for h in (late, at):
        ex = client.get(h.id)
        assert ex.started_at is not None
        assert ex.started_at - ex.created_at >= timedelta(seconds=1.4)
    quick = client.get(now.id)
    assert quick.started_at is not None
    assert quick.started_at - quick.created_at < timedelta(seconds=1.4)


def test_cron_by_four_processes_starts_each_tick_exactly_once(
    pg_dsn: str, schema: str, tmp_path: Path
) -> None:
    with runtime(pg_dsn, schema, procs=4, log=tmp_path / "rt.log",
                 app="tests.apps.ledger_app,tests.apps.cron_app"):
        time.sleep(6)
    ticks = [r[0] for r in q(pg_dsn, schema, "SELECT args->>0 FROM {s}.executions "
                                             "WHERE workflow = 'tick' ORDER BY 1")]
    assert len(ticks) >= 4
    assert len(ticks) == len(set(ticks))  # never twice
    times = [datetime.fromisoformat(t) for t in ticks]
    gaps = {(b - a).total_seconds() for a, b in itertools.pairwise(times)}
    assert gaps == {1.0}  # none skipped (the schedule catches up if a round runs late)


def test_cron_expressions() -> None:
    t = datetime(2026, 11, 28, 10, 0, 30, tzinfo=UTC)  # a Saturday
    assert Cron.parse("*/5 * * * *").next_after(t) == datetime(2026, 11, 28, 10, 5, tzinfo=UTC)
    assert Cron.parse("0 9 * * 1-5").next_after(t) == datetime(2026, 11, 30, 9, tzinfo=UTC)
    assert Cron.parse("0 0 29 2 *").next_after(t) == datetime(2028, 2, 29, tzinfo=UTC)
    assert Cron.parse("30 * * * * *").next_after(t) == datetime(2026, 11, 28, 10, 1, 30,
                                                                 tzinfo=UTC)
    for bad in ("* * *", "61 * * * *", "* * * * 8", "a * * * *"):
        with pytest.raises(ConfigError):
            Cron.parse(bad)


def test_unknown_queue_and_bad_limits_stop_startup() -> None:
    with pytest.raises(ConfigError, match="unknown queue"):
        Config(queues=("nope",)).check_queues()
    Config(queues=("ai-model", "default")).check_queues()
    Config(queues=("x",), queue_limits="x:concurrency=2").check_queues()
    with pytest.raises(ConfigError, match="--queue-limits"):
        Config(queue_limits="x:concurrency=two")


def _peak_running(pg_dsn: str, schema: str, queue: str) -> tuple[list[int], threading.Event,
                                                                    threading.Thread]:
    """A sampler of how many executions of *queue* run, every 10 ms until its event is set."""
    samples: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        stmt = pgsql.SQL("SELECT count(*) FROM {}.workflow_executions WHERE queue = %s "
                         "AND status = 'running'").format(pgsql.Identifier(schema))
        with psycopg.connect(pg_dsn, autocommit=True, prepare_threshold=None) as conn:
            while not stop.is_set():
                samples.append(conn.execute(stmt, (queue,)).fetchone()[0])  # type: ignore[index]
                time.sleep(0.01)

    sampler = threading.Thread(target=sample)
    sampler.start()
    return samples, stop, sampler


def test_a_limit_declared_mid_run_holds_for_a_process_that_does_not_declare_it(
        pg_dsn: str, schema: str, tmp_path: Path) -> None:
    """FAULTS C4, limits declared during the run (issue 38 row 7's family): a process whose
    configuration has no limit on `deploys` (a rolling deploy that dropped it, another
    service serving the queue) claimed it unlimited while another process's declaration of
    one at a time stood in queue_limits: 8 ran at once. Now the limit in the database binds
    every claim from the moment its row commits: the first process, which started before it
    and does not look at the limits again for 20 s, claims none of the queue's rows
    meanwhile, and the declaring one runs them one at a time."""
    unlimited = ["--queues", "default,deploys", "--queue-limits", "deploys",
                 "--heartbeat", "20", "--lease", "60"]
    limited = ["--queues", "default,deploys", "--queue-limits", "deploys:concurrency=1"]
    samples, stop, sampler = _peak_running(pg_dsn, schema, "deploys")
    try:
        with runtime(pg_dsn, schema, procs=1, args=unlimited, log=tmp_path / "free.log"):
            # The unlimited process has made its first claim (and its look at the limits).
            client = SyncClient(pg_dsn, schema=schema, pool_size=0)
            client.result(client.submit(app.quick, 0).id, timeout=60)
            with runtime(pg_dsn, schema, procs=1, args=limited, log=tmp_path / "one.log"):
                wait_until(lambda: q1(pg_dsn, schema, "SELECT count(*) FROM {s}.queue_limits "
                                      "WHERE queue = 'deploys'") == 1, timeout=60,
                           what="the declared limit")
                q(pg_dsn, schema, "SELECT {s}.submit('busy', '[0.3]', 'deploys') "
                  "FROM generate_series(1, 8)")
                wait_until(lambda: finished_count(pg_dsn, schema) == 9, timeout=60,
                           what="8 executions of deploys")
    finally:
        stop.set()
        sampler.join()
    assert max(samples) == 1, max(samples)  # reached, never exceeded


def test_removed_limits_free_the_queue_for_every_worker(
        pg_dsn: str, schema: str, tmp_path: Path) -> None:
    """FAULTS C4, limits removed during the run: `kestrel-runtime remove-limits` takes the
    queue's row away, and the workers, which held it one at a time, claim it unlimited from
    their next look at the limits. Before, nothing removed a limit, and a worker that
    declared one and met no row would never claim the queue again."""
    from kestrel.cli import main

    args = ["--queues", "default,deploys", "--queue-limits", "deploys:concurrency=1",
            "--concurrency", "8", "--heartbeat", "1", "--lease", "6"]
    q(pg_dsn, schema, "SELECT {s}.submit('busy', '[1.0]', 'deploys') FROM generate_series(1, 12)")
    samples, stop, sampler = _peak_running(pg_dsn, schema, "deploys")
    try:
        with runtime(pg_dsn, schema, procs=1, args=args, log=tmp_path / "rt.log"):
            wait_until(lambda: finished_count(pg_dsn, schema) >= 1, timeout=60,
                       what="a first execution under the limit")
            assert max(samples) == 1
            assert main(["remove-limits", "deploys", "--dsn", pg_dsn, "--schema", schema,
                         "--log-level", "error"]) == 0
            assert q1(pg_dsn, schema, "SELECT count(*) FROM {s}.queue_limits") == 0
            wait_until(lambda: finished_count(pg_dsn, schema) == 12, timeout=60,
                       what="the rest, unlimited")
    finally:
        stop.set()
        sampler.join()
    assert max(samples) > 1, max(samples)

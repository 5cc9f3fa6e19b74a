"""kestrel_waiting_executions: waiting executions by workflow and what they wait for (the
Grafana "waiting for approval" panel), with the label sets one process exports capped, so
signal names built at run time cannot grow the series without bound (FAULTS S2)."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from kestrel import connections, metrics
from kestrel.services import MAX_WAITING_SERIES, Stats
from kestrel.sql import queries
from tests.apps import kit_app  # noqa: F401  (registers kit.wait_named)
from tests.helpers import config, q1, run_worker_until, submit_many

HOSTILE = ["approval", "'); DROP TABLE workflow_executions; --", "line\nbreak", "名前",
           "x" * 1000, 'quote"s and \\back']


def samples(workflow: str) -> dict[str, float]:
    return {s.labels["waiting_for"]: s.value for family in metrics.get().waiting.collect()
            for s in family.samples if s.labels["workflow"] == workflow}


def collect(dsn: str, schema: str, stats: Stats | None = None) -> Stats:
    async def main() -> Stats:
        pool = connections.make_pool(
            dsn, max_size=2, name="gauge-test",
            prepared=os.environ.get("KESTREL_CONNECTION_MODE") != "pgbouncer")
        await pool.open()
        try:
            s = stats or Stats(pool, queries(schema), workflows=["kit.wait_named", "waiter"],
                               collect_queues=True, interval=1.0, running=lambda: 0)
            s._pool = pool  # a fresh pool for this loop
            await s.run_once()
            return s
        finally:
            await pool.close()

    return asyncio.run(main())


def test_waiting_executions_by_workflow_and_signal_with_a_bounded_label_set(
    pg_dsn: str, schema: str
) -> None:
    many = MAX_WAITING_SERIES + 30
    for name in HOSTILE:
        q1(pg_dsn, schema, "SELECT {s}.submit('kit.wait_named', jsonb_build_array(%s::text))",
           [name])
    submit_many(pg_dsn, schema, "kit.wait_named", "jsonb_build_array('sig-' || i)", many)
    submit_many(pg_dsn, schema, "kit.wait_named", "jsonb_build_array('approval')", 4)
    total = len(HOSTILE) + many + 4
    waiting = "SELECT count(*) FROM {s}.workflow_executions WHERE status = 'waiting'"
    run_worker_until(pg_dsn, config(schema), lambda: q1(pg_dsn, schema, waiting) == total,
                     timeout=120)
    stats = collect(pg_dsn, schema)
    got = samples("kit.wait_named")
    assert sum(got.values()) == total  # every waiting execution counted once
    assert len(got) <= MAX_WAITING_SERIES + 1  # the cap, plus "other"
    assert got["approval"] == 5 and got["other"] > 0
    # Hostile names are label values, verbatim (those ranked within the cap: ties go by
    # name, and these sort before sig-…; 名前 and xxx… sort after and count as other).
    for name in ("'); DROP TABLE workflow_executions; --", "line\nbreak", 'quote"s and \\back'):
        assert got[name] == 1, name
    # Signals consumed: their series go to 0 (multiprocess gauges cannot be removed), no
    # new label set appears, and the sum follows.
    q1(pg_dsn, schema, "SELECT count({s}.signal(id, 'approval', 'true')) FROM "
       "{s}.workflow_executions WHERE args->>0 = 'approval'")
    run_worker_until(pg_dsn, config(schema),
                     lambda: q1(pg_dsn, schema, waiting) == total - 5, timeout=60)
    collect(pg_dsn, schema, stats)
    after = samples("kit.wait_named")
    assert after["approval"] == 0 and set(after) == set(got)
    assert sum(after.values()) == total - 5


def test_unregistered_workflows_never_become_labels(pg_dsn: str, schema: str) -> None:
    q1(pg_dsn, schema, "SELECT {s}.submit('kit.wait_named', '[\"x\"]')")
    run_worker_until(pg_dsn, config(schema), lambda: q1(
        pg_dsn, schema, "SELECT count(*) FROM {s}.workflow_executions WHERE status = "
        "'waiting'") == 1)
    # A name no worker registers, parked by hand as a waiting row: never a label.
    q1(pg_dsn, schema, "UPDATE {s}.workflow_executions SET workflow = 'typo''d; --'")
    collect(pg_dsn, schema)
    families: Any = metrics.get().waiting.collect()
    assert not [s for f in families for s in f.samples if s.labels["workflow"] == "typo'd; --"]

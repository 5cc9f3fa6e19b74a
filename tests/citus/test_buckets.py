"""A namespace spread over buckets on the cluster (issue 24, step 2; kestrel.buckets): each
bucket a distributed schema of its own, the buckets spread over the worker nodes, one
runtime serving them all through the coordinator, the client finding each execution in the
bucket its id names."""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from kestrel import buckets
from kestrel.client import SyncClient
from kestrel.migrate import migrate_namespace
from tests.apps import ledger_app as app
from tests.citus.conftest import sharding_dsn
from tests.citus.test_tenants import cluster_of, move_shard, node_of, placements
from tests.helpers import (
    drop_schemas,
    q,
    q1,
    runtime,
    submit_many,
    wait_until,
    worker_pids,
)
from tests.integration.test_buckets import (
    core_flows,
    limit_across_the_namespace,
    limit_undeclared_across_the_namespace,
    operator_actions_and_cron,
)

N = 4


@pytest.fixture
def namespace(citus_dsn: str) -> Iterator[str]:
    name = f"cn_{uuid.uuid4().hex[:12]}"
    migrate_namespace(sharding_dsn(citus_dsn), name, buckets=N)
    yield name
    drop_schemas(citus_dsn, buckets.schemas(name, N))


def test_each_bucket_is_a_distributed_schema_and_the_buckets_spread_over_the_nodes(
        citus_dsn: str, namespace: str) -> None:
    names = buckets.schemas(namespace, N)
    nodes = [node_of(citus_dsn, name) for name in names]  # each on one node
    assert len(set(nodes)) == 2, f"the buckets did not spread over both nodes: {nodes}"
    for k, name in enumerate(names):
        types = {t for _, t, _, _ in placements(citus_dsn, name)}
        assert types == {"schema"}
        assert q1(citus_dsn, name, "SELECT count(*) FROM pg_dist_schema "
                  "WHERE schemaid = %s::regnamespace", [name]) == 1
        # The bucket's number reached its ids, made through the coordinator.
        made = q1(citus_dsn, name, "SELECT {s}.new_execution_id()")
        assert buckets.bucket_of(made, N) == k


def test_one_runtime_serves_every_bucket_through_the_coordinator(
        citus_dsn: str, namespace: str, tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    names = buckets.schemas(namespace, N)
    client = SyncClient(citus_dsn, schema=namespace, pool_size=2)
    with runtime(citus_dsn, namespace, procs=N, app="tests.apps.ledger_app",
                 env={"KESTREL_TEST_LEDGER": str(ledger)}, log=tmp_path / "runtime.log"):
        # Unkeyed submits go to a random bucket: submit until every bucket has some (24 at
        # least; 4 * (3/4)**24, about one run in 250, would leave one empty otherwise).
        handles = [client.submit("three_steps", i) for i in range(24)]
        while {buckets.bucket_of(h.id, N) for h in handles} != set(range(N)):
            assert len(handles) < 200, "200 unkeyed submits never reached every bucket"
            handles.append(client.submit("three_steps", len(handles)))
        parent = client.submit("parent", 5)
        waiting = client.submit("approval", 7)
        assert [h.result(timeout=120) for h in handles] == [app.model(i)
                                                            for i in range(len(handles))]
        assert parent.result(timeout=60) == app.model(5)
        client.signal(waiting.id, "approve", {"ok": 1})
        assert waiting.result(timeout=60)["payload"] == {"ok": 1}
    assert {buckets.bucket_of(h.id, N) for h in handles} == set(range(N))
    for h in [*handles, parent, waiting]:
        home = names[buckets.bucket_of(h.id, N)]
        assert q1(citus_dsn, home, "SELECT status FROM {s}.executions WHERE id = %s",
                  [h.id]) == "completed"
    home = names[buckets.bucket_of(parent.id, N)]
    assert q(citus_dsn, home, "SELECT count(*) FROM {s}.executions WHERE parent_id = %s",
             [parent.id]) == [(1,)]
    bodies = [(e["execution_id"], e["step_id"]) for e in app.read_ledger(ledger)
              if e["kind"] == "body"]
    assert len(bodies) == len(set(bodies)) == 24 * 3 + 3 + 2
    assert client.counts().get("completed") == 24 + 2 + 1
    client.close()


def test_killed_workers_and_a_restarted_node_lose_nothing_in_a_namespace(
        citus_dsn: str, tmp_path: Path) -> None:
    """A worker process SIGKILLed mid step (the supervisor releases its bucket's leases and
    restarts it on the same bucket) and a node restarted in immediate mode under load: every
    execution in every bucket ends once with the model's result, each checkpoint once, no
    body more often than FAULTS D2 allows."""
    name = f"ck_{uuid.uuid4().hex[:12]}"
    migrate_namespace(sharding_dsn(citus_dsn), name, buckets=2)
    names = buckets.schemas(name, 2)
    try:
        ledger = tmp_path / "ledger"
        client = SyncClient(citus_dsn, schema=name, pool_size=0)
        slow = [client.submit("slow_middle", n, 2.0).id for n in range(6)]
        steps = [client.submit("three_steps", n).id for n in range(10, 40)]
        args = ["--lease", "3", "--heartbeat", "0.5", "--sweep-interval", "0.5"]
        with runtime(citus_dsn, name, procs=2, app="tests.apps.ledger_app", args=args,
                     env={"KESTREL_TEST_LEDGER": str(ledger)},
                     log=tmp_path / "runtime.log") as proc:
            started = wait_until(lambda: app.read_ledger(ledger, kind="start"), timeout=30,
                                 what="a slow step started")
            pid = int(started[0]["pid"])
            assert pid in worker_pids(proc.pid)
            os.kill(pid, signal.SIGKILL)
            node = cluster_of(node_of(citus_dsn, names[0]))
            subprocess.run(["pg_ctlcluster", *node.split(), "restart", "-m", "immediate"],
                           check=True, timeout=60)
            results = [client.result(e, timeout=120) for e in [*slow, *steps]]
        assert results == [app.model(n) for n in range(6)] + [app.model(n)
                                                              for n in range(10, 40)]
        for schema in names:
            assert q1(citus_dsn, schema, "SELECT count(*) FROM (SELECT 1 FROM "
                      "{s}.workflow_steps GROUP BY execution_id, step_id "
                      "HAVING count(*) > 1) d") == 0
        bodies = Counter((e["execution_id"], e["step_id"])
                         for e in app.read_ledger(ledger, kind="body"))
        assert max(bodies.values()) <= 2, bodies.most_common(3)
    finally:
        drop_schemas(citus_dsn, names)


def test_a_bucket_moved_to_another_node_under_load_loses_nothing(
        citus_dsn: str, tmp_path: Path) -> None:
    """One bucket of a running namespace moved by the rebalancer's step
    (``citus_move_shard_placement`` of its executions shard; its colocated tables move with
    it) while both buckets run: every execution of both ends once, each checkpoint once."""
    name = f"cm_{uuid.uuid4().hex[:12]}"
    migrate_namespace(sharding_dsn(citus_dsn), name, buckets=2)
    names = buckets.schemas(name, 2)
    n = 800
    try:
        for schema in names:  # ids made by each bucket's own submit() name it
            submit_many(citus_dsn, schema, "three_steps", "jsonb_build_array(i)", n)
        workers = {int(r[0]) for r in q(citus_dsn, name, "SELECT nodeport FROM pg_dist_node "
                                        "WHERE shouldhaveshards AND groupid <> 0")}
        before = node_of(citus_dsn, names[1])

        def finished() -> int:
            return sum(int(q1(citus_dsn, s, "SELECT count(*) FROM {s}.workflow_history"))
                       for s in names)

        with runtime(citus_dsn, name, procs=2, app="tests.apps.ledger_app",
                     log=tmp_path / "runtime.log", args=["--concurrency", "64"]):
            wait_until(lambda: finished() >= n // 4, timeout=60, what="the load under way")
            move_shard(citus_dsn, names[1], before, (workers - {before}).pop())
            moved_at = finished()
            wait_until(lambda: finished() == 2 * n, timeout=180,
                       what="every execution finished")
        assert node_of(citus_dsn, names[1]) != before
        assert moved_at < 2 * n, "the move came after the load: it proved nothing"
        for k, schema in enumerate(names):
            rows = q(citus_dsn, schema, "SELECT id, (args->>0)::int, status, result "
                     "FROM {s}.workflow_history")
            assert sorted(r[1:] for r in rows) == [(i, "completed", app.model(i))
                                                   for i in range(1, n + 1)]
            assert {buckets.bucket_of(r[0], 2) for r in rows} == {k}
            assert q1(citus_dsn, schema, "SELECT count(*) FROM {s}.workflow_steps") == 3 * n
    finally:
        drop_schemas(citus_dsn, names)


@pytest.fixture
def three_buckets(citus_dsn: str) -> Iterator[str]:
    name = f"c3_{uuid.uuid4().hex[:12]}"
    migrate_namespace(sharding_dsn(citus_dsn), name, buckets=3)
    yield name
    drop_schemas(citus_dsn, buckets.schemas(name, 3))


def test_the_core_flows_of_the_integration_suite_on_a_namespace(
        citus_dsn: str, three_buckets: str, ledger_path: Path, tmp_path: Path) -> None:
    """The integration suite's namespace flows, through the coordinator: multi-step
    workflows in every bucket, children, a signal wait, an idempotency key, a queue with
    limits (tests/integration/test_buckets.py, core_flows)."""
    core_flows(citus_dsn, three_buckets, ledger_path, tmp_path)


def test_a_limit_holds_across_a_namespace_spread_over_the_nodes(
        citus_dsn: str, three_buckets: str, tmp_path: Path) -> None:
    """FAULTS C4: a limited queue's claims in every bucket take its row in its home bucket,
    on whichever node that is, and count every bucket's running rows under it (one
    transaction across nodes): never more than the limit across the namespace
    (tests/integration/test_buckets.py, limit_across_the_namespace)."""
    limit_across_the_namespace(citus_dsn, three_buckets, tmp_path)


def test_a_limit_binds_processes_that_do_not_declare_it_on_every_node(
        citus_dsn: str, three_buckets: str, tmp_path: Path) -> None:
    """FAULTS C4: a declaration is written to every bucket, on whichever node, and each
    bucket's claim of unlimited queues leaves a limited queue out
    (tests/integration/test_buckets.py, limit_undeclared_across_the_namespace)."""
    limit_undeclared_across_the_namespace(citus_dsn, three_buckets, tmp_path)


def test_operator_actions_cron_and_partitions_on_a_namespace(
        citus_dsn: str, three_buckets: str, tmp_path: Path) -> None:
    """cancel, retry and fork in every bucket, cron once per tick, history partitions in
    every bucket, through the coordinator (test_buckets.py, operator_actions_and_cron)."""
    operator_actions_and_cron(citus_dsn, three_buckets, tmp_path)

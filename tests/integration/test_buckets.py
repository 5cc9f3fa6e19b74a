"""A namespace spread over buckets (issue 24, step 2; kestrel.buckets): each bucket one whole
kestrel schema, every id naming the bucket that holds it, the runtime's processes one per
bucket, the client routing by id and merging what it reads from all of them."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kestrel import buckets
from kestrel.client import SyncClient
from kestrel.errors import ConfigError, MigrationError
from kestrel.migrate import migrate, migrate_namespace, namespace_buckets
from tests.apps import ledger_app as app
from tests.helpers import FAST, ROOT, drop_schemas, q, q1, runtime, wait_until

N = 3


@pytest.fixture
def namespace(pg_dsn: str) -> Iterator[str]:
    """A fresh namespace of N buckets, made for tests."""
    name = f"n_{uuid.uuid4().hex[:12]}"
    migrate_namespace(pg_dsn, name, buckets=N, test_clock=True)
    yield name
    drop_schemas(pg_dsn, buckets.schemas(name, N))


def test_a_namespace_is_one_schema_per_bucket_each_making_ids_that_name_it(
        pg_dsn: str, namespace: str) -> None:
    names = buckets.schemas(namespace, N)
    assert names == [namespace, f"{namespace}_b1", f"{namespace}_b2"]
    assert namespace_buckets(pg_dsn, namespace) == N
    for k, name in enumerate(names):
        assert q(pg_dsn, name, "SELECT bucket, buckets FROM {s}.bucket") == [(k, N)]
        made = [q1(pg_dsn, name, "SELECT {s}.new_execution_id()") for _ in range(20)]
        assert {buckets.bucket_of(i, N) for i in made} == {k}
        assert all(i.version == 7 for i in made)
    # Migrating again finds nothing to do; the count is the one it was made with.
    assert migrate_namespace(pg_dsn, namespace) == {name: [] for name in names}
    assert migrate_namespace(pg_dsn, namespace, buckets=N) == {name: [] for name in names}
    with pytest.raises(MigrationError, match="keeps the bucket count"):
        migrate_namespace(pg_dsn, namespace, buckets=N + 1)
    # A plain migrate of one bucket keeps it the bucket it is.
    migrate(pg_dsn, names[2])
    assert buckets.bucket_of(q1(pg_dsn, names[2], "SELECT {s}.new_execution_id()"), N) == 2


def test_an_ordinary_schema_does_not_become_a_bucket(pg_dsn: str, schema: str) -> None:
    # Its ids name no bucket: the namespace would look for them in the wrong schemas.
    with pytest.raises(MigrationError, match="ordinary kestrel schema"):
        migrate_namespace(pg_dsn, schema, buckets=2)
    assert q(pg_dsn, schema, "SELECT * FROM {s}.bucket") == []
    assert namespace_buckets(pg_dsn, schema) == 1
    assert q1(pg_dsn, schema, "SELECT to_regnamespace(%s)", [f"{schema}_b1"]) is None
    # An ordinary schema's ids are not touched.
    assert q1(pg_dsn, schema, "SELECT {s}.kestrel_bucket()") is None


@pytest.mark.parametrize("count", [0, 1, 257, -3])
def test_a_bucket_count_out_of_range_is_refused(count: int) -> None:
    with pytest.raises(ConfigError, match="bucket count"):
        buckets.check_count(count)


def test_a_namespace_name_too_long_for_its_buckets_is_refused() -> None:
    with pytest.raises(ConfigError, match="cannot have a bucket"):
        buckets.schemas("x" * 46, 4)


def test_the_runtime_serves_every_bucket_and_the_client_finds_each_execution(
        pg_dsn: str, namespace: str, ledger_path: Path, tmp_path: Path) -> None:
    client = SyncClient(pg_dsn, schema=namespace, pool_size=2)
    names = buckets.schemas(namespace, N)
    limits = ["--queues", "default,lim", "--queue-limits", "lim:concurrency=2"]
    with runtime(pg_dsn, namespace, procs=N, args=limits, log=tmp_path / "runtime.log"):
        # Once bucket 0's worker has declared the limit, the client pins the queue.
        wait_until(lambda: q(pg_dsn, namespace, "SELECT queue FROM {s}.queue_limits"),
                   timeout=30, what="the limit declared")
        limited = [client.submit("three_steps", 200 + i, queue="lim") for i in range(12)]
        handles = [client.submit("three_steps", i) for i in range(60)]
        parents = [client.submit("parent", 100 + i) for i in range(6)]
        waiting = client.submit("approval", 7)
        # One idempotency key: one execution, wherever it is submitted from.
        keyed = {client.submit("three_steps", 5, idempotency_key="the-key").id
                 for _ in range(3)}
        assert [h.result(timeout=60) for h in handles] == [app.model(i) for i in range(60)]
        assert [p.result(timeout=60) for p in parents] == [app.model(100 + i)
                                                           for i in range(6)]
        wait_until(lambda: client.get(waiting.id).status.value == "waiting", timeout=30,
                   what="the approval to wait")
        assert client.signal(waiting.id, "approve", {"ok": True}) is True
        assert waiting.result(timeout=30) == {"pre": app.model_step(7, 0),
                                              "payload": {"ok": True},
                                              "post": app.model_step(7, 2)}
        assert len(keyed) == 1 and client.result(keyed.pop(), timeout=30) == app.model(5)
        assert [h.result(timeout=60) for h in limited] == [app.model(200 + i)
                                                           for i in range(12)]
    # A queue with limits is pinned to one bucket, so its limits hold there exactly.
    pin = buckets.choose(N, queue="lim", pinned=True)
    assert {buckets.bucket_of(h.id, N) for h in limited} == {pin}
    # The random choice used every bucket, and each execution is where its id says.
    homes = {buckets.bucket_of(h.id, N) for h in handles}
    assert homes == set(range(N))
    for h in [*handles, *parents, *limited, waiting]:
        home = names[buckets.bucket_of(h.id, N)]
        assert q1(pg_dsn, home, "SELECT count(*) FROM {s}.workflow_history WHERE id = %s",
                  [h.id]) == 1
    # A child lives in its parent's bucket.
    for p in parents:
        home = names[buckets.bucket_of(p.id, N)]
        children = q(pg_dsn, home, "SELECT id FROM {s}.workflow_history WHERE parent_id = %s",
                     [p.id])
        assert len(children) == 1
        assert buckets.bucket_of(children[0][0], N) == buckets.bucket_of(p.id, N)
    # Each step ran once (the ledger), and nothing is left live anywhere.
    ran = [(e["execution_id"], e["step_id"]) for e in app.read_ledger(ledger_path)]
    assert len(ran) == len(set(ran)) >= (60 + 12 + 6 + 1) * 3 + 2
    for name in names:
        assert q1(pg_dsn, name, "SELECT count(*) FROM {s}.workflow_executions") == 0
    # What the client reads of all of them: counts, the list, one execution's steps.
    total = 60 + 12 + 6 * 2 + 1 + 1
    assert client.counts().get("completed") == total
    page = client.list(limit=500)
    assert len(page) == total
    assert [r.created_at for r in page] == sorted((r.created_at for r in page), reverse=True)
    assert len(client.list(limit=5)) == 5
    assert [s.step_id for s in client.steps(handles[0].id)] == [0, 1, 2]
    assert client.stats().totals.get("completed") == total
    client.close()


def test_fewer_processes_than_buckets_is_refused_with_the_count_to_use(
        pg_dsn: str, namespace: str) -> None:
    cmd = [sys.executable, "-m", "kestrel", "--app", "tests.apps.ledger_app", "--dsn", pg_dsn,
           "--schema", namespace, "--procs", str(N - 1), *FAST]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert f"use --procs {N} or more" in done.stderr
    for name in buckets.schemas(namespace, N):
        assert q1(pg_dsn, name, "SELECT count(*) FROM {s}.workers") == 0

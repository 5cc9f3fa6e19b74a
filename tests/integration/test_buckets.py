"""A namespace spread over buckets (issue 24, step 2; kestrel.buckets): each bucket one whole
kestrel schema, every id naming the bucket that holds it, the runtime's processes one per
bucket, the client routing by id and merging what it reads from all of them."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psycopg
import pytest

from kestrel import buckets, ids
from kestrel.client import SyncClient
from kestrel.errors import ConfigError, MigrationError
from kestrel.migrate import migrate, migrate_namespace, namespace_buckets
from tests.apps import ledger_app as app
from tests.conftest import NAMESPACE_BUCKETS
from tests.helpers import FAST, ROOT, drop_schemas, q, q1, runtime, wait_until

N = NAMESPACE_BUCKETS  # the namespace fixture's (tests/conftest.py)




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
    # An id a caller chooses (the SQL door's p_id) must name the bucket it is submitted to,
    # or later calls would look for it elsewhere: refused before anything is written.
    chosen = ids.new_id(bucket=2)
    for door in ("submit('three_steps', '[]'::jsonb, p_id => %s)",
                 "fork(%s, 0, p_id => %s)"):
        with pytest.raises(psycopg.Error, match="names bucket 2") as refused:
            q(pg_dsn, names[1], "SELECT {s}." + door,
              [chosen] if door.startswith("submit") else [chosen, chosen])
        assert refused.value.sqlstate == "KS002"  # the client's ConfigError
    assert q1(pg_dsn, names[1], "SELECT count(*) FROM {s}.executions") == 0
    assert q1(pg_dsn, names[2], "SELECT {s}.submit('three_steps', '[]'::jsonb, p_id => %s)",
              [chosen]) == chosen
    # A plain migrate of one bucket keeps it the bucket it is.
    migrate(pg_dsn, names[2])
    assert buckets.bucket_of(q1(pg_dsn, names[2], "SELECT {s}.new_execution_id()"), N) == 2


def test_a_namespace_over_a_schema_that_is_something_else_is_refused_whole(
        pg_dsn: str) -> None:
    """A bucket's schema name already taken by an ordinary kestrel schema: refused before
    any bucket is made, so no namespace is left half made."""
    name = f"n_{uuid.uuid4().hex[:12]}"
    migrate(pg_dsn, f"{name}_b2")  # someone's ordinary schema
    try:
        with pytest.raises(MigrationError, match=f"{name}_b2.*ordinary kestrel schema"):
            migrate_namespace(pg_dsn, name, buckets=N)
        assert q1(pg_dsn, name, "SELECT to_regnamespace(%s)", [name]) is None
        assert q1(pg_dsn, name, "SELECT to_regnamespace(%s)", [f"{name}_b1"]) is None
    finally:
        drop_schemas(pg_dsn, [f"{name}_b2"])


def test_the_runtime_refuses_one_bucket_of_a_namespace(pg_dsn: str, namespace: str) -> None:
    """Its processes would tick cron a second time and its door make ids that name no
    bucket: the runtime is given the namespace's name, which serves every bucket."""
    one = buckets.schema_of(namespace, 1)
    cmd = [sys.executable, "-m", "kestrel", "--app", "tests.apps.ledger_app", "--dsn", pg_dsn,
           "--schema", one, "--procs", "1", *FAST]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert f"bucket 1 of namespace {namespace}" in done.stderr
    assert f"--schema {namespace}" in done.stderr
    assert q1(pg_dsn, one, "SELECT count(*) FROM {s}.workers") == 0
    # The client reads that one bucket as a schema of its own.
    client = SyncClient(pg_dsn, schema=one, pool_size=0)
    h = client.submit("three_steps", 1)
    assert buckets.bucket_of(h.id, N) == 1 and client.get(h.id).status.value == "queued"


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
    core_flows(pg_dsn, namespace, ledger_path, tmp_path)


def core_flows(pg_dsn: str, namespace: str, ledger_path: Path, tmp_path: Path) -> None:
    """A runtime of a process per bucket: multi-step workflows in every bucket, children in
    their parents', a signal wait, an idempotency key and a queue with limits, to the
    model's results with each step once; the client's merged reads. (The
    Citus tier runs it too.)"""
    client = SyncClient(pg_dsn, schema=namespace, pool_size=2)
    names = buckets.schemas(namespace, N)
    limits = ["--queues", "default,lim", "--queue-limits", "lim:concurrency=2"]
    with runtime(pg_dsn, namespace, procs=N, args=limits, log=tmp_path / "runtime.log"):
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


def test_operator_actions_and_cron_on_a_namespace(pg_dsn: str, namespace: str,
                                                  tmp_path: Path) -> None:
    operator_actions_and_cron(pg_dsn, namespace, tmp_path)


def operator_actions_and_cron(pg_dsn: str, namespace: str, tmp_path: Path) -> None:
    """cancel, retry and fork reach each execution in its bucket (a fork stays in its
    source's, where the checkpoints it copies are); a schedule ticks once per tick in the
    whole namespace (bucket 0's processes start the ticks, the others do not); history
    partitions exist in every bucket. (The Citus tier runs it too.)"""
    client = SyncClient(pg_dsn, schema=namespace, pool_size=2)
    names = buckets.schemas(namespace, N)
    with runtime(pg_dsn, namespace, procs=N, log=tmp_path / "runtime.log",
                 app="tests.apps.ledger_app,tests.apps.cron_app"):
        # Two in each bucket: keys the choice sends there.
        keys = [[k for k in (f"w{i}" for i in range(200))
                 if buckets.choose(N, queue="default", idempotency_key=k) == b][:2]
                for b in range(N)]
        waiters = [client.submit("waiter", idempotency_key=k) for ks in keys for k in ks]
        for w in waiters:
            wait_until(lambda w=w: client.get(w.id).status.value == "waiting", timeout=30,
                       what="the waiters parked")
        assert [buckets.bucket_of(w.id, N) for w in waiters] == [0, 0, 1, 1, 2, 2]
        for w in waiters:
            assert client.cancel(w.id) == "cancelled"
        # A cancel's finish waits in its bucket (uncounted_finishes) for the process that
        # counts finishes for the metrics: each bucket has one, so none is left behind.
        assert all(q1(pg_dsn, name, "SELECT count(*) FROM {s}.uncounted_finishes") == 2
                   for name in names)
        wait_until(lambda: all(q1(pg_dsn, name, "SELECT count(*) FROM "
                                  "{s}.uncounted_finishes") == 0 for name in names),
                   timeout=60, what="every bucket's finishes counted")
        for w in waiters:
            client.retry(w.id, idempotency_key=f"again-{w.id}")
        for w in waiters:
            wait_until(lambda w=w: client.get(w.id).status.value == "waiting", timeout=30,
                       what="the retried waiters parked again")
            assert client.signal(w.id, "go", str(w.id)) is True
        assert [w.result(timeout=30) for w in waiters] == [str(w.id) for w in waiters]
        done = [client.submit("three_steps", 40 + i) for i in range(6)]
        assert [h.result(timeout=30) for h in done] == [app.model(40 + i) for i in range(6)]
        forks = [client.fork(h.id, 2) for h in done]
        assert [f.result(timeout=30) for f in forks] == [app.model(40 + i) for i in range(6)]
        assert [buckets.bucket_of(f.id, N) for f in forks] == [
            buckets.bucket_of(h.id, N) for h in done]
        assert [client.forked_from(f.id) for f in forks] == [(h.id, 2) for h in done]
        time.sleep(4)
    ticks = [r[0] for name in names
             for r in q(pg_dsn, name, "SELECT args->>0 FROM {s}.executions "
                        "WHERE workflow = 'tick'")]
    assert len(ticks) >= 3 and len(ticks) == len(set(ticks)), sorted(ticks)
    assert all(q(pg_dsn, name, "SELECT 1 FROM {s}.executions WHERE workflow = 'tick'") == []
               for name in names[1:])
    for name in names:
        assert q1(pg_dsn, name, "SELECT count(*) FROM pg_inherits WHERE inhparent = "
                  "%s::regclass", [f"{name}.workflow_history"]) >= 2
    client.close()


def test_a_limit_holds_across_the_namespace_wherever_its_executions_are(
        pg_dsn: str, namespace: str, tmp_path: Path) -> None:
    limit_across_the_namespace(pg_dsn, namespace, tmp_path)


def limit_across_the_namespace(pg_dsn: str, namespace: str, tmp_path: Path) -> None:
    """FAULTS C4 (issue 38 row 7): a queue limited to 2 in a namespace of 3 buckets, its
    executions in every bucket (top-level submits at random, children in their parents'
    buckets): never more than 2 running at once across the namespace, sampled in one
    snapshot of all three schemas. Before, limits held per bucket (the queue was pinned to
    one, but children stayed in their parents' buckets): up to 2 per bucket ran. (The Citus
    tier runs it too.)"""
    client = SyncClient(pg_dsn, schema=namespace, pool_size=2)
    names = buckets.schemas(namespace, N)
    count = "SELECT " + " + ".join(
        f"(SELECT count(*) FROM \"{n}\".workflow_executions WHERE queue = 'lim' "
        "AND status = 'running')" for n in names)
    seen: list[int] = []
    failed: list[BaseException] = []
    stop = threading.Event()

    def sample() -> None:
        try:  # no prepared statements: a transaction-mode PgBouncer cannot route them
            with psycopg.connect(pg_dsn, autocommit=True, prepare_threshold=None) as conn:
                while not stop.is_set():
                    seen.append(int(conn.execute(count).fetchone()[0]))  # type: ignore[index]
                    stop.wait(0.01)
        except BaseException as exc:  # said by the test, not lost with the thread
            failed.append(exc)

    limits = ["--queues", "default,lim", "--queue-limits", "lim:concurrency=2",
              "--concurrency", "8"]
    sampler = threading.Thread(target=sample)
    with runtime(pg_dsn, namespace, procs=N, args=limits, log=tmp_path / "runtime.log"):
        sampler.start()
        try:
            tops = [client.submit("slow_middle", i, 0.2, queue="lim") for i in range(9)]
            parents = [client.submit("slow_child_in", 100 + i, 0.2, "lim") for i in range(9)]
            assert [h.result(timeout=120) for h in tops] == [app.model(i) for i in range(9)]
            assert [p.result(timeout=120) for p in parents] == [app.model(100 + i)
                                                                for i in range(9)]
        finally:
            stop.set()
            sampler.join()
    children = [r[0] for name in names for r in q(
        pg_dsn, name, "SELECT id FROM {s}.workflow_history WHERE queue = 'lim' "
        "AND parent_id IS NOT NULL")]
    homes = {buckets.bucket_of(i, N) for i in children} | {
        buckets.bucket_of(h.id, N) for h in tops}
    assert len(children) == 9 and len(homes) >= 2, homes  # the queue lives in several buckets
    assert failed == []
    assert max(seen) == 2, f"running at once across the namespace: max {max(seen)}"


def test_a_limit_binds_the_processes_that_do_not_declare_it_in_every_bucket(
        pg_dsn: str, namespace: str, tmp_path: Path) -> None:
    limit_undeclared_across_the_namespace(pg_dsn, namespace, tmp_path)


def limit_undeclared_across_the_namespace(pg_dsn: str, namespace: str, tmp_path: Path) -> None:
    """FAULTS C4, limits declared during the run, in a namespace: a runtime serving `lim`
    without a limit (and not looking at the limits again for 20 s) runs beside one that
    declares 2 at once. The declaration is written to every bucket, and every bucket's claim
    of unlimited queues leaves a queue with limits out: never more than 2 across the
    namespace. Before, the first runtime claimed them all at once. (The Citus tier runs it
    too.)"""
    names = buckets.schemas(namespace, N)
    count = "SELECT " + " + ".join(
        f"(SELECT count(*) FROM \"{n}\".workflow_executions WHERE queue = 'lim' "
        "AND status = 'running')" for n in names)
    seen: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        with psycopg.connect(pg_dsn, autocommit=True, prepare_threshold=None) as conn:
            while not stop.is_set():
                seen.append(int(conn.execute(count).fetchone()[0]))  # type: ignore[index]
                stop.wait(0.01)

    free = ["--queues", "default,lim", "--queue-limits", "lim", "--heartbeat", "20",
            "--lease", "60"]
    two = ["--queues", "default,lim", "--queue-limits", "lim:concurrency=2"]
    client = SyncClient(pg_dsn, schema=namespace, pool_size=2)
    sampler = threading.Thread(target=sample)
    with runtime(pg_dsn, namespace, procs=N, args=free, log=tmp_path / "free.log"):
        for i in range(N):  # the first runtime claims, and has looked at the limits
            client.submit("quick", i).result(timeout=60)
        with runtime(pg_dsn, namespace, procs=N, args=two, log=tmp_path / "two.log"):
            wait_until(lambda: sum(q1(pg_dsn, n, "SELECT count(*) FROM {s}.queue_limits "
                                      "WHERE concurrency = 2") for n in names) == N,
                       timeout=60, what="the limit in every bucket")
            sampler.start()
            try:
                done = [client.submit("busy", 0.3, queue="lim") for _ in range(9)]
                for h in done:
                    h.result(timeout=120)
            finally:
                stop.set()
                sampler.join()
    assert max(seen) == 2, f"running at once across the namespace: max {max(seen)}"


def test_one_key_one_execution_whatever_the_clients_know_of_limits(
        pg_dsn: str, namespace: str) -> None:
    """FAULTS C4 (issue 38 row 4): a key's bucket is a function of the key alone. Before, a
    client that had read a queue's limit sent a key to the queue's bucket and one that had
    not to the key's, and one key made two executions."""
    key = next(k for k in (f"k{i}" for i in range(100))
               if buckets.choose(N, queue="lim", idempotency_key=k) != buckets.home("lim", N))
    before = SyncClient(pg_dsn, schema=namespace, pool_size=0)
    first = before.submit("three_steps", 1, queue="lim", idempotency_key=key)
    for name in buckets.schemas(namespace, N):
        q(pg_dsn, name, "INSERT INTO {s}.queue_limits (queue, concurrency) VALUES ('lim', 1)")
    after = SyncClient(pg_dsn, schema=namespace, pool_size=0)
    assert after.submit("three_steps", 1, queue="lim", idempotency_key=key).id == first.id
    assert before.submit("three_steps", 1, queue="lim", idempotency_key=key).id == first.id
    assert buckets.bucket_of(first.id, N) == buckets.choose(N, queue="x", idempotency_key=key)


@pytest.mark.parametrize("door", ["client", "cli", "http"])
def test_both_keys_at_once_are_refused_in_a_namespace_before_anything_is_written(
        pg_dsn: str, namespace: str, door: str, tmp_path: Path) -> None:
    """FAULTS C4: an idempotency key and a dedup key each decide a submit's bucket, and they
    differ; neither promise could be kept across buckets (one dedup key had two live
    executions when the submits also carried idempotency keys), so the submit is refused,
    typed, with nothing written, at every door."""
    def total() -> int:
        return sum(int(q1(pg_dsn, n, "SELECT count(*) FROM {s}.workflow_executions"))
                   for n in buckets.schemas(namespace, N))

    if door == "client":
        client = SyncClient(pg_dsn, schema=namespace, pool_size=0)
        with pytest.raises(ConfigError, match="not both"):
            client.submit("three_steps", 1, idempotency_key="k'; DROP TABLE x; --",
                          dedup_key="d")
    elif door == "cli":
        out = subprocess.run(
            [sys.executable, "-m", "kestrel", "submit", "three_steps", "--args", "[1]",
             "--idempotency-key", "k", "--dedup-key", "d", "--dsn", pg_dsn,
             "--schema", namespace], capture_output=True, text=True, timeout=60,
            cwd=ROOT, check=False)
        assert out.returncode == 1 and "not both" in out.stderr, out
    else:
        from tests.http_helpers import free_port, http_runtime, make_token

        token = make_token(pg_dsn, namespace, "both-keys", "submit")
        with http_runtime(pg_dsn, namespace, port=free_port(), log=tmp_path / "rt.log",
                          procs=N) as api:
            api.token = token
            reply = api.post("/api/v1/workflows/http.echo/submit",
                             {"args": [1], "dedup_key": "d"},
                             headers={"Idempotency-Key": "k"})
            assert reply.status == 400 and b"not both" in reply.body, reply.body
    assert total() == 0


def test_the_http_door_and_the_web_ui_serve_a_namespace(pg_dsn: str, namespace: str,
                                                         tmp_path: Path) -> None:
    """Submits through the API land in the bucket the client's choice gives (their ids
    chosen by the door name it); every call about one execution reaches its bucket; the
    list pages through every bucket, newest first, without a gap or a repeat; a keyed fork
    lives in its source's bucket; the web UI lists, counts and shows executions of every
    bucket."""
    from tests.http_helpers import Api, free_port, http_runtime, make_token
    from tests.ui_helpers import Browserless

    api_root = "/api/v1"
    token = make_token(pg_dsn, namespace, "ns-all", "read,operate,submit")
    with http_runtime(pg_dsn, namespace, port=free_port(), log=tmp_path / "rt.log",
                      procs=N) as api:
        api.token = token

        def post(path: str, body: object, key: str | None = None) -> dict[str, object]:
            reply = api.post(api_root + path, body,
                             headers={"Idempotency-Key": key} if key else None)
            assert reply.status in (200, 201), reply.body
            found: dict[str, object] = reply.json()
            return found

        def finished(eid: str, status: str = "completed") -> dict[str, object]:
            return wait_until(  # type: ignore[no-any-return]
                lambda: (ex := api.get(f"{api_root}/executions/{eid}").json())["status"]
                == status and ex, timeout=60, what=f"{eid} {status}")

        # Unkeyed submits go to a random bucket: submit until every bucket has some (15 at
        # least; 3 * (2/3)**15, about one run in 150, would leave one empty otherwise).
        ids: list[str] = []
        while len(ids) < 15 or {buckets.bucket_of(uuid.UUID(i), N) for i in ids} != set(range(N)):
            assert len(ids) < 200, "200 unkeyed submits never reached every bucket"
            ids.append(str(post("/workflows/http.steps/submit", {"args": [len(ids)]})["id"]))
        keyed = post("/workflows/http.echo/submit", {"args": [1]}, key="ns-key")["id"]
        assert post("/workflows/http.echo/submit", {"args": [1]}, key="ns-key")["id"] == keyed
        # An HTTP Idempotency-Key is the token's own (kestrel.http.api): it is routed as such.
        token_id = token.split("_")[1]
        assert buckets.bucket_of(uuid.UUID(str(keyed)), N) == buckets.choose(
            N, queue="default", idempotency_key=f"http:{token_id}:ns-key")
        waiting = str(post("/workflows/http.approval/submit", {"args": [{"a": 1}]})["id"])
        assert {buckets.bucket_of(uuid.UUID(i), N) for i in ids} == set(range(N))
        for n, eid in enumerate(ids):
            ex = finished(eid)
            assert ex["result"] == n * 2 + 2
            children = ex["children"]
            assert isinstance(children, list) and len(children) == 1
            assert buckets.bucket_of(uuid.UUID(children[0]["id"]), N) == \
                buckets.bucket_of(uuid.UUID(eid), N)
        finished(waiting, "waiting")
        sent = post(f"/executions/{waiting}/signal",
                    {"name": "approval", "payload": {"approved": True, "by": "ana"}},
                    key="press-1")
        assert sent["delivered"] is True
        again = post(f"/executions/{waiting}/signal",
                     {"name": "approval", "payload": {"approved": True, "by": "ana"}},
                     key="press-1")
        assert again["delivered"] is False
        assert finished(waiting)["result"] == {"outcome": "approved", "by": "ana"}
        fork = post(f"/executions/{ids[0]}/fork", {"from_step": 1}, key="fork-1")
        assert post(f"/executions/{ids[0]}/fork", {"from_step": 1}, key="fork-1") == fork
        assert buckets.bucket_of(uuid.UUID(str(fork["id"])), N) == \
            buckets.bucket_of(uuid.UUID(ids[0]), N)
        finished(str(fork["id"]))
        # The list, five at a time through every bucket.
        seen: list[dict[str, object]] = []
        cursor = None
        while True:
            page = api.get(f"{api_root}/executions?limit=5"
                           + (f"&cursor={cursor}" if cursor else "")).json()
            seen.extend(page["executions"])
            cursor = page["next_cursor"]
            if cursor is None:
                break
        every = set(ids) | {str(keyed), waiting, str(fork["id"])}
        listed = [str(e["id"]) for e in seen]
        assert len(listed) == len(set(listed)) and every <= set(listed)
        assert len(listed) == len(every) + 16  # and the children: 15, and the fork's
        stamps = [str(e["created_at"]) for e in seen]
        assert stamps == sorted(stamps, reverse=True)
        # The web UI: the list with the counts of every bucket, an execution of each.
        ui = Browserless(Api(api.port))
        ui.login(token)
        listing = ui.get("/ui/")
        assert listing.status == 200
        for eid in ids[:N * 2]:
            page = ui.get(f"/ui/executions/{eid}")
            assert page.status == 200 and eid.encode() in page.body
        counts = ui.get("/ui/counts").json()
        assert counts["finished_24h"]["completed"] == len(every) + 16


@pytest.mark.parametrize("bad", ["300", "-2", "abc", "1e3", "1e-400", str(2**64),
                                 "4; DROP SCHEMA x", "\x00", "\ud800", "9" * 400])
def test_migrate_refuses_a_bad_bucket_count_before_writing_anything(
        pg_dsn: str, bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    from kestrel.cli import main

    name = f"n_{uuid.uuid4().hex[:12]}"
    with pytest.raises(SystemExit) if not bad.lstrip("-").isdigit() else _no_exit():
        code = main(["migrate", "--dsn", pg_dsn, "--schema", name, "--buckets", bad,
                     "--log-level", "error"])
        assert code == 2
    err = capsys.readouterr().err
    assert "buckets" in err
    assert q1(pg_dsn, name, "SELECT to_regnamespace(%s)", [name]) is None


class _no_exit:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return False


def test_the_cli_reads_and_keeps_every_bucket(pg_dsn: str, namespace: str, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """migrate, list, show, partitions and export-histories on a namespace: each bucket."""
    from kestrel.cli import main
    from tests.helpers import config, run_worker_until

    def cli(*args: str) -> str:
        code = main([*args, "--dsn", pg_dsn, "--schema", namespace, "--log-level", "error"])
        out, err = capsys.readouterr()
        assert code == 0, err
        return out

    names = buckets.schemas(namespace, N)
    assert cli("migrate").splitlines() == [f"schema {n}: up to date" for n in names]
    client = SyncClient(pg_dsn, schema=namespace, pool_size=1)
    keys = [next(k for k in (f"c{i}" for i in range(200))
                 if buckets.choose(N, queue="default", idempotency_key=k) == b)
            for b in range(N)]
    handles = [client.submit("three_steps", i, idempotency_key=k) for i, k in enumerate(keys)]
    for name in names:  # a worker of each bucket, in process
        run_worker_until(pg_dsn, config(name, concurrency=8),
                         lambda s=name: q1(pg_dsn, s, "SELECT count(*) FROM "
                                           "{s}.workflow_executions") == 0)
    listed = json.loads(cli("list", "--json"))
    assert {e["id"] for e in listed} >= {str(h.id) for h in handles}
    for h in handles:
        assert str(h.id) in cli("show", str(h.id))
    parts = json.loads(cli("partitions", "--json"))["partitions"]
    assert {p["schema"] for p in parts} == set(names)
    out = tmp_path / "histories.jsonl"
    try:
        cli("export-histories", "--out", str(out))
        exported = {json.loads(line)["id"] for line in out.read_text().splitlines()}
        assert exported >= {str(h.id) for h in handles}
    finally:
        out.unlink(missing_ok=True)
    client.close()

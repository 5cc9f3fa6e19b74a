"""Concurrency keys (issue 42, item 1): ``kestrel.queue("deploys", concurrency=3,
per_key=1)`` and ``submit(…, concurrency_key="svc-a")``. At most ``per_key`` of a key run at
once and the queue's limit overall, exact under several processes and across a namespace's
buckets; keys take turns (a key with hundreds queued does not hold back a key with one);
rows without a key are one key, not lost; parked executions hold no slot. Every door refuses
a bad key or limit before anything is written."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql as pgsql

from kestrel import buckets
from kestrel.client import SyncClient
from kestrel.errors import ConfigError, SerializationError
from kestrel.queues import QueueSpec, parse_limits
from tests.apps import ledger_app as app
from tests.helpers import ROOT, config, finished_count, q, run_worker_until, runtime
from tests.http_helpers import free_port, make_token, serve_process

KEYS = [f"svc-{i}" for i in range(4)]


class RunningByKey:
    """Samples, in one snapshot of every schema, how many of *queue* run, by key ('' for
    none): the most seen per key and in all."""

    def __init__(self, dsn: str, schemas: list[str], queue: str) -> None:
        self.dsn = dsn
        parts = pgsql.SQL(" UNION ALL ").join(
            pgsql.SQL("SELECT concurrency_key FROM {}.workflow_executions "
                      "WHERE queue = {} AND status = 'running'").format(
                pgsql.Identifier(s), pgsql.Literal(queue)) for s in schemas)
        self.stmt = pgsql.SQL("SELECT coalesce(concurrency_key, ''), count(*) FROM ({}) AS r "
                              "GROUP BY 1").format(parts)
        self.most: dict[str, int] = {}
        self.most_in_all = 0
        self.samples = 0
        self.failed: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        try:  # no prepared statements: a transaction-mode PgBouncer cannot route them
            with psycopg.connect(self.dsn, autocommit=True, prepare_threshold=None) as conn:
                while not self._stop.is_set():
                    rows = conn.execute(self.stmt).fetchall()
                    for key, n in rows:
                        self.most[key] = max(self.most.get(key, 0), n)
                    self.most_in_all = max(self.most_in_all, sum(n for _, n in rows))
                    self.samples += 1
                    self._stop.wait(0.005)
        except BaseException as exc:  # said by the test, not lost with the thread
            self.failed.append(exc)

    def __enter__(self) -> RunningByKey:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def keyed_limits_hold(dsn: str, schema: str, schemas: list[str], tmp_path: Path,
                      procs: int) -> None:
    """Four keys of five executions and four without a key, in a queue of 3 with 1 per key,
    run by *procs* processes: never two of a key at once, never more than 3 in all, both
    reached, everything finished. (The Citus tier runs it too.)"""
    client = SyncClient(dsn, schema=schema, pool_size=2)
    limits = ["--queues", "default,deploys", "--queue-limits",
              "deploys:concurrency=3,per_key=1", "--concurrency", "8"]
    with RunningByKey(dsn, schemas, "deploys") as seen, runtime(
            dsn, schema, procs=procs, args=limits, log=tmp_path / "runtime.log"):
        handles = [client.submit("busy", 0.15, queue="deploys", concurrency_key=key)
                   for _ in range(5) for key in KEYS]
        handles += [client.submit("busy", 0.15, queue="deploys") for _ in range(4)]
        for h in handles:
            h.result(timeout=120)
    assert seen.failed == []
    assert seen.samples > 50
    assert {k: seen.most.get(k) for k in KEYS} == dict.fromkeys(KEYS, 1), seen.most
    assert seen.most.get("", 0) == 1, seen.most  # without a key: one key
    assert seen.most_in_all == 3, seen.most_in_all  # reached, never exceeded
    keys = [r[0] for s in schemas for r in q(
        dsn, s, "SELECT concurrency_key FROM {s}.workflow_history WHERE queue = 'deploys'")]
    assert sorted(keys, key=str) == sorted([*KEYS * 5, *[None] * 4], key=str)


def test_per_key_and_queue_limits_hold_across_processes(pg_dsn: str, schema: str,
                                                        tmp_path: Path) -> None:
    keyed_limits_hold(pg_dsn, schema, [schema], tmp_path, procs=3)


def test_per_key_limits_hold_across_a_namespace(pg_dsn: str, namespace: str,
                                                tmp_path: Path) -> None:
    names = buckets.schemas(namespace, len(buckets.schemas(namespace, 3)))
    keyed_limits_hold(pg_dsn, namespace, names, tmp_path, procs=len(names))


def test_keys_take_turns(pg_dsn: str, schema: str) -> None:
    # 150 of one key queued first, then one each of two more: with a single slot, the
    # lone keys start second and third, not after the 150 (first in, first out would).
    client = SyncClient(pg_dsn, schema=schema, pool_size=1)
    q(pg_dsn, schema, "SELECT {s}.submit('quick', jsonb_build_array(i), 'fair', "
      "p_concurrency_key => 'big') FROM generate_series(1, 150) AS i")
    lone = [client.submit(app.quick, n, queue="fair", concurrency_key=f"lone-{n}").id
            for n in range(2)]

    def lone_done() -> bool:
        return q(pg_dsn, schema, "SELECT count(*) FROM {s}.workflow_history WHERE id = ANY(%s)",
                 (lone,))[0][0] == 2

    run_worker_until(pg_dsn, config(schema, queues=("fair",), queue_limits="fair:per_key=2",
                                    concurrency=1, batch_size=1), lone_done)
    order = [r[0] for r in q(pg_dsn, schema, "SELECT id FROM {s}.workflow_history "
                                             "ORDER BY started_at")]
    assert set(lone) <= set(order[:3]), (lone, order[:5])
    # The rotation's place is kept in the queue's row for the next claim.
    assert q(pg_dsn, schema, "SELECT key_turn IS NOT NULL FROM {s}.queue_limits "
                             "WHERE queue = 'fair'") == [(True,)]


def test_a_parked_execution_holds_no_slot_and_a_woken_one_waits_for_its_key(
        pg_dsn: str, schema: str) -> None:
    # One per key: the first sleeps 2 s parked, the second runs meanwhile (a parked
    # execution does not count); woken, the first never runs beside another of its key.
    client = SyncClient(pg_dsn, schema=schema, pool_size=1)
    first = client.submit(app.sleeper, 1, 2.0, queue="one-each", concurrency_key="k")
    second = client.submit(app.sleeper, 2, 0.1, queue="one-each", concurrency_key="k")
    with RunningByKey(pg_dsn, [schema], "one-each") as seen:
        run_worker_until(pg_dsn, config(schema, queues=("one-each",),
                                        queue_limits="one-each:per_key=1"),
                         lambda: finished_count(pg_dsn, schema) == 2, timeout=60)
    assert seen.failed == [] and seen.most == {"k": 1}
    assert first.result(timeout=1) == app.model(1, steps=2)
    assert second.result(timeout=1) == app.model(2, steps=2)
    (s1, f1), = q(pg_dsn, schema, "SELECT started_at, finished_at FROM {s}.workflow_history "
                                  "WHERE id = %s", (first.id,))
    (s2,), = q(pg_dsn, schema, "SELECT started_at FROM {s}.workflow_history WHERE id = %s",
               (second.id,))
    assert s1 < s2 < f1  # the second started while the first was parked


def executions(dsn: str, schema: str) -> list[tuple[Any, ...]]:
    return q(dsn, schema, "SELECT id, concurrency_key FROM {s}.workflow_executions")


@pytest.mark.parametrize(("key", "error", "says"), [
    ("k\x00", SerializationError, "NUL"),
    ("k\ud800", SerializationError, "surrogate"),
    ("k" * 10_000, SerializationError, "over the limit"),
    ("", SerializationError, "empty"),
    (7, SerializationError, "string"),
])
def test_the_client_refuses_a_bad_key_before_writing(
        pg_dsn: str, schema: str, key: Any, error: type[Exception], says: str) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    with pytest.raises(error, match=says):
        client.submit("three_steps", 1, queue="deploys", concurrency_key=key)
    assert executions(pg_dsn, schema) == []


@pytest.mark.parametrize(("key", "says"), [
    ("''", "must not be empty"),
    ("repeat('k', 100000)", "concurrency key"),
    ("$$' OR 1=1 --$$", None),  # an SQL-looking key is a key like any other
    ("$$svc-a; DROP TABLE x$$", None),
])
def test_the_sql_function_checks_the_key_before_writing(
        pg_dsn: str, schema: str, key: str, says: str | None) -> None:
    call = pgsql.SQL("SELECT {}.submit('three_steps', '[1]', 'deploys', p_concurrency_key => "
                     + key + ")").format(pgsql.Identifier(schema))
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        if says is None:
            eid = conn.execute(call).fetchone()
            assert executions(pg_dsn, schema) == [(eid[0], conn.execute(  # type: ignore[index]
                pgsql.SQL("SELECT " + key)).fetchone()[0])]  # type: ignore[index]
            return
        with pytest.raises(psycopg.Error, match=says):
            conn.execute(call)
    assert executions(pg_dsn, schema) == []


@pytest.mark.parametrize(("limits", "says"), [
    (dict(per_key=0), "at least 1"),
    (dict(per_key=-1), "at least 1"),
    (dict(per_key=True), "whole number"),
    (dict(per_key=1.5), "whole number"),
    (dict(per_key="1"), "whole number"),
    (dict(per_key=2**31), "below 2"),
])
def test_a_bad_per_key_limit_is_refused(limits: dict[str, Any], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        QueueSpec(name="deploys", **limits)


def test_queue_limits_setting_takes_per_key() -> None:
    assert parse_limits("deploys:concurrency=5,per_key=1")["deploys"] == QueueSpec(
        name="deploys", concurrency=5, per_key=1)
    with pytest.raises(ConfigError, match="per_key=x"):
        parse_limits("deploys:per_key=x")
    assert QueueSpec(name="deploys", per_key=1).limited


def test_the_cli_and_the_http_api_take_a_key_and_refuse_bad_ones(
        pg_dsn: str, schema: str, tmp_path: Path) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "kestrel", "submit", "three_steps",
                               *args, "--allow-unknown", "--dsn", pg_dsn, "--schema", schema],
                              capture_output=True, text=True, cwd=ROOT, timeout=60)

    ok = cli("--args", "[1]", "--queue", "deploys", "--concurrency-key", "svc-cli")
    assert ok.returncode == 0, ok.stderr
    bad = cli("--queue", "deploys", "--concurrency-key", "")
    assert bad.returncode == 1 and "empty" in bad.stderr, bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1

    token = make_token(pg_dsn, schema, "sub", "submit")
    with serve_process(pg_dsn, schema, port=free_port(), log=tmp_path / "serve.log",
                       app="tests.apps.ledger_app") as api:
        api.token = token
        path = "/api/v1/workflows/three_steps/submit"
        got = api.post(path, {"args": [2], "queue": "deploys", "concurrency_key": "svc-http"})
        assert got.status == 201, got.body
        for body, says in [
            ({"concurrency_key": "h\x00"}, "NUL"),
            ({"concurrency_key": "h\ud800"}, "surrogate"),
            ({"concurrency_key": 7}, "string"),
            ({"concurrency_key": ""}, "empty"),
            ({"concurrency_key": "k" * 5000}, "over the limit"),
        ]:
            got = api.post(path, {"args": [5], "queue": "deploys", **body})
            assert got.status == 400, (body, got.status, got.body)
            assert says.lower() in json.dumps(got.json()).lower(), (body, got.body)
    assert sorted(r[1] for r in executions(pg_dsn, schema)) == ["svc-cli", "svc-http"]

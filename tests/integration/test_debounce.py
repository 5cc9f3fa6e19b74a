"""Debounce (issue 42, item 2): ``submit(…, debounce_key=K, debounce=S)``.

Submits of a key within the window replace the pending execution's arguments and push its
start back; exactly one execution starts after a quiet window, and the caller always gets
the id that will run; a maximum wait bounds a stream that never stops; once it has started
the next submit starts the next one. Safe under concurrent submits from many clients and
under a resend after a lost reply; in a namespace the key's submits meet in one bucket.
Every door refuses a bad debounce before anything is written."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql as pgsql

from kestrel.client import SyncClient
from kestrel.errors import ConfigError, DuplicateExecution, SerializationError
from tests.apps import ledger_app as app
from tests.helpers import ROOT, config, finished_count, run_worker_until
from tests.http_helpers import free_port, make_token, serve_process


def executions(dsn: str, schema: str) -> list[tuple[Any, ...]]:
    """Every execution of the schema, live or finished: (id, status, args)."""
    with psycopg.connect(dsn) as conn:
        return conn.execute(pgsql.SQL(
            "SELECT id, status, args FROM {s}.workflow_executions UNION ALL "
            "SELECT id, status, args FROM {s}.workflow_history").format(
                s=pgsql.Identifier(schema))).fetchall()


def test_submits_within_the_window_make_one_execution_with_the_last_arguments(
        pg_dsn: str, schema: str) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=1)
    ids = {client.submit("three_steps", n, debounce_key="doc-42", debounce=0.6).id
           for n in range(6)}
    assert len(ids) == 1  # the caller gets the id that will run, every time
    (eid,) = ids
    assert [(r[1], r[2]) for r in executions(pg_dsn, schema)] == [("waiting", [5])]
    # Another key, or the same key in another queue, is another execution.
    other = client.submit("three_steps", 9, debounce_key="doc-43", debounce=0.6).id
    queue = client.submit("three_steps", 8, debounce_key="doc-42", debounce=0.6,
                          queue="q2").id
    assert len({eid, other, queue}) == 3
    run_worker_until(pg_dsn, config(schema, queues=("default", "q2")),
                     lambda: finished_count(pg_dsn, schema) >= 3, timeout=60)
    assert client.result(eid, timeout=5) == app.model(5)
    # Once it has run, the key's next submit starts the next one.
    after = client.submit("three_steps", 7, debounce_key="doc-42", debounce=0.2).id
    assert after != eid
    assert len(executions(pg_dsn, schema)) == 4


def test_concurrent_submits_from_many_clients_start_exactly_one(pg_dsn: str,
                                                              schema: str) -> None:
    returned: list[uuid.UUID] = []
    errors: list[BaseException] = []

    def submitter(t: int) -> None:
        client = SyncClient(pg_dsn, schema=schema, pool_size=1)
        try:
            returned.extend(client.submit("three_steps", t * 100 + n, debounce_key="burst",
                                          debounce=30.0).id for n in range(10))
        except BaseException as exc:
            errors.append(exc)
        finally:
            client.close()

    threads = [threading.Thread(target=submitter, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(returned) == 80 and len(set(returned)) == 1
    (row,) = executions(pg_dsn, schema)
    # The arguments of one of the submits (the last to commit), whole.
    assert row[1] == "waiting" and row[2][0] in {t * 100 + n for t in range(8)
                                                 for n in range(10)}


def test_a_stream_that_never_stops_still_runs_after_the_maximum_wait(
        pg_dsn: str, schema: str) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=1)
    first = client.submit("three_steps", 0, debounce_key="tick", debounce=0.5,
                          debounce_max=1.5).id
    started: list[uuid.UUID] = []
    stop = threading.Event()

    def stream() -> None:  # a submit every 0.1 s, for 3 s: never a quiet 0.5 s
        n = 1
        while not stop.is_set():
            started.append(client.submit("three_steps", n, debounce_key="tick",
                                         debounce=0.5, debounce_max=1.5).id)
            n += 1
            time.sleep(0.1)

    feeder = threading.Thread(target=stream)
    feeder.start()
    try:
        run_worker_until(pg_dsn, config(schema),
                         lambda: finished_count(pg_dsn, schema) >= 1, timeout=30)
        time.sleep(0.5)  # a few submits more, after it started
    finally:
        stop.set()
        feeder.join()
    # The first ran at its maximum wait although submits kept coming; those after its
    # start made the next one, which waits (the stream stopped: it runs once quiet).
    ran = client.get(first)
    assert ran.status.value == "completed" and ran.started_at is not None
    assert 1.4 <= (ran.started_at - ran.created_at).total_seconds() < 5
    assert started[0] == first and started[-1] != first
    assert len(set(started)) == 2


def test_a_resent_submit_after_a_lost_reply_returns_the_same_pending_id(
        pg_dsn: str, schema: str) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=1)
    first = client.submit("three_steps", 1, debounce_key="k", debounce=60.0).id
    # The same call again (its first reply lost): the same execution, the same arguments.
    again = client.submit("three_steps", 1, debounce_key="k", debounce=60.0).id
    assert again == first
    assert [(r[0], r[2]) for r in executions(pg_dsn, schema)] == [(first, [1])]
    # With an idempotency key too, a resend answers what the first call returned.
    keyed = client.submit("three_steps", 2, debounce_key="k", debounce=60.0,
                          idempotency_key="idem-1").id
    assert keyed == first
    assert client.submit("three_steps", 2, debounce_key="k", debounce=60.0,
                         idempotency_key="idem-1").id == first


def test_the_key_of_another_workflow_is_refused_while_pending(pg_dsn: str,
                                                            schema: str) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=1)
    client.submit("three_steps", 1, debounce_key="shared", debounce=60.0)
    with pytest.raises(DuplicateExecution, match="pending for workflow three_steps"):
        client.submit("waiter", debounce_key="shared", debounce=60.0)
    assert len(executions(pg_dsn, schema)) == 1


@pytest.mark.parametrize(("kwargs", "error", "says"), [
    ({"debounce_key": "k"}, ConfigError, "both"),
    ({"debounce": 1.0}, ConfigError, "both"),
    ({"debounce_key": "k", "debounce": 0}, ConfigError, "positive"),
    ({"debounce_key": "k", "debounce": -1}, ConfigError, "positive"),
    ({"debounce_key": "k", "debounce": float("nan")}, ConfigError, "positive"),
    ({"debounce_key": "k", "debounce": float("inf")}, ConfigError, "positive"),
    ({"debounce_key": "k", "debounce": True}, ConfigError, "positive"),
    ({"debounce_key": "k", "debounce": 5, "debounce_max": 1}, ConfigError, "at least"),
    ({"debounce_key": "k", "debounce": 5, "delay": 1}, ConfigError, "no dedup key, delay"),
    ({"debounce_key": "k", "debounce": 5, "dedup_key": "d"}, ConfigError, "no dedup key"),
    ({"debounce_key": "k\x00", "debounce": 5}, SerializationError, "NUL"),
    ({"debounce_key": "k\ud800", "debounce": 5}, SerializationError, "surrogate"),
    ({"debounce_key": "k" * 10_000, "debounce": 5}, SerializationError, "over the limit"),
    ({"debounce_key": "", "debounce": 5}, SerializationError, "empty"),
])
def test_the_client_refuses_a_bad_debounce_before_writing(
        pg_dsn: str, schema: str, kwargs: dict[str, Any], error: type[Exception],
        says: str) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    with pytest.raises(error, match=says):
        client.submit("three_steps", 1, **kwargs)
    assert executions(pg_dsn, schema) == []


@pytest.mark.parametrize(("key", "window", "most", "says"), [
    ("NULL", "5", "NULL", "debounce key and a window"),
    ("'k'", "NULL", "NULL", "debounce key and a window"),
    ("'k'", "'NaN'", "NULL", "positive"),
    ("'k'", "'Infinity'", "NULL", "positive"),
    ("'k'", "-1", "NULL", "positive"),
    ("'k'", "5", "4", "at least debounce"),
    ("repeat('k', 100000)", "5", "NULL", "debounce key"),
    ("$$' OR 1=1 --$$", "5", "NULL", None),  # an SQL-looking key is a key like any other
])
def test_the_sql_function_checks_debounce_before_writing(
        pg_dsn: str, schema: str, key: str, window: str, most: str, says: str | None) -> None:
    call = pgsql.SQL(
        "SELECT {}.submit('three_steps', '[1]', p_debounce_key => " + key + ", "
        "p_debounce_s => " + window + "::float8, p_debounce_max_s => " + most + "::float8)"
    ).format(pgsql.Identifier(schema))
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        if says is None:
            assert conn.execute(call).fetchone() is not None
            assert len(executions(pg_dsn, schema)) == 1
            return
        with pytest.raises(psycopg.Error, match=says):
            conn.execute(call)
    assert executions(pg_dsn, schema) == []




def test_in_a_namespace_a_keys_submits_meet_in_one_bucket(pg_dsn: str, namespace: str) -> None:
    ids = set()
    for _ in range(5):  # a client each time: nothing cached decides where the key goes
        client = SyncClient(pg_dsn, schema=namespace, pool_size=0)
        ids.add(client.submit("three_steps", 1, debounce_key="spread", debounce=60.0).id)
    assert len(ids) == 1
    with pytest.raises(ConfigError, match="not both"):
        SyncClient(pg_dsn, schema=namespace, pool_size=0).submit(
            "three_steps", 1, debounce_key="spread", debounce=60.0, idempotency_key="i")


def test_the_cli_and_the_http_api_debounce_and_refuse_bad_input(
        pg_dsn: str, schema: str, tmp_path: Path) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "kestrel", "submit", "three_steps",
                               *args, "--allow-unknown", "--dsn", pg_dsn, "--schema", schema],
                              capture_output=True, text=True, cwd=ROOT, timeout=60)

    one = cli("--args", "[1]", "--debounce-key", "cli", "--debounce", "60")
    two = cli("--args", "[2]", "--debounce-key", "cli", "--debounce", "60")
    assert one.returncode == two.returncode == 0, (one.stderr, two.stderr)
    assert one.stdout == two.stdout
    bad = cli("--debounce-key", "cli", "--debounce", "0")
    assert bad.returncode == 1 and "positive" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
    bad = cli("--debounce", "5")
    assert bad.returncode == 1 and "both" in bad.stderr

    token = make_token(pg_dsn, schema, "sub", "submit")
    with serve_process(pg_dsn, schema, port=free_port(), log=tmp_path / "serve.log",
                       app="tests.apps.ledger_app") as api:
        api.token = token
        path = "/api/v1/workflows/three_steps/submit"
        first = api.post(path, {"args": [3], "debounce_key": "http", "debounce": 60})
        second = api.post(path, {"args": [4], "debounce_key": "http", "debounce": 60})
        assert (first.status, second.status) == (201, 200), (first.body, second.body)
        assert first.json()["id"] == second.json()["id"]
        for body, says in [
            ({"debounce_key": "http"}, "both"),
            ({"debounce_key": "http", "debounce": "5"}, "number"),
            ({"debounce_key": "http", "debounce": True}, "number"),
            ({"debounce_key": "h\x00", "debounce": 5}, "NUL"),
            ({"debounce_key": 7, "debounce": 5}, "string"),
            ({"debounce_key": "http", "debounce": 5, "debounce_max": 1}, "at least"),
            ({"debounce_key": "http", "debounce": 5, "delay": 1}, "no dedup key, delay"),
        ]:
            got = api.post(path, {"args": [5], **body})
            assert got.status == 400, (body, got.status, got.body)
            assert says.lower() in json.dumps(got.json()).lower(), (body, got.body)
    rows = executions(pg_dsn, schema)
    assert sorted(r[2] for r in rows) == [[2], [4]]


def test_a_timeout_counts_from_the_start_the_submits_pushed_back(pg_dsn: str,
                                                                schema: str) -> None:
    # Pushed back past the first submit's timeout, it still runs: the deadline moves with
    # its start (the sweeper failed it, never run, "workflow deadline passed").
    client = SyncClient(pg_dsn, schema=schema, pool_size=1)
    first = client.submit("three_steps", 0, debounce_key="t", debounce=0.4, debounce_max=3.0,
                          timeout=1.0).id
    worker = threading.Thread(target=run_worker_until, args=(
        pg_dsn, config(schema), lambda: finished_count(pg_dsn, schema) >= 1), kwargs={
            "timeout": 30})
    worker.start()
    for n in range(1, 16):  # for 1.5 s, never quiet for 0.4 s
        assert client.submit("three_steps", n, debounce_key="t", debounce=0.4,
                             debounce_max=3.0, timeout=1.0).id == first
        time.sleep(0.1)
    worker.join()
    ran = client.get(first)
    assert ran.status.value == "completed", ran.error
    assert client.result(first, timeout=5) == app.model(15)

"""Bulk actions (issue 42, item 4): ``cancel``, ``retry`` and ``signal`` take ``list``'s
filters instead of an id, in the CLI, the client and the HTTP API.

``--dry-run`` counts and samples and changes nothing; the action runs in pages and reports
progress; a run stopped half way and run again with its key acts on nothing twice (each
waiter gets one signal, each execution one retry); a namespace's every bucket is covered;
hostile filters and keys are refused before anything is read or written."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql as pgsql

from kestrel import buckets
from kestrel.client import SyncClient
from kestrel.errors import ConfigError, SerializationError
from kestrel.types import Match
from tests.apps import ledger_app  # noqa: F401  (registers waiter, three_steps, raises)
from tests.helpers import ROOT, config, finished_count, run_worker_until
from tests.http_helpers import free_port, make_token, serve_process


def kestrel(dsn: str, schema: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kestrel", *args, "--dsn", dsn, "--schema",
                           schema], capture_output=True, text=True, cwd=ROOT, timeout=120)


def statuses(dsn: str, schema: str, ids: list[uuid.UUID]) -> dict[str, int]:
    client = SyncClient(dsn, schema=schema, pool_size=0)
    seen: dict[str, int] = {}
    for eid in ids:
        status = client.get(eid).status.value
        seen[status] = seen.get(status, 0) + 1
    return seen


def signals_per_execution(dsn: str, schema: str) -> dict[Any, int]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(pgsql.SQL(
            "SELECT execution_id, count(*) FROM {}.signals WHERE name = 'go' "
            "GROUP BY execution_id").format(pgsql.Identifier(schema))).fetchall()
    return dict(rows)


@pytest.fixture
def waiters(pg_dsn: str, schema: str) -> list[uuid.UUID]:
    """25 queued waiters (they wait for signal "go" once they run) and 3 other executions."""
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    made = [client.submit("waiter").id for _ in range(25)]
    for n in range(3):
        client.submit("three_steps", n)
    return made


def test_a_dry_run_counts_and_samples_and_changes_nothing(
        pg_dsn: str, schema: str, waiters: list[uuid.UUID]) -> None:
    out = kestrel(pg_dsn, schema, "cancel", "--workflow", "waiter", "--dry-run", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["matched"] == 25 and data["acted"] == 0 and data["dry_run"] is True
    assert len(data["sample"]) == 10 and {uuid.UUID(i) for i in data["sample"]} <= set(waiters)
    assert statuses(pg_dsn, schema, waiters) == {"queued": 25}
    table = kestrel(pg_dsn, schema, "cancel", "--workflow", "waiter", "--dry-run")
    assert "would act on up to 25 execution(s)" in table.stdout and "… and 15 more" in table.stdout


def test_a_bulk_cancel_runs_in_pages_and_a_second_run_acts_on_nothing_again(
        pg_dsn: str, schema: str, waiters: list[uuid.UUID]) -> None:
    out = kestrel(pg_dsn, schema, "cancel", "--workflow", "waiter", "--page-size", "7")
    assert out.returncode == 0, out.stderr
    assert "cancel: 25 matched, 25 cancelled" in out.stdout
    key = out.stdout.split("(key ")[1].split(")")[0]
    progress = [line for line in out.stderr.splitlines() if "matched so far" in line]
    assert len(progress) == 4 and progress[-1].startswith("cancel: 25 matched so far")
    assert f"run again with --key {key}" in out.stderr
    assert statuses(pg_dsn, schema, waiters) == {"cancelled": 25}
    # The three others are untouched.
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    assert [e.status.value for e in client.list(workflow="three_steps")] == ["queued"] * 3

    again = kestrel(pg_dsn, schema, "cancel", "--workflow", "waiter", "--key", key, "--json")
    data = json.loads(again.stdout)
    assert (data["matched"], data["acted"], data["skipped"]) == (
        25, 0, {"already cancelled": 25})


def test_a_retry_and_a_signal_stopped_half_way_and_run_again_act_on_each_once(
        pg_dsn: str, schema: str, waiters: list[uuid.UUID]) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=1)
    for eid in waiters:
        client.cancel(eid)
    cancelled = Match(workflow="waiter", status="cancelled")
    first = client.bulk("retry", cancelled, key="r1", page_size=5, pages=2)
    assert (first.matched, first.acted) == (10, 10) and first.cursor is not None
    rest = client.bulk("retry", cancelled, key="r1")  # from the start, as after a Ctrl-C
    assert (rest.matched, rest.acted) == (15, 15)
    assert statuses(pg_dsn, schema, waiters) == {"queued": 25}
    # Each was retried once, under its own key of the run.
    with psycopg.connect(pg_dsn) as conn:
        keys = conn.execute(pgsql.SQL(
            "SELECT count(*), count(DISTINCT execution_id) FROM {}.idempotency_keys "
            "WHERE idempotency_key LIKE 'bulk:r1:%'").format(pgsql.Identifier(schema))
        ).fetchone()
    assert keys == (25, 25)

    # A signal goes only to those waiting for it: queued ones would keep it for a later
    # wait of that name, one nobody chose.
    queued = Match(workflow="waiter", status="queued")
    early = client.bulk("signal", queued, signal="go", payload={"n": 1}, key="s0")
    assert (early.acted, early.skipped) == (0, {"not waiting for signal 'go'": 25})
    assert signals_per_execution(pg_dsn, schema) == {}
    # Run, they park on their wait; the three others run to the end.
    run_worker_until(pg_dsn, config(schema), lambda: statuses(
        pg_dsn, schema, waiters) == {"waiting": 25} and finished_count(pg_dsn, schema) >= 3,
        timeout=60)
    waiting = Match(workflow="waiter", status="waiting")
    other = client.bulk("signal", waiting, signal="stop", key="s2")
    assert (other.acted, other.skipped) == (0, {"not waiting for signal 'stop'": 25})
    half = client.bulk("signal", waiting, signal="go", payload={"n": 1}, key="s1",
                       page_size=5, pages=1)
    assert half.acted == 5
    whole = client.bulk("signal", waiting, signal="go", payload={"n": 1}, key="s1")
    assert (whole.matched, whole.acted, whole.skipped) == (
        25, 20, {"signalled under this key already": 5})
    assert set(signals_per_execution(pg_dsn, schema).values()) == {1}
    assert len(signals_per_execution(pg_dsn, schema)) == 25

    # The waiters take their one signal and finish with it.
    run_worker_until(pg_dsn, config(schema),
                     lambda: finished_count(pg_dsn, schema) >= 28, timeout=60)
    assert {repr(client.result(eid, timeout=5)) for eid in waiters} == {"{'n': 1}"}


def test_a_bulk_cancel_leaves_a_child_to_its_matching_parent(pg_dsn: str, schema: str) -> None:
    # Cancelled first (newest first: a child is newer), a child would wake its parent, which
    # could react before its own turn; a parent's cancel takes its children at once.
    client = SyncClient(pg_dsn, schema=schema, pool_size=1)
    parents = [client.submit("parent_of_waiter").id for _ in range(3)]
    lone = client.submit("waiter").id
    run_worker_until(pg_dsn, config(schema), lambda: len(client.list(
        status="waiting", limit=100)) == 7, timeout=60)
    children = [e.id for e in client.list(workflow="waiter", limit=100) if e.id != lone]
    out = kestrel(pg_dsn, schema, "cancel", "--status", "waiting", "--json")
    data = json.loads(out.stdout)
    assert (data["matched"], data["acted"]) == (7, 4), data
    assert data["skipped"] == {"its parent matches too: cancelled with it": 3}
    assert statuses(pg_dsn, schema, [*parents, *children, lone]) == {"cancelled": 7}


def test_a_bulk_retry_passes_over_what_cannot_be_retried(pg_dsn: str, schema: str) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=1)
    failed = [client.submit("raises", f"boom {n}").id for n in range(3)]
    done = [client.submit("three_steps", n).id for n in range(2)]
    run_worker_until(pg_dsn, config(schema),
                     lambda: finished_count(pg_dsn, schema) >= 5, timeout=60)
    out = kestrel(pg_dsn, schema, "retry", "--since", "1h", "--key", "fix-1")
    assert out.returncode == 0, out.stderr
    assert "retry: 5 matched, 3 queued again (key fix-1)" in out.stdout
    assert "skipped 2: not failed, cancelled or quarantined" in out.stdout
    assert statuses(pg_dsn, schema, failed) == {"queued": 3}
    assert statuses(pg_dsn, schema, done) == {"completed": 2}




def test_a_bulk_action_on_a_namespace_covers_every_bucket(pg_dsn: str, namespace: str) -> None:
    client = SyncClient(pg_dsn, schema=namespace, pool_size=1)
    made = [client.submit("waiter").id for _ in range(30)]
    assert len({buckets.bucket_of(eid, 3) for eid in made}) > 1
    dry = kestrel(pg_dsn, namespace, "cancel", "--status", "queued", "--dry-run", "--json")
    assert json.loads(dry.stdout)["matched"] == 30
    out = kestrel(pg_dsn, namespace, "cancel", "--status", "queued", "--page-size", "4")
    assert out.returncode == 0, out.stderr
    assert "cancel: 30 matched, 30 cancelled" in out.stdout
    assert statuses(pg_dsn, namespace, made) == {"cancelled": 30}


# (A NUL cannot reach a command line: the client and HTTP tests send it.) A lone surrogate
# does: the byte 0x80 the test's argv carries reads back as one (surrogateescape).
@pytest.mark.parametrize(("args", "says"), [
    (["--workflow", "waiter", "--key", "k\udc80"], "surrogate"),
    (["--workflow", "w\udcff"], "surrogate"),
    (["--status", "bogus"], "unknown status 'bogus'"),
    (["--status", "queued", "--key", ""], "must not be empty"),
    (["--status", "queued", "--key", "k" * 201], "1 to 200 characters"),
    (["--status", "queued", "--page-size", "0"], "--page-size must be 1 to 1000"),
    (["--since", "1h", "--until", "2h"], "must come before until"),
    (["--until", "yesterday"], "--until 'yesterday'"),
    (["--patch", "p", "--without-patch", "p"], "exclude each other"),
    (["--app-version", "x" * 300], "--app-version"),
    (["00000000-0000-0000-0000-000000000000", "--status", "queued"], "not both"),
    ([], "give an execution id, or filters"),
])
def test_hostile_filters_and_keys_are_refused_before_anything_is_done(
        pg_dsn: str, schema: str, waiters: list[uuid.UUID], args: list[str],
        says: str) -> None:
    out = kestrel(pg_dsn, schema, "cancel", *args)
    assert out.returncode != 0
    assert says.lower() in out.stderr.lower(), out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert statuses(pg_dsn, schema, waiters) == {"queued": 25}


def test_filters_that_match_nothing_or_look_like_sql_act_on_nothing(
        pg_dsn: str, schema: str, waiters: list[uuid.UUID]) -> None:
    for workflow in ("nobody", "waiter' OR '1'='1", "%"):
        out = kestrel(pg_dsn, schema, "cancel", "--workflow", workflow, "--json")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["matched"] == 0
    assert statuses(pg_dsn, schema, waiters) == {"queued": 25}


def test_the_client_refuses_before_reading(pg_dsn: str, schema: str) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    with pytest.raises(ConfigError, match="at least one filter"):
        client.bulk("cancel", Match())
    with pytest.raises(ConfigError, match="unknown bulk action"):
        client.bulk("delete", Match(status="queued"))
    with pytest.raises(ConfigError, match="signal's name"):
        client.bulk("signal", Match(status="queued"))
    with pytest.raises(SerializationError):
        client.bulk("signal", Match(status="queued"), signal="go", payload="\x00")
    with pytest.raises(SerializationError):
        client.bulk("signal", Match(status="queued"), signal="g\ud800")
    with pytest.raises(SerializationError):
        client.bulk("cancel", Match(workflow="w\x00"))


def test_the_http_api_pages_a_bulk_action_and_a_resent_page_acts_on_nothing_twice(
        pg_dsn: str, schema: str, waiters: list[uuid.UUID], tmp_path: Path) -> None:
    operator = make_token(pg_dsn, schema, "ops", "read,operate")
    reader = make_token(pg_dsn, schema, "rita", "read")
    path = "/api/v1/executions/bulk"
    with serve_process(pg_dsn, schema, port=free_port(), log=tmp_path / "serve.log",
                       app="tests.apps.ledger_app") as api:
        api.token = operator
        body = {"action": "cancel", "filter": {"workflow": "waiter"}, "key": "ops-1",
                "page_size": 7}
        dry = api.post(path, {**body, "dry_run": True})
        assert dry.status == 200, dry.body
        assert dry.json()["matched"] == 25 and len(dry.json()["sample"]) == 10
        made = api.post(path, {k: v for k, v in body.items() if k != "key"} | {
            "dry_run": True})
        assert len(made.json()["key"]) == 16  # made for the caller, to send with each page
        assert statuses(pg_dsn, schema, waiters) == {"queued": 25}

        acted, cursor, requests = 0, None, 0
        while True:
            page = api.post(path, {**body, **({"cursor": cursor} if cursor else {})})
            assert page.status == 200, page.body
            acted += page.json()["acted"]
            assert page.json()["key"] == "ops-1"
            cursor, requests = page.json()["next_cursor"], requests + 1
            if cursor is None:
                break
        assert (acted, requests) == (25, 4)
        assert statuses(pg_dsn, schema, waiters) == {"cancelled": 25}
        resent = api.post(path, body)
        assert resent.json()["acted"] == 0
        assert resent.json()["skipped"] == {"already cancelled": 7}

        for bad, says in [
            ({"action": "cancel", "filter": {}}, "at least one filter"),
            ({"action": "cancel"}, "filter must be a JSON object"),
            ({"action": "drop", "filter": {"status": "queued"}}, "action must be"),
            ({**body, "surprise": 1}, "unknown field"),
            ({**body, "filter": {"workflow": "w\x00"}}, "NUL"),
            ({**body, "filter": {"status": 3}}, "must be a string"),
            ({**body, "key": "k" * 129}, "1 to 128"),
            ({**body, "cursor": "'; DROP TABLE x; --"}, "cursor"),
            ({**body, "page_size": True}, "page_size"),
            ({**body, "action": "signal"}, "signal"),
            ({**body, "signal": {"name": "go"}}, "only for the signal action"),
            ({**body, "filter": {"since": "tomorrow"}}, "since"),
        ]:
            got = api.post(path, bad)
            assert got.status == 400, (bad, got.status, got.body)
            assert says.lower() in got.body.decode().lower(), (bad, got.body)
        assert api.post(path, body, token=reader).status == 403
        assert api.post(path, body, token=None).status == 401


def test_the_web_ui_offers_select_all_with_a_count_first_and_acts_once(
        pg_dsn: str, schema: str, waiters: list[uuid.UUID], tmp_path: Path) -> None:
    from kestrel.http.requests import encode_cursor
    from tests.ui_helpers import Browserless

    operator = make_token(pg_dsn, schema, "ops", "read,operate")
    reader = make_token(pg_dsn, schema, "rita", "read")
    with serve_process(pg_dsn, schema, port=free_port(), log=tmp_path / "serve.log",
                       app="tests.apps.ledger_app") as api:
        ops, rita = Browserless(api), Browserless(api)
        ops.login(operator)
        rita.login(reader)
        listed = ops.get("/ui/?workflow=waiter").body.decode()
        assert 'href="/ui/bulk/cancel?workflow=waiter"' in listed
        assert "select-all" not in rita.get("/ui/?workflow=waiter").body.decode()
        assert "select-all" not in ops.get("/ui/").body.decode()  # no filter: not offered

        page = ops.get("/ui/bulk/cancel?workflow=waiter")
        assert page.status == 200, page.body
        assert "<strong>25</strong> execution(s) match now" in page.body.decode()
        assert statuses(pg_dsn, schema, waiters) == {"queued": 25}  # counting changed nothing
        form = {"csrf": ops.csrf(page), "key": "f" * 32, "workflow": "waiter"}

        # A form from elsewhere (no CSRF token) or from a reader is refused, nothing done.
        assert ops.post_form("/ui/bulk/cancel", {**form, "csrf": "0" * 64}).status == 403
        assert rita.get("/ui/bulk/cancel?workflow=waiter").status == 403
        assert rita.post_form("/ui/bulk/cancel", form).status == 403
        assert ops.get("/ui/bulk/cancel").status == 400  # no filter
        assert ops.get("/ui/bulk/drop?workflow=waiter").status == 404
        assert ops.get("/ui/bulk/cancel?workflow=w%00x").status == 400
        assert statuses(pg_dsn, schema, waiters) == {"queued": 25}

        # From a cursor (the form that goes on): only the executions after it.
        client = SyncClient(pg_dsn, schema=schema, pool_size=0)
        newest = sorted(((e.created_at, e.id) for e in client.list(workflow="waiter",
                                                                  limit=100)), reverse=True)
        cursor = encode_cursor(newest[9][0], str(newest[9][1]))
        later = ops.post_form("/ui/bulk/cancel", {**form, "cursor": cursor})
        assert later.status == 200, later.body
        assert "<strong>15</strong> cancelled of 15 matched" in later.body.decode()
        done = ops.post_form("/ui/bulk/cancel", form)
        assert "<strong>10</strong> cancelled of 25 matched" in done.body.decode()
        assert "15 passed over: already cancelled" in done.body.decode()
        assert "Every page was done." in done.body.decode()
        assert statuses(pg_dsn, schema, waiters) == {"cancelled": 25}
        # Sent again (a reload, a double click): nothing acted on twice.
        again = ops.post_form("/ui/bulk/cancel", form).body.decode()
        assert "<strong>0</strong> cancelled of 25 matched" in again

        # Signal all with a name and payload from the form.
        retried = ops.post_form("/ui/bulk/retry", {**form, "key": "r" * 32})
        assert "<strong>25</strong> queued again" in retried.body.decode()
        sig = {**form, "key": "s" * 32, "status": "queued", "name": "go",
               "payload": '{"via": "ui"}'}
        signalled = ops.post_form("/ui/bulk/signal", sig).body.decode()
        # Queued, none waits for it: none is sent (it would wait for a later wait).
        assert "<strong>0</strong> signalled" in signalled
        assert "25 passed over: not waiting for signal &#39;go&#39;" in signalled
        bad = ops.post_form("/ui/bulk/signal", {**sig, "payload": "{not json"})
        assert bad.status == 400
        assert signals_per_execution(pg_dsn, schema) == {}

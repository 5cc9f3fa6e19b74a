"""The JSON API against a real ``kestrel-runtime --http-port`` (supervisor, workers and the
HTTP child process) and a real PostgreSQL; through PgBouncer too (KESTREL_TEST_VIA)."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql as pgsql

from tests.helpers import q, q1, wait_until
from tests.http_helpers import Api, free_port, http_runtime, make_token

API = "/api/v1"


@pytest.fixture(scope="module")
def server(pg_dsn: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One schema and one runtime for the module: executions are independent."""
    from kestrel.migrate import migrate

    schema = f"t_{uuid.uuid4().hex[:12]}"
    migrate(pg_dsn, schema)
    tokens = {scope: make_token(pg_dsn, schema, f"t-{scope}", scope)
              for scope in ("read", "operate", "submit")}
    tokens["all"] = make_token(pg_dsn, schema, "t-all", "read,operate,submit")
    log = tmp_path_factory.mktemp("http") / "rt.log"
    with http_runtime(pg_dsn, schema, port=free_port(), log=log, procs=2) as api:
        api.token = tokens["all"]
        yield {"api": api, "schema": schema, "tokens": tokens, "dsn": pg_dsn, "log": log}
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(pgsql.SQL("DROP SCHEMA {} CASCADE").format(pgsql.Identifier(schema)))


def submit(api: Api, workflow: str, *args: Any, key: str | None = None,
           **extra: Any) -> str:
    reply = api.post(f"{API}/workflows/{workflow}/submit", {"args": list(args), **extra},
                     headers={"Idempotency-Key": key} if key else None)
    assert reply.status in (200, 201), reply.body
    return str(reply.json()["id"])


def finished(api: Api, eid: str, status: str = "completed") -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        ex: dict[str, Any] = api.get(f"{API}/executions/{eid}").json()
        return ex if ex["status"] == status else None

    return wait_until(done, timeout=60, what=f"{eid} {status}")  # type: ignore[no-any-return]


def test_submit_runs_to_completion_and_the_page_shows_its_timeline(server: dict[str, Any],
                                                                   ) -> None:
    api: Api = server["api"]
    eid = submit(api, "http.steps", 5)
    ex = finished(api, eid)
    assert ex["result"] == 5 * 2 + 2
    names = [s["name"] for s in ex["steps"]]
    assert names[0] == "http.double" and names.count("http.double") == 2, names
    assert all(s["duration_ms"] >= 0 and s["offset_ms"] >= 0 for s in ex["steps"])
    assert ex["events"] == [{"key": "stage", "value": "doubled",
                             "updated_at": ex["events"][0]["updated_at"]}]
    assert len(ex["children"]) == 1 and ex["children"][0]["workflow"] == "http.echo"
    assert ex["children"][0]["status"] == "completed"
    assert ex["app_version"]  # stamped by the claim (versions), shown here and in lists
    listed = api.get(f"{API}/executions?workflow=http.steps&limit=500").json()["executions"]
    assert next(e for e in listed if e["id"] == eid)["app_version"] == ex["app_version"]
    child = api.get(f"{API}/executions/{ex['children'][0]['id']}").json()
    assert child["parent_id"] == eid and child["result"] == 10


def test_idempotency_key_header_returns_the_first_execution(server: dict[str, Any]) -> None:
    api: Api = server["api"]
    key = f"k-{uuid.uuid4()}"
    first = submit(api, "http.echo", {"a": 1}, key=key)
    assert submit(api, "http.echo", {"a": 1}, key=key) == first
    other = api.post(f"{API}/workflows/http.echo/submit", {"args": [{"a": 2}]},
                     headers={"Idempotency-Key": key})
    assert other.status == 409 and "already used" in other.json()["error"]
    assert q1(server["dsn"], server["schema"],
              "SELECT count(*) FROM {s}.idempotency_keys WHERE idempotency_key LIKE %s",
              ["http:%:" + key]) == 1


def test_an_idempotency_key_belongs_to_the_token_that_sent_it(server: dict[str, Any]) -> None:
    """Issue 41 row 8: keys were shared by every token: a submit-only token sending a key
    another caller had used got a 409 naming that caller's execution, or that execution back
    as its own with the same body, and could squat keys others would use. Scoped to the
    token, each caller's key is its own."""
    api: Api = server["api"]
    key = f"shared-{uuid.uuid4()}"
    mine = submit(api, "http.echo", {"owner": "all"}, key=key)
    other = Api(api.port, token=server["tokens"]["submit"])
    # The same body and key from another token: its own execution, not the first one.
    theirs = other.post(f"{API}/workflows/http.echo/submit", {"args": [{"owner": "all"}]},
                        headers={"Idempotency-Key": key})
    assert theirs.status == 201 and theirs.json()["id"] != mine
    # Another body under that key: no 409, nothing about the first caller's execution.
    squat = other.post(f"{API}/workflows/http.echo/submit", {"args": [{"owner": "x"}]},
                       headers={"Idempotency-Key": f"new-{key}"})
    assert squat.status == 201 and mine not in squat.body.decode()
    # And the first token's key still answers the first token with its own execution.
    assert submit(api, "http.echo", {"owner": "all"}, key=key) == mine
    again = other.post(f"{API}/workflows/http.echo/submit", {"args": [{"owner": "y"}]},
                       headers={"Idempotency-Key": key})
    assert again.status == 409 and mine not in again.body.decode()


def test_a_waiting_execution_shows_what_it_waits_for_and_a_signal_completes_it(
        server: dict[str, Any]) -> None:
    api: Api = server["api"]
    eid = submit(api, "http.approval", {"alert": "disk full"}, timeout=600)
    ex = finished(api, eid, "waiting")
    assert ex["waiting"]["kind"] == "signal" and ex["waiting"]["signal"] == "approval"
    assert ex["waiting"]["until"] is not None and ex["deadline"] is not None
    assert ex["pending_signals"] == []
    sent = api.post(f"{API}/executions/{eid}/signal",
                    {"name": "approval", "payload": {"approved": True, "by": "ana"}},
                    headers={"Idempotency-Key": "press-1"})
    assert sent.status == 200 and sent.json()["delivered"] is True
    again = api.post(f"{API}/executions/{eid}/signal",
                     {"name": "approval", "payload": {"approved": True, "by": "ana"}},
                     headers={"Idempotency-Key": "press-1"})
    assert again.json()["delivered"] is False
    assert finished(api, eid)["result"] == {"outcome": "approved", "by": "ana"}
    # A retry of the request that finished it is still "already delivered", not an error.
    replay = api.post(f"{API}/executions/{eid}/signal",
                      {"name": "approval", "payload": {"approved": True, "by": "ana"}},
                      headers={"Idempotency-Key": "press-1"})
    assert replay.status == 200 and replay.json()["delivered"] is False
    late = api.post(f"{API}/executions/{eid}/signal", {"name": "approval"},
                    headers={"Idempotency-Key": "press-2"})
    assert late.status == 409 and "already finished" in late.json()["error"]


def test_cancel_retry_and_fork(server: dict[str, Any]) -> None:
    api: Api = server["api"]
    waiting = submit(api, "http.approval", {})
    finished(api, waiting, "waiting")
    assert api.post(f"{API}/executions/{waiting}/cancel").json()["status"] == "cancelled"
    assert api.get(f"{API}/executions/{waiting}").json()["status"] == "cancelled"
    assert api.post(f"{API}/executions/{waiting}/retry").json()["status"] == "queued"
    finished(api, waiting, "waiting")
    api.post(f"{API}/executions/{waiting}/cancel")

    failing = submit(api, "http.fails")
    ex = finished(api, failing, "failed")
    assert ex["steps"][0]["error"]["message"] == "exploded on purpose"
    done = submit(api, "http.steps", 1)
    finished(api, done)
    forked = api.post(f"{API}/executions/{done}/fork", {"from_step": 1})
    assert forked.status == 201
    assert finished(api, forked.json()["id"])["result"] == 4
    refused = api.post(f"{API}/executions/{done}/retry")
    assert refused.status == 409 and "only failed" in refused.json()["error"]


def test_list_filters_and_keyset_pages_over_live_and_history(server: dict[str, Any]) -> None:
    api: Api = server["api"]
    queue = f"q{uuid.uuid4().hex[:8]}"
    # Unclaimed (no worker reads this queue) and finished ones, in one listing.
    live = [submit(api, "http.echo", i, queue=queue) for i in range(7)]
    done = [submit(api, "http.echo", i) for i in range(5)]
    for eid in done:
        finished(api, eid)
    seen: list[str] = []
    cursor = None
    while True:
        url = f"{API}/executions?queue={queue}&limit=3" + (f"&cursor={cursor}" if cursor
                                                            else "")
        page = api.get(url).json()
        seen += [e["id"] for e in page["executions"]]
        assert all(e["queue"] == queue and e["status"] == "queued"
                   for e in page["executions"])
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == list(reversed(live))
    completed = api.get(f"{API}/executions?workflow=http.echo&status=completed&limit=500")
    ids = {e["id"] for e in completed.json()["executions"]}
    assert set(done) <= ids and not set(live) & ids
    since = api.get(f"{API}/executions?since=2999-01-01T00:00:00Z").json()
    assert since == {"executions": [], "next_cursor": None}
    until = api.get(f"{API}/executions?until=2000-01-01T00:00:00&limit=5").json()
    assert until["executions"] == []
    for eid in live:
        api.post(f"{API}/executions/{eid}/cancel")


def test_queues_schedules_workflows_and_openapi(server: dict[str, Any]) -> None:
    api: Api = server["api"]
    queue = f"q{uuid.uuid4().hex[:8]}"
    ids = [submit(api, "http.echo", i, queue=queue) for i in range(3)]
    q(server["dsn"], server["schema"], "INSERT INTO {s}.queue_limits (queue, concurrency, "
      "rate, period) VALUES (%s, 5, 60, interval '60 seconds')", [queue])
    q(server["dsn"], server["schema"], "INSERT INTO {s}.schedules (name, cron, workflow, "
      "last_tick) VALUES ('nightly', '0 3 * * *', 'http.echo', now())")
    queues = {x["queue"]: x for x in api.get(f"{API}/queues").json()["queues"]}
    assert queues[queue]["depth"] == {"queued": 3}
    assert queues[queue]["limits"] == {"concurrency": 5, "rate": 60, "period_s": 60.0,
                                        "per_key": None}
    assert queues[queue]["oldest_queued_age_s"] >= 0
    schedules = api.get(f"{API}/schedules").json()["schedules"]
    assert [(s["name"], s["cron"], s["workflow"]) for s in schedules] == [
        ("nightly", "0 3 * * *", "http.echo")]
    assert "http.approval" in api.get(f"{API}/workflows").json()["workflows"]
    doc = api.get(f"{API}/openapi.json", token=None).json()
    assert doc["openapi"].startswith("3.")
    assert doc["paths"][f"{API}/executions/{{id}}/signal"]["post"]["security"] == [
        {"bearer": ["operate"]}]
    assert f"{API}/workflows/{{workflow}}/submit" in doc["paths"]
    for eid in ids:
        api.post(f"{API}/executions/{eid}/cancel")


def test_each_route_needs_its_scope_and_a_refusal_writes_nothing(server: dict[str, Any],
                                                                  ) -> None:
    api: Api = server["api"]
    tokens = server["tokens"]
    count = "SELECT count(*) FROM {s}.executions"
    before = q1(server["dsn"], server["schema"], count)
    target = submit(api, "http.approval", {})
    finished(api, target, "waiting")
    before += 1
    routes = [("GET", f"{API}/executions", "read"), ("GET", f"{API}/queues", "read"),
              ("GET", f"{API}/executions/{target}", "read"),
              ("POST", f"{API}/workflows/http.echo/submit", "submit"),
              ("POST", f"{API}/executions/{target}/signal", "operate"),
              ("POST", f"{API}/executions/{target}/fork", "operate"),
              ("POST", f"{API}/executions/{target}/cancel", "operate")]
    for method, path, scope in routes:
        body = {"name": "nope"} if path.endswith("signal") else (
            {"from_step": 0} if path.endswith("fork") else None)
        for name, token in tokens.items():
            if name in (scope, "all"):
                continue
            reply = api.request(method, path, body, token=token)
            assert reply.status == 403, (method, path, name, reply.body)
            assert reply.json()["error"] == f"this token lacks the {scope!r} scope"
        assert api.request(method, path, body, token=None).status == 401
    assert q1(server["dsn"], server["schema"], count) == before
    assert api.get(f"{API}/executions/{target}").json()["pending_signals"] == []
    assert api.get(f"{API}/executions/{target}").json()["status"] == "waiting"
    api.post(f"{API}/executions/{target}/cancel")


def test_runtime_log_has_the_http_child(server: dict[str, Any]) -> None:
    text = Path(server["log"]).read_text()
    assert "started HTTP server" in text and "serving the HTTP API on http://127.0.0.1" in text


def test_a_killed_http_child_is_restarted_and_the_workers_never_notice(
        server: dict[str, Any]) -> None:
    """Last in the module: it kills the HTTP server the others use."""
    import signal

    import psutil

    api: Api = server["api"]

    def http_child() -> psutil.Process | None:
        for child in psutil.Process(api.proc.pid).children():
            try:
                if any(c.status == psutil.CONN_LISTEN and c.laddr.port == api.port
                       for c in child.net_connections("inet")):
                    return child
            except psutil.NoSuchProcess:
                continue
        return None

    old = wait_until(http_child, timeout=30, what="the HTTP child")
    workers = {p.pid for p in psutil.Process(api.proc.pid).children()} - {old.pid}
    assert len(workers) == 2
    old.send_signal(signal.SIGKILL)
    # Work submitted while the door is down still runs: the workers are another process.
    eid = str(q1(server["dsn"], server["schema"], "SELECT {s}.submit('http.steps', '[2]')"))
    new = wait_until(lambda: (c := http_child()) is not None and c.pid != old.pid and c,
                     timeout=60, what="a new HTTP child")
    assert finished(api, eid)["result"] == 6
    assert {p.pid for p in psutil.Process(api.proc.pid).children()} - {new.pid} == workers
    assert "HTTP server" in Path(server["log"]).read_text()
    assert re.search(r"HTTP server \d+ exited \(killed by SIGKILL\); restarting in [12]s",
                     Path(server["log"]).read_text())


def test_every_status_a_route_answers_is_in_the_openapi_document(
        server: dict[str, Any]) -> None:
    """Issue 41 row 11: the document left out answers the routes give (400 on GET
    …/executions/{id}, 401 on /hooks/{name}, 405, 503, 500). Each route is called the ways
    a client gets it wrong (no token, the wrong scope, the wrong method, a bad id, an unknown
    one, a bad body, too big a body, a conflict) and right; every status seen is one the
    document gives for that route."""
    api: Api = server["api"]
    tokens = server["tokens"]
    doc = api.get(f"{API}/openapi.json", token=None).json()
    done = submit(api, "http.echo", 1)
    finished(api, done)
    key = f"k-{uuid.uuid4()}"
    submit(api, "http.echo", 1, key=key)
    values = {"{id}": [done, str(uuid.uuid4()), "not-a-uuid"],
              "{workflow}": ["http.echo", "no.such.workflow"], "{name}": ["nope"]}
    bodies: list[Any] = [None, b"{oops", {"args": [1]}, {"name": "go"}, {"from_step": 0},
                         {"unknown": 1}, b"x" * (2 * 1024 * 1024)]
    seen: dict[tuple[str, str], set[int]] = {}

    def expand(path: str) -> list[str]:
        for slot, options in values.items():
            if slot in path:
                return [p for v in options for p in expand(path.replace(slot, v, 1))]
        return [path]

    for path, ops in doc["paths"].items():
        for method in ops:
            got = seen.setdefault((path, method), set())
            for url in expand(path):
                for token in (None, "bogus", *tokens.values()):
                    for body in bodies if method == "post" else [None]:
                        headers = {"Idempotency-Key": key} if method == "post" else None
                        reply = api.request(method.upper(), url, body, token=token,
                                            headers=headers)
                        got.add(reply.status)
                got.add(api.request("DELETE", url).status)
    for (path, method), statuses in seen.items():
        documented = {int(code) for code in doc["paths"][path][method]["responses"]}
        assert statuses <= documented, (method, path, sorted(statuses - documented))
    # The battery reached the refusals it is about, not only successes.
    assert {400, 401, 403, 404, 405, 409, 413} <= set().union(*seen.values())


def test_claims_count_every_claim_and_attempts_those_since_the_last_wait(
        server: dict[str, Any]) -> None:
    """Issue 43 item 10: the list said "claims": 0 for executions that ran and parked (it
    showed the attempts --max-attempts counts, which a clean wait resets). "claims" now
    counts every claim (the lease epoch), "attempts" those since the last wait."""
    api: Api = server["api"]
    eid = submit(api, "http.approval", {"alert": "claims"})

    def parked() -> dict[str, Any] | None:
        row = api.get(f"{API}/executions/{eid}").json()
        return row if row["status"] == "waiting" else None

    one = wait_until(parked, timeout=60, what="the approval to park")
    assert (one["claims"], one["attempts"]) == (1, 0)
    listed = [r for r in api.get(f"{API}/executions?workflow=http.approval").json()[
        "executions"] if r["id"] == eid]
    assert [(r["claims"], r["attempts"]) for r in listed] == [(1, 0)]
    api.post(f"{API}/executions/{eid}/cancel")

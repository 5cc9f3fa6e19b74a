"""The HTTP door's security checks (FAULTS S1, S2, S4, S5) and hostile input at every field:
each bad request gets a 4xx with a one-line JSON reason and writes nothing."""

from __future__ import annotations

import json
import ssl
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psutil
import psycopg
import pytest
from psycopg import sql as pgsql

from tests.helpers import ROOT, q1, stop_runtime, wait_until
from tests.http_helpers import APP, Api, free_port, http_runtime, make_token
from tests.integration.test_security import _tls_files, as_role

API = "/api/v1"
CAP = 4096
CANARY = "CANARY-" + uuid.uuid4().hex


@pytest.fixture(scope="module")
def server(pg_dsn: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from kestrel.migrate import migrate

    schema = f"t_{uuid.uuid4().hex[:12]}"
    migrate(pg_dsn, schema)
    folder = tmp_path_factory.mktemp("sec")
    config = folder / "k.toml"
    config.write_text('[hooks.alerts]\nworkflow = "http.echo"\nformat = "hmac"\n'
                      'secret_env = "T_HOOK_SECRET"\n')
    token = make_token(pg_dsn, schema, "sec", "read,operate,submit")
    metrics_port = free_port()
    with http_runtime(pg_dsn, schema, port=free_port(), log=folder / "rt.log",
                      env={"T_HOOK_SECRET": CANARY + "-hook-secret"},
                      args=["--config", str(config), "--log-level", "debug",
                            "--http-max-body-bytes", str(CAP),
                            "--metrics-port", str(metrics_port)]) as api:
        api.token = token
        yield {"api": api, "schema": schema, "dsn": pg_dsn, "log": folder / "rt.log",
               "token": token, "metrics_port": metrics_port}
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(pgsql.SQL("DROP SCHEMA {} CASCADE").format(pgsql.Identifier(schema)))


def written(server: dict[str, Any]) -> tuple[int, int, int]:
    """Executions, signals and idempotency keys: what a refused request must not add."""
    return tuple(int(q1(server["dsn"], server["schema"], f"SELECT count(*) FROM {{s}}.{t}"))
                 for t in ("executions", "signals", "idempotency_keys"))  # type: ignore[return-value]


def refused(reply: Any, status: int | tuple[int, ...]) -> str:
    statuses = (status,) if isinstance(status, int) else status
    assert reply.status in statuses, (reply.status, reply.body[:300])
    text = reply.body.decode("ascii")  # escaped: never raw hostile bytes
    assert text.count("\n") == 1 and text.endswith("\n"), text
    reason = json.loads(text)["error"]
    assert reason and "\n" not in reason
    return str(reason)


def waiting_execution(server: dict[str, Any]) -> str:
    api: Api = server["api"]
    eid = api.post(f"{API}/workflows/http.approval/submit", {"args": [{}]}).json()["id"]
    wait_until(lambda: api.get(f"{API}/executions/{eid}").json()["status"] == "waiting",
               timeout=60, what="the wait")
    return str(eid)


NUL = "a\u0000b"
SURROGATE_JSON = '{"args": ["\\ud800"]}'
DEEP = "[" * 1500 + "]" * 1500  # past the parser's 1024 levels, under the cap
SQLISH = "x'); DROP TABLE workflow_executions; --"


def test_hostile_submits_are_refused_and_write_nothing(server: dict[str, Any]) -> None:
    api: Api = server["api"]
    before = written(server)
    submit = f"{API}/workflows/http.echo/submit"
    cases: list[tuple[str, Any, dict[str, str] | None, int]] = [
        ("NUL in args", {"args": [NUL]}, None, 400),
        ("NUL in a key", {"args": [{NUL: 1}]}, None, 400),
        ("lone surrogate escape", SURROGATE_JSON, None, 400),
        ("deep nesting", '{"args": [' + DEEP + "]}", None, 400),
        ("integer beyond 64 bits", '{"args": [123456789012345678901234567890]}', None, 400),
        ("1e400", '{"args": [1e400]}', None, 400),
        ("malformed", '{"args": [1,', None, 400),
        ("not utf-8", b'{"args": ["\xff"]}', None, 400),
        ("args not a list", {"args": {"a": 1}}, None, 400),
        ("unknown field", {"args": [], "workflow": "other"}, None, 400),
        ("bad queue", {"args": [], "queue": SQLISH}, None, 400),
        ("NUL queue", {"args": [], "queue": NUL}, None, 400),
        ("huge priority", {"args": [], "priority": 2**40}, None, 400),
        ("bool priority", {"args": [], "priority": True}, None, 400),
        ("negative timeout", {"args": [], "timeout": -1}, None, 400),
        ("string delay", {"args": [], "delay": "soon"}, None, 400),
        ("NUL dedup key", {"args": [], "dedup_key": NUL}, None, 400),
        ("huge idempotency key", {"args": []}, {"Idempotency-Key": "k" * 5000}, 400),
        ("body over the cap", {"args": ["x" * CAP]}, None, 413),
        ("a JSON string body", '"just a string"', None, 400),
    ]
    for what, body, headers, status in cases:
        reply = api.post(submit, body, headers={"Content-Type": "application/json",
                                                **(headers or {})})
        refused(reply, status)
        assert written(server) == before, what
    for name in (quote(SQLISH, safe=""), "no.such.workflow", "%00", "%ED%A0%80", "x" * 3000):
        refused(api.post(f"{API}/workflows/{name}/submit", {"args": []}), (400, 404))
    assert written(server) == before


def test_a_body_over_the_cap_is_cut_off_while_it_streams(server: dict[str, Any]) -> None:
    """Chunked, with no Content-Length to refuse it by: cut at the cap, still 413."""
    import http.client

    api: Api = server["api"]
    before = written(server)
    conn = http.client.HTTPConnection("127.0.0.1", api.port, timeout=30)
    try:
        chunks = (b"[" + b'"x",' * 1000 for _ in range(5))
        conn.request("POST", f"{API}/workflows/http.echo/submit", body=chunks,
                     headers={"Authorization": f"Bearer {server['token']}",
                              "Content-Type": "application/json"}, encode_chunked=True)
        reply = conn.getresponse()
        assert reply.status == 413
        assert "cap" in json.loads(reply.read())["error"]
    finally:
        conn.close()
    assert written(server) == before


def test_hostile_ids_signals_and_listings_are_refused(server: dict[str, Any]) -> None:
    api: Api = server["api"]
    target = waiting_execution(server)
    before = written(server)
    for eid in ("not-a-uuid", quote(SQLISH, safe=""), "%00", "1" * 500):
        refused(api.get(f"{API}/executions/{eid}"), (400, 404))  # already URL-encoded
        refused(api.post(f"{API}/executions/{eid}/cancel"), (400, 404))
    missing = str(uuid.uuid4())
    assert "no execution" in refused(api.get(f"{API}/executions/{missing}"), 404)
    refused(api.post(f"{API}/executions/{missing}/signal", {"name": "approval"}), 404)
    refused(api.post(f"{API}/executions/{missing}/retry"), 404)
    refused(api.post(f"{API}/executions/{missing}/fork", {"from_step": 0}), 404)
    signal = f"{API}/executions/{target}/signal"
    for body in ({"name": NUL}, {"name": "a" * 3000}, {"payload": 1}, {"name": 7},
                 {"name": "approval", "payload": NUL}, {"name": "approval", "extra": 1},
                 '{"name": "\\udfff"}', '{"name": "approval", "payload": ' + DEEP + "}", "[]"):
        refused(api.post(signal, body, headers={"Content-Type": "application/json"}), 400)
    refused(api.post(signal, {"name": "approval"}, headers={"Idempotency-Key": "k" * 3000}),
            400)
    fork = f"{API}/executions/{target}/fork"
    for body in ({"from_step": -1}, {"from_step": "1"}, {"from_step": 2**40},
                 {"from_step": True}, {}):
        refused(api.post(fork, body), 400)
    for query in ("status=exploded", "limit=0", "limit=abc", "limit=100000", "cursor=zzz",
                  "cursor=" + "A" * 300, "since=yesterday", "queue=%00",
                  "workflow=%00", f"queue={quote(SQLISH)}",
                  "colour=red",
                  # a surrogate's UTF-8 bytes (Starlette decodes them to U+FFFD): refused,
                  # as the web UI refuses them, not read as a name
                  "workflow=%ED%A0%80"):
        refused(api.get(f"{API}/executions?{query}"), 400)
    # An SQL-looking filter that is a valid name is just a name: no rows, nothing run.
    for query in ("workflow=x%27%3B%20DROP%20TABLE%20y%3B%20--",):
        odd = api.get(f"{API}/executions?{query}")
        assert odd.status == 200 and odd.json()["executions"] == [], query
    assert written(server) == before
    assert api.get(f"{API}/executions/{target}").json()["status"] == "waiting"
    api.post(f"{API}/executions/{target}/cancel")


def test_tokens_are_checked_before_anything_else(server: dict[str, Any]) -> None:
    api: Api = server["api"]
    before = written(server)
    real = server["token"]
    tid, secret = real[4:20], real[21:]
    forged = [None, "", "Bearer", f"kst_{tid}_{'A' * 43}", f"kst_{'0' * 16}_{secret}",
              real + "x", real.upper(), f"Basic {real}", f"kst_{tid}_{secret[:-1]}\u00e9",
              f"{SQLISH}"]
    for token in forged:
        headers = {} if token is None else {"Authorization": token if token.startswith(
            ("Basic", "Bearer")) else f"Bearer {token}"}
        try:
            reply = api.post(f"{API}/workflows/http.echo/submit", {"args": [1]},
                             headers=headers, token=None)
        except (ValueError, UnicodeEncodeError):
            continue  # http.client refuses to send a NUL or non-latin-1 header at all
        assert refused(reply, 401)
    # A NUL in a header never reaches the app: uvicorn's HTTP parser refuses the request.
    nul = api.post(f"{API}/workflows/http.echo/submit", {"args": [1]}, token=None,
                   headers={"Authorization": f"Bearer kst_{tid}_{NUL * 22}"})
    assert nul.status == 400
    assert written(server) == before


def test_revoked_token_is_refused_at_once(server: dict[str, Any]) -> None:
    from kestrel.cli import main

    api: Api = server["api"]
    token = make_token(server["dsn"], server["schema"], "short-lived", "read")
    assert api.get(f"{API}/queues", token=token).status == 200
    assert main(["token", "revoke", "short-lived", "--dsn", server["dsn"], "--schema",
                 server["schema"], "--log-level", "error"]) == 0
    assert "revoked" in refused(api.get(f"{API}/queues", token=token), 401)


def test_token_commands_store_only_a_hash(server: dict[str, Any],
                                          capsys: pytest.CaptureFixture[str]) -> None:
    from kestrel.cli import main

    args = ["--dsn", server["dsn"], "--schema", server["schema"], "--log-level", "error"]
    assert main(["token", "create", "--name", "ci-bot", "--scopes", "submit", *args]) == 0
    token = capsys.readouterr().out.splitlines()[0]
    assert token.startswith("kst_")
    stored = q1(server["dsn"], server["schema"], "SELECT row_to_json(t)::text FROM "
                "{s}.http_tokens t WHERE name = 'ci-bot'")
    assert token[21:] not in stored and token not in stored
    assert main(["token", "list", "--json", *args]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {"ci-bot", "sec"} <= {t["name"] for t in listed}
    assert token[21:] not in json.dumps(listed)
    for bad in (["token", "create", "--name", "ci-bot", "--scopes", "submit"],
                ["token", "create", "--name", "x", "--scopes", "admin"],
                ["token", "create", "--name", NUL, "--scopes", "read"],
                ["token", "create", "--name", SQLISH, "--scopes", "read"],
                ["token", "revoke", "nobody"], ["token", "revoke", NUL]):
        assert main([*bad, *args]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
    unmigrated = ["--dsn", server["dsn"], "--schema", "no_such_schema", "--log-level", "error"]
    assert main(["token", "list", *unmigrated]) == 1
    assert "run `kestrel-runtime migrate`" in capsys.readouterr().err


def test_s1_metrics_port_has_no_api_and_no_mutating_route(server: dict[str, Any]) -> None:
    port = server["metrics_port"]
    for method, path in (("POST", f"{API}/workflows/http.echo/submit"),
                         ("GET", f"{API}/executions"), ("POST", "/hooks/alerts"),
                         ("POST", "/metrics"), ("PUT", "/metrics"), ("DELETE", "/metrics")):
        req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method,
                                     data=b"{}" if method != "GET" else None,
                                     headers={"Authorization": f"Bearer {server['token']}"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=10)
        assert err.value.code in (404, 405, 501)


def test_s2_s5_no_token_secret_or_payload_in_logs_or_metrics(server: dict[str, Any]) -> None:
    """A canary in bodies, filters, headers, a hook's secret and a failing request; then
    the runtime's log (at debug) and /metrics hold none of it, and no id is a label."""
    import hashlib
    import hmac

    api: Api = server["api"]
    eid = api.post(f"{API}/workflows/http.echo/submit", {"args": [{"secret": CANARY}]},
                   headers={"Idempotency-Key": CANARY + "-key"}).json()["id"]
    api.get(f"{API}/executions?workflow={CANARY}")
    api.post(f"{API}/workflows/{CANARY}/submit", {"args": [CANARY]})
    api.post(f"{API}/workflows/http.echo/submit", '{"args": ["' + CANARY + '",')
    api.post(f"{API}/workflows/http.echo/submit", {"args": [CANARY]},
             token=f"kst_{'1' * 16}_{CANARY[:43].ljust(43, 'x')}")
    body = json.dumps({"alert": CANARY}).encode()
    sig = hmac.new((CANARY + "-hook-secret").encode(), body, hashlib.sha256).hexdigest()
    api.post("/hooks/alerts", body, headers={"X-Signature-256": f"sha256={sig}"}, token=None)
    api.post("/hooks/alerts", body, headers={"X-Signature-256": f"sha256={CANARY}"},
             token=None)
    wait_until(lambda: q1(server["dsn"], server["schema"], "SELECT status FROM "
                          "{s}.executions WHERE id = %s", [eid]) == "completed",
               timeout=60, what="the canary execution")
    with urllib.request.urlopen(f"http://127.0.0.1:{server['metrics_port']}/metrics",
                                timeout=10) as resp:
        metrics = resp.read().decode()
    log = Path(server["log"]).read_text()
    secret = server["token"][21:]
    for text, where in ((log, "log"), (metrics, "metrics")):
        assert CANARY not in text, where
        assert secret not in text, where
    # An execution's id is no secret: the log names it where an operator needs it (a lease
    # lost, a heartbeat that met a row another transaction holds); a metric never carries it.
    assert eid not in metrics
    assert "kestrel_workflows_submitted_total" in metrics
    # The log was at its most verbose: requests are there, by route template only.
    assert "POST /api/v1/workflows/{workflow}/submit 201" in log
    assert "POST /hooks/{name} 401" in log


def test_s1_serve_binds_loopback_by_default_and_speaks_tls_when_told(
        pg_dsn: str, schema: str, tmp_path: Path) -> None:
    files = _tls_files(tmp_path, "localhost")
    port = free_port()
    log = tmp_path / "serve.log"
    token = make_token(pg_dsn, schema, "tls", "read")
    cmd = [sys.executable, "-m", "kestrel", "serve", "--app", APP, "--dsn", pg_dsn,
           "--schema", schema, "--http-port", str(port), "--http-certfile",
           str(files["cert"]), "--http-keyfile", str(files["key"])]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=out,
                                env={**__import__("os").environ, "PYTHONPATH": str(ROOT)},
                                start_new_session=True)
    try:
        tls = ssl.create_default_context(cafile=str(files["ca"]))
        api = Api(port, token=token, tls=tls, host="localhost")

        def up() -> bool:
            try:
                return api.get("/healthz").status == 200
            except OSError:
                return False

        wait_until(up, timeout=60, what="serve over TLS")
        assert api.get(f"{API}/queues").status == 200
        listening = [c.laddr for c in psutil.Process(proc.pid).net_connections("inet")
                     if c.status == psutil.CONN_LISTEN]
        assert [(a.ip, a.port) for a in listening] == [("127.0.0.1", port)]
        with pytest.raises((ConnectionError, OSError)):
            plain = Api(port, token=token)
            reply = plain.get(f"{API}/queues")
            if reply.status >= 400:
                raise ConnectionError("plain HTTP refused")
    finally:
        stop_runtime(proc)  # type: ignore[arg-type]
    assert proc.returncode == 0  # SIGTERM: a graceful shutdown and a clean exit
    text = log.read_text()
    assert "serving the HTTP API on https://127.0.0.1" in text
    assert "Finished server process" in text


def test_s4_the_http_child_works_under_the_least_privilege_role(
        direct_dsn: str, schema: str, tmp_path: Path) -> None:
    role = f"kestrel_http_{uuid.uuid4().hex[:8]}"
    s, r = pgsql.Identifier(schema), pgsql.Identifier(role)
    with psycopg.connect(direct_dsn, autocommit=True) as conn:
        conn.execute(pgsql.SQL("CREATE ROLE {} LOGIN").format(r))
        conn.execute(pgsql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(s, r))
        conn.execute(pgsql.SQL("GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA "
                               "{} TO {}").format(s, r))
        conn.execute(pgsql.SQL("GRANT USAGE ON ALL SEQUENCES IN SCHEMA {} TO {}").format(s, r))
    try:
        token = make_token(direct_dsn, schema, "s4", "read,operate,submit")
        with http_runtime(as_role(direct_dsn, role), schema, port=free_port(),
                          log=tmp_path / "rt.log") as api:
            api.token = token
            eid = api.post(f"{API}/workflows/http.steps/submit", {"args": [3]}).json()["id"]
            wait_until(lambda: api.get(f"{API}/executions/{eid}").json()["status"]
                       == "completed", timeout=60, what="the execution")
            assert api.get(f"{API}/executions?limit=5").status == 200
        assert "not migrating (this role may not run DDL)" in (tmp_path / "rt.log").read_text()
    finally:
        with psycopg.connect(direct_dsn, autocommit=True) as conn:
            conn.execute(pgsql.SQL("DROP OWNED BY {}").format(r))
            conn.execute(pgsql.SQL("DROP ROLE {}").format(r))

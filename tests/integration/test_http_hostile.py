"""The HTTP door under hostile clients (issue 26, finding 1 and the small items of 6): raw
sockets on loopback that never finish their headers, trickle a body a byte at a time, send
a header of megabytes or bytes that are not HTTP, and a pool held by stuck API calls. While
they hang, ``/healthz`` and a signed hook still answer; the stalled ones are cut after the
deadline with one line of JSON; every request shows in /metrics by its route template.

The door's settings come from the environment (``KESTREL_HTTP_*``), the same knobs as the
flags and the config file."""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import select
import socket
import subprocess
import sys
import threading
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql as pgsql

from tests.helpers import ROOT, q1, wait_until
from tests.http_helpers import Api, free_port, http_runtime, make_token, serve_process

API = "/api/v1"
SECRET = "hostile-secret-" + uuid.uuid4().hex
HEADER_CAP = 8192
CONNECTIONS = 24
CONFIG = """
[hooks.alerts]
workflow = "http.echo"
format = "hmac"
secret_env = "T_HOOK_SECRET"
"""
DOOR = {"KESTREL_HTTP_HEADER_TIMEOUT": "4", "KESTREL_HTTP_BODY_TIMEOUT": "6",
        "KESTREL_HTTP_MAX_HEADER_BYTES": str(HEADER_CAP),
        "KESTREL_HTTP_MAX_CONNECTIONS": str(CONNECTIONS),
        "KESTREL_HTTP_HOOK_POOL_SIZE": "2", "T_HOOK_SECRET": SECRET}


@pytest.fixture(scope="module")
def server(pg_dsn: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from kestrel.migrate import migrate

    schema = f"t_{uuid.uuid4().hex[:12]}"
    migrate(pg_dsn, schema)
    folder = tmp_path_factory.mktemp("hostile")
    config = folder / "k.toml"
    config.write_text(CONFIG)
    token = make_token(pg_dsn, schema, "hostile", "read,operate,submit")
    metrics_port = free_port()
    with http_runtime(pg_dsn, schema, port=free_port(), log=folder / "rt.log", procs=1,
                      env=DOOR, args=["--config", str(config), "--pool-size", "2",
                                      "--metrics-port", str(metrics_port)]) as api:
        api.token = token
        yield {"api": api, "schema": schema, "dsn": pg_dsn, "log": folder / "rt.log",
               "metrics_port": metrics_port}
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(pgsql.SQL("DROP SCHEMA {} CASCADE").format(pgsql.Identifier(schema)))


def signed(body: bytes) -> dict[str, str]:
    sig = hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
    return {"X-Signature-256": f"sha256={sig}", "Content-Type": "application/json"}


def executions(server: dict[str, Any]) -> int:
    return int(q1(server["dsn"], server["schema"], "SELECT count(*) FROM {s}.executions"))


def connect(port: int, first: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    if first:
        sock.sendall(first)
    return sock


def read_to_close(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (a socket timeout fails the test: the
    server kept the connection open)."""
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except ConnectionResetError:
        pass
    finally:
        sock.close()
    return got


def read_response(sock: socket.socket) -> bytes:
    """One response, by its Content-Length, on a connection that stays open."""
    got = b""
    while b"\r\n\r\n" not in got:
        got += sock.recv(65536) or b"\r\n\r\n"
    head, _, body = got.partition(b"\r\n\r\n")
    length = int(re.search(rb"content-length: (\d+)", head.lower()).group(1))  # type: ignore[union-attr]
    while len(body) < length:
        body += sock.recv(65536) or b" " * length
    return head + b"\r\n\r\n" + body


def status_of(raw: bytes) -> tuple[int, Any]:
    """The status and JSON body of one raw HTTP/1.1 response."""
    head, _, body = raw.partition(b"\r\n\r\n")
    match = re.match(rb"HTTP/1\.1 (\d{3}) ", head)
    assert match, raw[:200]
    assert b"content-type: application/json" in head.lower(), head
    return int(match.group(1)), json.loads(body)


def hook(api: Api, n: int) -> Any:
    body = json.dumps({"alert": n, "nonce": uuid.uuid4().hex}).encode()
    return api.post("/hooks/alerts", body, headers=signed(body), token=None)


def test_stalled_and_trickling_clients_are_cut_while_healthz_and_a_hook_answer(
        server: dict[str, Any]) -> None:
    """More stalled connections than the connection limit (headers never finished) and
    hook uploads trickled a byte at a time: /healthz and a signed hook still answer, and
    every one of them is closed after its deadline, with a JSON 408 (or 503 when a newer
    connection displaced it at the limit)."""
    api: Api = server["api"]
    before = executions(server)
    stalled = [connect(api.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
               for _ in range(CONNECTIONS + 16)]
    body = json.dumps({"alert": "trickled", "pad": "x" * 900}).encode()
    head = (f"POST /hooks/alerts HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in signed(body).items()) + "\r\n").encode()
    trickling = [connect(api.port, head) for _ in range(4)]
    sent = [0] * len(trickling)

    def trickle(i: int, sock: socket.socket) -> None:
        for byte in body:
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                return  # cut off by the server
            sent[i] += 1
            if select.select([sock], [], [], 0.5)[0]:
                return  # the server answered (and closes)

    threads = [threading.Thread(target=trickle, args=(i, s), daemon=True)
               for i, s in enumerate(trickling)]
    for t in threads:
        t.start()
    try:
        health = api.get("/healthz", token=None)
        assert health.status == 200, health.body
        answered = hook(api, 1)
        assert answered.status == 200, answered.body
        assert "id" in answered.json()
        for sock in stalled:
            status, reply = status_of(read_to_close(sock))
            assert status in (408, 503), reply
            assert reply["error"]
        for t in threads:
            t.join(timeout=60)
        for sock in trickling:
            status, reply = status_of(read_to_close(sock))
            assert status == 408 and "body" in reply["error"], reply
    finally:
        for sock in [*stalled, *trickling]:
            sock.close()
    assert all(n < len(body) for n in sent), sent
    assert executions(server) == before + 1  # the signed hook's, none of the trickled ones
    assert api.get("/healthz", token=None).status == 200


def test_a_header_of_megabytes_is_refused_after_the_cap(server: dict[str, Any]) -> None:
    """A header that never ends: 431 once the cap is passed, the rest is never parsed (the
    client is stopped long before its 64 MiB are out); a header block over the cap sent
    whole, too; one under the cap is served."""
    api: Api = server["api"]
    sock = connect(api.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: ")
    chunk, sent, total = b"a" * 65536, 0, 64 * 1024 * 1024
    try:
        while sent < total:
            sock.sendall(chunk)
            sent += len(chunk)
            if select.select([sock], [], [], 0)[0]:
                break
        else:
            select.select([sock], [], [], 30)
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    status, reply = status_of(read_to_close(sock))
    assert status == 431 and str(HEADER_CAP) in reply["error"], reply
    assert sent < total

    whole = connect(api.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: "
                    + b"b" * (2 * HEADER_CAP) + b"\r\n\r\n")
    status, reply = status_of(read_to_close(whole))
    assert status == 431, reply
    under = api.get("/healthz", token=None, headers={"X-Fine": "c" * (HEADER_CAP // 2)})
    assert under.status == 200


def test_hooks_have_their_own_pool_connections(server: dict[str, Any]) -> None:
    """API calls stuck on a row lock hold every API connection of the HTTP process (and
    queue for more); a signed hook still gets a connection and starts its workflow."""
    api: Api = server["api"]
    eid = api.post(f"{API}/workflows/http.approval/submit", {"args": [{}]}).json()["id"]
    wait_until(lambda: q1(server["dsn"], server["schema"], "SELECT status FROM "
                          "{s}.executions WHERE id = %s", [eid]) == "waiting",
               timeout=60, what="the wait")
    replies: list[int] = []
    with psycopg.connect(server["dsn"]) as holder:
        holder.execute(pgsql.SQL("SELECT 1 FROM {}.workflow_executions WHERE id = %s "
                                 "FOR UPDATE")
                       .format(pgsql.Identifier(server["schema"])), [eid])
        stuck = [threading.Thread(target=lambda: replies.append(
            api.post(f"{API}/executions/{eid}/cancel").status), daemon=True)
            for _ in range(3)]
        for t in stuck:
            t.start()
        wait_until(lambda: q1(server["dsn"], server["schema"],
                              "SELECT count(*) FROM pg_stat_activity WHERE "
                              "wait_event_type = 'Lock' AND query LIKE %s",
                              ["%cancel%"]) >= 2,
                   timeout=60, what="both API connections waiting on the lock")
        answered = hook(api, 2)
        assert answered.status == 200, answered.body
        holder.rollback()
    for t in stuck:
        t.join(timeout=60)
    assert replies == [200, 200, 200]


def test_a_401_names_its_challenge(server: dict[str, Any]) -> None:
    """RFC 9110: every 401 carries WWW-Authenticate (the API's bearer, a hook's header)."""
    api: Api = server["api"]
    no_token = api.get(f"{API}/executions", token=None)
    assert no_token.status == 401
    assert no_token.headers.get("www-authenticate", "").startswith("Bearer ")
    body = b"{}"
    bad_sig = api.post("/hooks/alerts", body, token=None, headers={
        "X-Signature-256": "sha256=" + hmac.new(b"wrong", body, hashlib.sha256).hexdigest()})
    assert bad_sig.status == 401
    assert "X-Signature-256" in bad_sig.headers.get("www-authenticate", "")


def test_a_405_names_every_allowed_method(server: dict[str, Any]) -> None:
    api: Api = server["api"]
    wrong = api.request("DELETE", f"{API}/executions")
    assert wrong.status == 405 and wrong.json()["error"]
    assert set(wrong.headers.get("allow", "").split(", ")) == {"GET", "HEAD"}
    login = api.request("PUT", "/ui/login", token=None)  # GET and POST are two routes
    assert login.status == 405
    assert {"GET", "POST"} <= set(login.headers.get("allow", "").split(", "))


def test_bytes_that_are_not_http_get_a_json_refusal(server: dict[str, Any]) -> None:
    api: Api = server["api"]
    for junk in (b"NOT HTTP AT ALL\r\n\r\n", b"GET / HTTP/1.1\r\nBad Header\r\n\r\n"):
        status, reply = status_of(read_to_close(connect(api.port, junk)))
        assert status == 400 and reply["error"]


def test_a_hook_without_a_wellformed_signature_is_refused_before_its_body(
        server: dict[str, Any]) -> None:
    """Headers that announce a body never sent: refused on the headers alone."""
    api: Api = server["api"]
    for signature in (b"", b"X-Signature-256: sha256=00\r\n"):
        early = connect(api.port, b"POST /hooks/alerts HTTP/1.1\r\nHost: x\r\n"
                        b"Content-Length: 100000\r\nContent-Type: application/json\r\n"
                        + signature + b"\r\n")
        try:
            status, reply = status_of(read_response(early))
        finally:
            early.close()
        assert status == 401 and "X-Signature-256" in reply["error"], reply


def test_a_limit_in_other_digits_or_thousands_of_them_is_a_400(
        server: dict[str, Any]) -> None:
    api: Api = server["api"]
    for limit in ("²", "①", "٣", "9" * 5000, "-1", "0", "501", "", " 5"):
        reply = api.get(f"{API}/executions?limit={urllib.request.quote(limit)}")
        assert reply.status == 400, (limit[:10], reply.status, reply.body[:200])
        assert "limit" in reply.json()["error"]
    announced = api.post(f"{API}/workflows/http.echo/submit", b"[]",
                         headers={"Content-Length": "²"})
    assert announced.status == 400


def scrape(server: dict[str, Any]) -> str:
    url = f"http://127.0.0.1:{server['metrics_port']}/metrics"
    with urllib.request.urlopen(url, timeout=10) as resp:
        return str(resp.read().decode())


def test_http_metrics_by_route_template_on_the_supervisors_metrics(
        server: dict[str, Any]) -> None:
    """Requests counted and timed by method, route template and status (never the path a
    client sent), refusals by reason, open connections: scraped from /metrics."""
    api: Api = server["api"]
    canary = uuid.uuid4().hex
    eid = str(uuid.uuid4())
    assert api.get(f"{API}/executions/{eid}").status == 404
    assert api.get(f"/no/such/{canary}", token=None).status == 404
    assert api.post(f"{API}/workflows/{canary}/submit", {"args": []}).status == 404
    assert hook(api, 3).status == 200
    api.get(f"/ui/executions/{eid}", token=None)
    status_of(read_to_close(connect(api.port, b"\x16\x03\x01 not http\r\n\r\n")))

    def scraped() -> str | None:
        text = scrape(server)
        return text if 'route="/hooks/{name}",status="200"' in text else None

    text = wait_until(scraped, timeout=30, what="the HTTP child's metrics")
    sample = re.compile(r'^kestrel_http_requests_total\{method="(\w+)",route="([^"]*)",'
                        r'status="(\d{3})"\} (\S+)$', re.M)
    seen = {(m, r, s) for m, r, s, _ in sample.findall(text)}
    assert ("GET", "/api/v1/executions/{id}", "404") in seen, seen
    assert ("GET", "unmatched", "404") in seen
    assert ("POST", "/api/v1/workflows/{workflow}/submit", "404") in seen
    assert ("POST", "/hooks/{name}", "200") in seen
    assert any(r == "/ui/executions/{id}" for _, r, _ in seen), seen
    routes = {r for _, r, _ in seen}
    assert all(r == "unmatched" or r.startswith("/") for r in routes)
    assert canary not in text and eid not in text
    assert re.search(r'kestrel_http_request_duration_seconds_bucket\{le="[^"]+",'
                     r'method="POST",route="/hooks/\{name\}"\}|'
                     r'kestrel_http_request_duration_seconds_bucket\{method="POST",'
                     r'route="/hooks/\{name\}",le=', text)
    assert re.search(r'kestrel_http_refused_total\{reason="malformed"\} [1-9]', text)
    assert "kestrel_http_connections" in text


def test_a_hooks_own_body_cap_is_read_before_its_signature(pg_dsn: str, tmp_path: Path,
                                                          ) -> None:
    """``max_body_bytes`` of [hooks.NAME]: a body over it is refused (413) before the
    signature is computed, whatever the server-wide cap; one under it is served."""
    from kestrel.migrate import migrate

    schema = f"t_{uuid.uuid4().hex[:12]}"
    migrate(pg_dsn, schema)
    config = tmp_path / "k.toml"
    config.write_text(CONFIG + "max_body_bytes = 2048\n")
    with serve_process(pg_dsn, schema, port=free_port(), log=tmp_path / "serve.log",
                       args=["--config", str(config)],
                       env={"T_HOOK_SECRET": SECRET}) as api:
        big = json.dumps({"pad": "x" * 4096}).encode()
        reply = api.post("/hooks/alerts", big, headers=signed(big), token=None)
        assert reply.status == 413 and "2048" in reply.json()["error"], reply.body
        small = json.dumps({"pad": "x" * 100}).encode()
        assert api.post("/hooks/alerts", small, headers=signed(small), token=None
                        ).status == 200
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(pgsql.SQL("DROP SCHEMA {} CASCADE").format(pgsql.Identifier(schema)))


def test_serve_alone_exports_its_http_metrics(pg_dsn: str, tmp_path: Path) -> None:
    """``kestrel-runtime serve --metrics-port``: the door's own /metrics (it was ignored)."""
    from kestrel.migrate import migrate

    schema = f"t_{uuid.uuid4().hex[:12]}"
    migrate(pg_dsn, schema)
    port = free_port()
    with serve_process(pg_dsn, schema, port=free_port(), log=tmp_path / "serve.log",
                       args=["--metrics-port", str(port)]) as api:
        assert api.get(f"/nope/{uuid.uuid4().hex}", token=None).status == 404
        text = scrape({"metrics_port": port})
        assert ('kestrel_http_requests_total{method="GET",route="/healthz",status="200"}'
                in text)
        assert 'route="unmatched",status="404"' in text
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=10) as resp:
            assert json.loads(resp.read())["ready"] is True
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(pgsql.SQL("DROP SCHEMA {} CASCADE").format(pgsql.Identifier(schema)))


def test_settings_are_validated_and_explained(tmp_path: Path) -> None:
    """Every door setting is a flag, an environment variable and a config key, checked."""
    from kestrel.config import load
    from kestrel.errors import ConfigError

    cfg = load({"http_header_timeout": 3.0}, environ={"KESTREL_HTTP_BODY_TIMEOUT": "7"},
               config_file=str(_toml(tmp_path, "http_max_connections = 50\n"
                                               "http_max_header_bytes = 4096\n"
                                               "http_hook_pool_size = 3\n")))
    assert (cfg.http_header_timeout, cfg.http_body_timeout, cfg.http_max_connections,
            cfg.http_max_header_bytes, cfg.http_hook_pool_size) == (3.0, 7.0, 50, 4096, 3)
    for bad in ({"http_header_timeout": 0.0}, {"http_body_timeout": -1.0},
                {"http_max_connections": 0}, {"http_max_header_bytes": 10},
                {"http_hook_pool_size": 0}):
        with pytest.raises(ConfigError):
            load(bad, environ={})
    out = subprocess.run([sys.executable, "-m", "kestrel", "serve", "--help"], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    text = " ".join(out.stdout.split())
    for flag in ("--http-header-timeout", "--http-body-timeout", "--http-max-header-bytes",
                 "--http-max-connections", "--http-hook-pool-size"):
        assert flag in text


def _toml(folder: Path, text: str) -> Path:
    path = folder / "settings.toml"
    path.write_text(text)
    return path



def test_the_list_refuses_hostile_filters_and_reads_sql_looking_ones_as_text(
        server: dict[str, Any]) -> None:
    """GET /executions (page_executions, migration 0020's three branches): a filter that is
    not text, not a status, not a queue name, not a time or not a cursor is a 400 naming
    the parameter; text that looks like SQL is a filter like any other; nothing is written."""
    api: Api = server["api"]
    before = executions(server)
    quote = urllib.request.quote
    refused = {
        "status": ["%00", quote("running' OR '1'='1"), "Running", quote("\u202e")],
        "workflow": ["a%00b", "%ED%A0%80", "%FF", "a" * 2000, "a" * 5000],
        "queue": ["%00", quote("q; DROP TABLE x"), "q" * 129, quote("é")],
        "since": ["1e-400", str(2 ** 64), "%00", quote("2026-13-01T00:00")],
        "until": ["NaN", quote("-infinity")],
        "cursor": ["%00", "A" * 300, quote("' OR 1=1 --")],
        "limit": [str(2 ** 64), "1e3"],
        "nope": ["1"],
    }
    for name, values in refused.items():
        for value in values:
            reply = api.get(f"{API}/executions?{name}={value}")
            assert reply.status == 400, (name, value[:40], reply.status, reply.body[:200])
            error = reply.json()["error"]
            assert name in error or "UTF-8" in error or "NUL" in error, (name, error)
    for sql_like in ("x'); DROP TABLE executions; --", "%' OR '1'='1", "\\x00", "a" * 1024):
        reply = api.get(f"{API}/executions?workflow={quote(sql_like)}&queue=default"
                        f"&status=running&since={quote('0001-01-01T00:00:00+14:00')}")
        assert reply.status == 200, (sql_like[:40], reply.status, reply.body[:200])
        assert reply.json() == {"executions": [], "next_cursor": None}
    assert executions(server) == before


def test_a_table_lock_gets_503_with_retry_after_and_holds_no_pool_connection(
        pg_dsn: str, tmp_path: Path) -> None:
    """Issue 41 row 5: the door's statements had no timeout: a table lock hung every API and
    UI request for as long as it lasted, each holding a pool connection, and later ones
    waited 30 s for one. Now each request waits on the database at most
    --http-statement-timeout: its statement is cancelled on the server, its connection goes
    back to the pool idle, and it is answered 503 with Retry-After."""
    from concurrent.futures import ThreadPoolExecutor

    from kestrel.migrate import migrate

    schema = f"t_{uuid.uuid4().hex[:12]}"
    migrate(pg_dsn, schema)
    token = make_token(pg_dsn, schema, "locked", "read")
    metrics_port = free_port()
    env = {"KESTREL_HTTP_STATEMENT_TIMEOUT": "1", "KESTREL_POOL_SIZE": "2"}
    try:
        with serve_process(pg_dsn, schema, port=free_port(), log=tmp_path / "serve.log",
                           args=["--metrics-port", str(metrics_port)], env=env) as api:
            api.token = token
            assert api.get(f"{API}/executions").status == 200
            locker = psycopg.connect(pg_dsn)
            locker.execute(pgsql.SQL("LOCK TABLE {}.workflow_executions").format(
                pgsql.Identifier(schema)))
            try:
                # Four at once on a pool of two: each answered, none waits out the lock.
                with ThreadPoolExecutor(4) as pool:
                    replies = list(pool.map(lambda _: api.get(f"{API}/executions"), range(4)))
                for reply in replies:
                    assert reply.status == 503, reply
                    assert {k.lower(): v for k, v in reply.headers.items()}["retry-after"] == "1"
                    assert "did not answer within 1 s" in reply.json()["error"]
                # Nothing of the door's waits on the lock any more: cancelled, not left.
                assert q1(pg_dsn, schema, "SELECT count(*) FROM pg_stat_activity WHERE "
                          "wait_event_type = 'Lock' AND pid <> pg_backend_pid()") == 0
                assert api.get("/healthz", token=None).status == 200
            finally:
                locker.close()
            # The lock gone, the same pool answers at once.
            assert api.get(f"{API}/executions").status == 200
            text = scrape({"metrics_port": metrics_port})
            assert 'kestrel_http_refused_total{reason="statement_timeout"} 4.0' in text
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(pgsql.SQL("DROP SCHEMA {} CASCADE").format(pgsql.Identifier(schema)))


def test_a_wait_in_pgbouncers_queue_is_cut_at_the_budget_and_answered_503(
        direct_dsn: str, tmp_path: Path) -> None:
    """A statement queued in PgBouncer for a server connection never reaches the server, so
    no statement_timeout can end it. The door used to cancel it with a cancel request, which
    PgBouncer 1.18 forwards on a server connection of its own and may hold without bound
    while psycopg waits for it (the cause of the table-lock test's 30 s hangs mid-suite,
    where earlier tests hold server connections). Now past the budget and its grace the
    door closes that connection's socket and answers 503; the pool replaces the connection
    and the next request, once a server connection is free, is answered."""
    from kestrel.migrate import migrate
    from tests.pgbouncer import PgBouncer

    schema = f"t_{uuid.uuid4().hex[:12]}"
    migrate(direct_dsn, schema)
    token = make_token(direct_dsn, schema, "queued", "read")
    bouncer = PgBouncer(direct_dsn, pool_size=1)
    env = {"KESTREL_HTTP_STATEMENT_TIMEOUT": "1", "KESTREL_POOL_SIZE": "2"}
    try:
        with serve_process(bouncer.dsn, schema, port=free_port(), log=tmp_path / "serve.log",
                           env=env) as api:
            api.token = token
            assert api.get(f"{API}/executions").status == 200
            hog = psycopg.connect(bouncer.dsn)
            hog.execute("SELECT 1")  # idle in transaction: PgBouncer's one server connection
            try:
                # The HTTP client gives up after 30 s: a door that waits for PgBouncer fails.
                reply = api.get(f"{API}/executions")
                assert reply.status == 503, reply
                assert "did not answer within 1 s" in reply.json()["error"]
            finally:
                hog.close()
            wait_until(lambda: api.get(f"{API}/executions").status == 200, timeout=30,
                       what="an answer once PgBouncer's server connection is free")
    finally:
        bouncer.stop()
        with psycopg.connect(direct_dsn, autocommit=True) as conn:
            conn.execute(pgsql.SQL("DROP SCHEMA {} CASCADE").format(pgsql.Identifier(schema)))

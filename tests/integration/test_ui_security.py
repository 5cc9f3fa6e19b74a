"""The web UI over TLS (S1: the session cookie is ``Secure``) and under the least-privilege
database role (S4: pages and forms need only DML on the kestrel schema)."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
import uuid
from pathlib import Path

import psycopg
from psycopg import sql as pgsql

from kestrel.client import SyncClient
from tests.helpers import ROOT, runtime, stop_runtime, wait_until
from tests.http_helpers import Api, free_port, make_token
from tests.integration.test_security import _tls_files, as_role
from tests.ui_helpers import FORM_KEY, UI_APP, Browserless


def test_s1_over_tls_the_session_cookie_is_secure(pg_dsn: str, schema: str,
                                                   tmp_path: Path) -> None:
    files = _tls_files(tmp_path, "localhost")
    port = free_port()
    token = make_token(pg_dsn, schema, "tls-ui", "read")
    with open(tmp_path / "serve.log", "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kestrel", "serve", "--app", UI_APP, "--dsn", pg_dsn,
             "--schema", schema, "--http-port", str(port), "--http-certfile",
             str(files["cert"]), "--http-keyfile", str(files["key"])],
            cwd=ROOT, stdout=out, stderr=out, start_new_session=True,
            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        tls = ssl.create_default_context(cafile=str(files["ca"]))
        ui = Browserless(Api(port, tls=tls, host="localhost"))

        def up() -> bool:
            try:
                return ui.get("/healthz").status == 200
            except OSError:
                return False

        wait_until(up, timeout=60, what="serve over TLS")
        origin = {"Origin": f"https://localhost:{port}"}  # what a browser sends: same site
        reply = ui.post_form("/ui/login", {"token": token}, headers=origin)
        assert reply.status == 303, reply.body
        attrs = [a.strip().lower() for a in reply.headers["set-cookie"].split(";")]
        assert "secure" in attrs and "httponly" in attrs and "samesite=strict" in attrs
        ui.cookie = reply.headers["set-cookie"].split(";")[0].partition("=")[2]
        assert ui.get("/ui/").status == 200
        cross = ui.post_form("/ui/login", {"token": token},
                             headers={"Origin": f"http://localhost:{port}"})
        assert cross.status == 403  # http:// is another origin than https://
    finally:
        stop_runtime(proc)  # type: ignore[arg-type]


def test_s4_pages_and_forms_work_under_the_least_privilege_role(
        direct_dsn: str, schema: str, tmp_path: Path) -> None:
    role = f"kestrel_ui_{uuid.uuid4().hex[:8]}"
    s, r = pgsql.Identifier(schema), pgsql.Identifier(role)
    with psycopg.connect(direct_dsn, autocommit=True) as conn:
        conn.execute(pgsql.SQL("CREATE ROLE {} LOGIN").format(r))
        conn.execute(pgsql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(s, r))
        conn.execute(pgsql.SQL("GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA "
                               "{} TO {}").format(s, r))
        conn.execute(pgsql.SQL("GRANT USAGE ON ALL SEQUENCES IN SCHEMA {} TO {}").format(s, r))
    dsn = as_role(direct_dsn, role)
    try:
        token = make_token(direct_dsn, schema, "s4-ui", "read,operate")
        port = free_port()
        with runtime(dsn, schema, procs=1, app=UI_APP, log=tmp_path / "rt.log",
                     args=["--http-port", str(port)]), \
                SyncClient(dsn, schema=schema, pool_size=1) as client:
            ui = Browserless(Api(port))
            wait_until(lambda: _up(ui), timeout=60, what="the UI")
            ui.login(token)
            eid = str(client.submit("http.approval", {}).id)
            wait_until(lambda: client.get(eid).status.value == "waiting", timeout=60,
                       what="waiting")
            for path in ("/ui/", "/ui/counts", "/ui/queues", "/ui/schedules",
                         "/ui/search?q=http", f"/ui/executions/{eid}"):
                assert ui.get(path).status == 200, path
            page = ui.get(f"/ui/executions/{eid}")
            key = FORM_KEY.search(page.body)
            assert key
            sent = ui.post_form(f"/ui/executions/{eid}/approve", {
                "csrf": ui.csrf(page), "key": key.group(1).decode(), "name": "approval"})
            assert sent.status == 303
            assert client.result(eid, timeout=60)["outcome"] == "approved"
    finally:
        with psycopg.connect(direct_dsn, autocommit=True) as conn:
            conn.execute(pgsql.SQL("DROP OWNED BY {}").format(r))
            conn.execute(pgsql.SQL("DROP ROLE {}").format(r))


def _up(ui: Browserless) -> bool:
    try:
        return ui.get("/healthz").status == 200
    except OSError:
        return False

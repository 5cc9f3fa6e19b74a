"""The web UI's test harness: a real runtime (workers) and a real ``kestrel-runtime serve``
on loopback, tokens, and a cookie-carrying HTTP client that logs in through the login form."""

from __future__ import annotations

import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import psycopg
from psycopg import sql as pgsql

from tests.helpers import ROOT, runtime, wait_until
from tests.http_helpers import Api, Reply, free_port, make_token

UI_APP = "tests.apps.ui_app"
CSRF = re.compile(rb'name="csrf" value="([0-9a-f]{64})"')
FORM_KEY = re.compile(rb'name="key" value="([0-9a-f]{32})"')


@dataclass
class Browserless:
    """The UI over plain HTTP: a session cookie, as a browser would keep it."""

    api: Api
    cookie: str | None = None

    def get(self, path: str, **kw: Any) -> Reply:
        return self.api.get(path, token=None, headers=self._headers(kw.pop("headers", None)),
                            **kw)

    def post_form(self, path: str, fields: dict[str, str] | bytes | str, *,
                  headers: dict[str, str] | None = None) -> Reply:
        body = fields if isinstance(fields, bytes | str) else urlencode(fields)
        hdrs = {"Content-Type": "application/x-www-form-urlencoded", **(headers or {})}
        return self.api.post(path, body, token=None, headers=self._headers(hdrs))

    def _headers(self, extra: dict[str, str] | None) -> dict[str, str]:
        hdrs = dict(extra or {})
        if self.cookie is not None:
            hdrs["Cookie"] = f"kestrel_session={self.cookie}"
        return hdrs

    def login(self, token: str) -> Reply:
        reply = self.post_form("/ui/login", {"token": token, "next": "/ui/"})
        assert reply.status == 303, reply.body
        found = re.match(r"kestrel_session=([^;]*);", reply.headers["set-cookie"])
        assert found, reply.headers["set-cookie"]
        self.cookie = found.group(1)  # the session's id, never the token
        return reply

    def csrf(self, page: Reply) -> str:
        found = CSRF.search(page.body)
        assert found, "no CSRF field on the page"
        return found.group(1).decode()


@dataclass
class UiServer:
    api: Api
    dsn: str
    schema: str
    tokens: dict[str, str]
    log: Path

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.api.port}"

    def client(self, scope: str | None = "operator") -> Browserless:
        ui = Browserless(self.api)
        if scope is not None:
            ui.login(self.tokens[scope])
        return ui


def _up(api: Api) -> bool:
    try:
        return api.get("/healthz", token=None).status == 200
    except OSError:
        return False


@contextmanager
def ui_server(dsn: str, tmp: Path, *, procs: int = 1) -> Iterator[UiServer]:
    """A fresh schema, tokens (operator: read+operate; reader: read; submitter: submit), the
    runtime's workers and ``kestrel-runtime serve`` in a process of its own."""
    from kestrel.migrate import migrate

    schema = f"t_{uuid.uuid4().hex[:12]}"
    migrate(dsn, schema)
    tokens = {"operator": make_token(dsn, schema, "ana", "read,operate"),
              "reader": make_token(dsn, schema, "rita", "read"),
              "submitter": make_token(dsn, schema, "sam", "submit")}
    port = free_port()
    log = tmp / "serve.log"
    with runtime(dsn, schema, procs=procs, app=UI_APP, log=tmp / "runtime.log"), \
            open(log, "ab") as out:
        serve = subprocess.Popen(
            [sys.executable, "-m", "kestrel", "serve", "--app", UI_APP, "--dsn", dsn,
             "--schema", schema, "--http-port", str(port)],
            cwd=ROOT, stdout=out, stderr=out, start_new_session=True)
        try:
            api = Api(port)
            wait_until(lambda: serve.poll() is not None or _up(api), timeout=60,
                       what="kestrel-runtime serve")
            assert serve.poll() is None, log.read_text()
            yield UiServer(api, dsn, schema, tokens, log)
        finally:
            serve.terminate()
            serve.wait(timeout=30)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(pgsql.SQL("DROP SCHEMA {} CASCADE").format(pgsql.Identifier(schema)))

"""A real ``kestrel-runtime`` with ``--http-port`` (or ``serve``) for the HTTP tests, and a
plain HTTP client on loopback (http.client: it sends exactly the bytes a test gives it)."""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.helpers import ROOT, wait_until

APP = "tests.apps.http_app"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Reply:
    status: int
    body: bytes
    headers: dict[str, str]

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Api:
    """Requests to one server on loopback."""

    port: int
    token: str | None = None
    tls: ssl.SSLContext | None = None
    host: str = "127.0.0.1"
    proc: Any = None  # the kestrel-runtime process serving it, when a test started one

    def request(self, method: str, path: str, body: bytes | str | Any = None, *,
                headers: dict[str, str] | None = None, token: str | None = "default",
                raw: bool = False) -> Reply:
        if self.tls is not None:
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                self.host, self.port, context=self.tls, timeout=30)
        else:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
        hdrs = dict(headers or {})
        tok = self.token if token == "default" else token
        if tok:
            hdrs["Authorization"] = f"Bearer {tok}"
        if body is not None and not isinstance(body, bytes | str) and not raw:
            body = json.dumps(body)
            hdrs.setdefault("Content-Type", "application/json")
        if isinstance(body, str):
            body = body.encode("utf-8", "surrogatepass")
        try:
            conn.request(method, path, body=body, headers=hdrs)
            resp = conn.getresponse()
            return Reply(resp.status, resp.read(), dict(resp.getheaders()))
        finally:
            conn.close()

    def get(self, path: str, **kw: Any) -> Reply:
        return self.request("GET", path, **kw)

    def post(self, path: str, body: Any = None, **kw: Any) -> Reply:
        return self.request("POST", path, body, **kw)


def make_token(dsn: str, schema: str, name: str, scopes: str) -> str:
    """``kestrel-runtime token create`` in a subprocess; the token it printed once."""
    out = subprocess.run(
        [sys.executable, "-m", "kestrel", "token", "create", "--name", name, "--scopes",
         scopes, "--dsn", dsn, "--schema", schema, "--json"],
        capture_output=True, text=True, cwd=ROOT, check=True)
    return str(json.loads(out.stdout)["token"])


@contextmanager
def http_runtime(dsn: str, schema: str, *, port: int, log: Path, procs: int = 1,
                 args: list[str] | None = None, env: dict[str, str] | None = None,
                 tls: ssl.SSLContext | None = None) -> Iterator[Api]:
    """The real supervisor with ``--http-port``: workers and the HTTP child process."""
    from tests.helpers import runtime

    with runtime(dsn, schema, procs=procs, app=APP, log=log, env=env,
                 args=["--http-port", str(port), *(args or [])]) as proc:
        api = Api(port, tls=tls, proc=proc)
        wait_until(lambda: _up(api), timeout=60, what="the HTTP API")
        yield api


def _up(api: Api) -> bool:
    try:
        return api.get("/healthz", token=None).status == 200
    except OSError:
        return False


@contextmanager
def serve_process(dsn: str, schema: str, *, port: int, log: Path,
                  args: list[str] | None = None, env: dict[str, str] | None = None,
                  app: str = APP) -> Iterator[Api]:
    """``kestrel-runtime serve`` alone (no workers), for the duration of the block."""
    import os

    from tests.helpers import stop_runtime

    cmd = [sys.executable, "-m", "kestrel", "serve", "--app", app, "--dsn", dsn, "--schema",
           schema, "--http-port", str(port), *(args or [])]
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=out, start_new_session=True,
                                env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                    (str(ROOT / "src"), str(ROOT))), **(env or {})})
    api = Api(port, proc=proc)
    try:
        wait_until(lambda: _up(api), timeout=60, what="kestrel-runtime serve")
        yield api
    except BaseException:
        # What the server said is in the failure's report (captured output), not lost with
        # the test's temporary folder.
        print(f"--- the last lines of {log}:", *log.read_text(errors="replace")
              .splitlines()[-40:], sep="\n")
        raise
    finally:
        stop_runtime(proc)

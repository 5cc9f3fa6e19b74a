"""The door's hostile clients of issue 41, through the reverse proxy the repository ships
(``deploy/nginx/kestrel.conf.template``, a real nginx: :mod:`tests.nginx`), in front of
``kestrel-runtime serve`` set up as that file says (``--http-max-connections-per-client 0``:
every request comes from nginx). Attackers connect from other loopback addresses than the
probes (127.0.0.1); every connection goes to 127.0.0.1."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.http_helpers import Api, free_port
from tests.integration.test_http_door_budgets import (
    CONFIG,
    NEVER_SENT,
    answer,
    connect,
    door,
    one_response,
    probes,
    signed,
    trailer_bombs,
)
from tests.nginx import Nginx


@pytest.fixture
def proxied(pg_dsn: str, production_schema: str, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """The door behind nginx: ``api`` talks to nginx, ``door`` to the door itself."""
    ctx, metrics = door(pg_dsn, production_schema, tmp_path,
                        env={"KESTREL_HTTP_MAX_CONNECTIONS_PER_CLIENT": "0"},
                        config=CONFIG + "max_body_bytes = 26214400\n")
    with ctx as direct:
        proxy = Nginx(free_port(), direct.port)
        try:
            yield {"api": Api(proxy.port), "door": direct, "metrics": metrics,
                   "nginx": proxy}
        finally:
            proxy.stop()


def test_through_the_proxy_the_api_the_ui_and_a_hook_answer(proxied: dict[str, Any]) -> None:
    api: Api = proxied["api"]
    assert api.get("/healthz", token=None).status == 200
    assert api.get("/api/v1/openapi.json", token=None).json()["openapi"].startswith("3.")
    assert api.get("/ui/login", token=None).status == 200
    body = json.dumps({"alert": "via nginx"}).encode()
    sent = api.post("/hooks/alerts", body, headers=signed(body), token=None)
    assert sent.status == 200 and "id" in sent.json(), sent.body


def test_bodies_announced_and_never_sent_hold_nothing_of_the_door(
        proxied: dict[str, Any]) -> None:
    """Row 1 through nginx: one client's 300 connections that announce a body and never
    send it are capped per client by nginx (429 past 64) and wait in nginx, which reads a
    body whole before the door sees it; everyone else is served, and the door holds none
    of them."""
    api: Api = proxied["api"]
    door_proc = psutil.Process(proxied["door"].proc.pid)
    hook_head = (b"POST /hooks/alerts HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n"
                 b"Content-Type: application/json\r\nX-Signature-256: sha256=" + b"0" * 64
                 + b"\r\n\r\n")
    attackers = [connect(api.port, "127.0.0.2", NEVER_SENT if i % 2 else hook_head)
                 for i in range(300)]
    try:
        time.sleep(1.0)
        assert probes(api) == [200] * 20
        told = [answer(s, 0.01) for s in attackers]
        assert sum(t.startswith(b"HTTP/1.1 429 ") for t in told) >= 300 - 64 - 150, told[:2]
        # The door has no connection of theirs: only nginx's keep-alive ones, a handful.
        assert len([c for c in door_proc.net_connections("tcp")
                    if c.status == psutil.CONN_ESTABLISHED]) <= 32
    finally:
        for s in attackers:
            s.close()


def test_a_trailer_of_megabytes_through_the_proxy(proxied: dict[str, Any]) -> None:
    """Row 2 through nginx: it does not pass request trailers on; neither it nor the door
    grows by the megabytes sent, and /healthz answers."""
    api: Api = proxied["api"]
    door_proc = psutil.Process(proxied["door"].proc.pid)
    nginx_procs = [psutil.Process(proxied["nginx"].proc.pid),
                   *psutil.Process(proxied["nginx"].proc.pid).children()]
    before = door_proc.memory_info().rss + sum(p.memory_info().rss for p in nginx_procs)
    trailer_bombs(api.port)
    assert api.get("/healthz", token=None).status == 200
    after = door_proc.memory_info().rss + sum(p.memory_info().rss for p in nginx_procs)
    assert after - before < 48 * 1024 * 1024, after - before


def test_a_header_of_megabytes_is_refused_by_the_proxy(proxied: dict[str, Any]) -> None:
    api: Api = proxied["api"]
    sock = connect(api.port, "127.0.0.40", b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: ")
    try:
        for _ in range(16):
            sock.sendall(b"b" * 65536)
    except OSError:
        pass
    told = answer(sock, 5.0)
    sock.close()
    assert told.startswith(b"HTTP/1.1 400 "), told[:100]
    assert api.get("/healthz", token=None).status == 200


def test_unsigned_bodies_are_spooled_by_the_proxy_and_refused_by_the_door(
        proxied: dict[str, Any]) -> None:
    """Row 3 through nginx: eight unsigned 4 MiB deliveries at once are read whole by nginx
    (spooled to disk past 64 KiB) and reach the door complete, one after another: each is
    refused 401, the door grows by a few bodies at most, and a signed one goes through."""
    api: Api = proxied["api"]
    door_proc = psutil.Process(proxied["door"].proc.pid)
    before = door_proc.memory_info().rss
    size = 4 * 1024 * 1024
    head = (f"POST /hooks/alerts HTTP/1.1\r\nHost: x\r\nContent-Length: {size}\r\n"
            "Content-Type: application/json\r\nX-Signature-256: sha256=" + "0" * 64
            + "\r\n\r\n").encode()
    socks = [connect(api.port, f"127.0.0.{30 + i}", head) for i in range(8)]
    for sock in socks:
        sock.sendall(b" " * size)
    told = [one_response(sock, 30.0) for sock in socks]
    for sock in socks:
        sock.close()
    assert all(t.startswith(b"HTTP/1.1 401 ") for t in told), [t[:40] for t in told]
    assert door_proc.memory_info().rss - before < 64 * 1024 * 1024
    body = json.dumps({"alert": 2}).encode()
    assert api.post("/hooks/alerts", body, headers=signed(body), token=None).status == 200


def test_a_storm_of_stalled_headers_through_the_proxy(proxied: dict[str, Any]) -> None:
    """Row 4 through nginx: 400 connections that never finish their headers, from 400
    addresses, wait in nginx (cut after client_header_timeout); the door holds none of them
    and every probe is served."""
    api: Api = proxied["api"]
    door_proc = psutil.Process(proxied["door"].proc.pid)
    idle = door_proc.num_fds()
    storm = [connect(api.port, f"127.0.{1 + i // 200}.{2 + i % 200}",
                     b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ") for i in range(400)]
    try:
        assert probes(api, 8) == [200] * 8
        assert door_proc.num_fds() - idle <= 32
    finally:
        for s in storm:
            s.close()

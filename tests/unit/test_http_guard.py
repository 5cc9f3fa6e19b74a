"""The door's guards without a server: what a hook refuses before its body, a hook's own
body cap, the route templates that label HTTP metrics, the JSON of the protocol's refusals."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from kestrel.config import Config
from kestrel.errors import ConfigError
from kestrel.http.app import create_app
from kestrel.http.hooks import Hook, SignatureError, load_hooks, precheck
from kestrel.http.observe import route_templates
from kestrel.http.protocol import refusal
from kestrel.http.ui import routes as ui_routes

HEX = "ab" * 32


def hook(fmt: str) -> Hook:
    return Hook(name="h", workflow="wf", format=fmt, secret=b"s")


@pytest.mark.parametrize(("fmt", "headers", "why"), [
    ("github", {}, "missing X-Hub-Signature-256"),
    ("github", {"x-hub-signature-256": "sha1=" + HEX}, "sha256=<hex>"),
    ("github", {"x-hub-signature-256": "sha256=zz"}, "sha256=<hex>"),
    ("github", {"x-hub-signature-256": "sha256=" + HEX}, "X-GitHub-Delivery"),
    ("slack", {"x-slack-signature": "v0=" + HEX}, "Unix seconds"),
    ("slack", {"x-slack-signature": "v0=" + HEX, "x-slack-request-timestamp": "1"},
     "5 minutes"),
    ("hmac", {"x-signature-256": "sha256=" + HEX + "00"}, "sha256=<hex>"),
])
def test_precheck_refuses_on_headers_alone(fmt: str, headers: dict[str, str],
                                           why: str) -> None:
    with pytest.raises(SignatureError, match=why):
        precheck(hook(fmt), headers)


def test_precheck_passes_what_only_the_body_can_decide() -> None:
    precheck(hook("github"), {"x-hub-signature-256": "sha256=" + HEX,
                              "x-github-delivery": "d"})
    precheck(hook("slack"), {"x-slack-signature": "v0=" + HEX,
                             "x-slack-request-timestamp": str(int(time.time()))})
    precheck(hook("hmac"), {"x-signature-256": "sha256=" + HEX})


def test_a_hooks_body_cap(tmp_path: Path) -> None:
    path = tmp_path / "k.toml"
    base = '[hooks.a]\nworkflow = "w"\nformat = "hmac"\nsecret_env = "S"\n'
    path.write_text(base + "max_body_bytes = 4096\n")
    assert load_hooks(str(path), {"S": "s"})["a"].max_body_bytes == 4096
    path.write_text(base)
    assert load_hooks(str(path), {"S": "s"})["a"].max_body_bytes is None
    for bad in ("10", "true", '"4096"', str(512 * 1024 * 1024)):
        path.write_text(base + f"max_body_bytes = {bad}\n")
        with pytest.raises(ConfigError, match="max_body_bytes"):
            load_hooks(str(path), {"S": "s"})


def test_route_templates_are_the_declared_routes_only() -> None:
    app = create_app(Config(), dsn="", workflows=None, routes=ui_routes())
    table = route_templates(app.routes)
    templates = set(table.values())
    assert {"/healthz", "/api/v1/executions/{id}", "/hooks/{name}", "/ui/executions/{id}",
            "/ui/static/{path}", "/ui/{rest:path}", "/ui/"} <= templates
    assert all(t.startswith("/") for t in templates)


def test_refusals_are_one_line_of_json() -> None:
    raw = refusal(431, 'too "big"\n', retry_after=None)
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")
    assert b"connection: close" in head and b"content-type: application/json" in head
    assert int(head.split(b"content-length: ")[1].split(b"\r\n")[0]) == len(body)
    assert body.count(b"\n") == 1 and json.loads(body) == {"error": 'too "big"\n'}
    assert b"retry-after: 1" in refusal(503, "busy", retry_after=1)

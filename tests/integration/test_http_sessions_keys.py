"""Issue 26: real web UI sessions (finding 4), idempotency as the field expects it, `token
revoke` by id only, and bidirectional controls shown escaped (finding 6), against a real
``kestrel-runtime serve`` with workers on PostgreSQL.

Each test failed before its fix: the session cookie was the API token (a bearer token on
the API, alive after logout, one CSRF token for ever); an Idempotency-Key with another
queue, priority, timeout, delay or dedup key returned the first execution; a fork ignored
the key (two POSTs, two forks); new and replayed submits both answered 200; `token revoke
X` also revoked a token named X; U+202E reached the page raw.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

import kestrel
from kestrel.client import SyncClient
from tests.helpers import q, q1, wait_until
from tests.http_helpers import Api
from tests.ui_helpers import UiServer, ui_server

API = "/api/v1"


@pytest.fixture(scope="module")
def server(pg_dsn: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UiServer]:
    with ui_server(pg_dsn, tmp_path_factory.mktemp("keys")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: UiServer) -> Iterator[SyncClient]:
    c = SyncClient(server.dsn, schema=server.schema, pool_size=1)
    yield c
    c.close()


def api(server: UiServer, scope: str) -> Api:
    return Api(server.api.port, token=server.tokens[scope])


def count(server: UiServer, table: str) -> int:
    return int(q1(server.dsn, server.schema, f"SELECT count(*) FROM {{s}}.{table}"))


def waiting(server: UiServer, client: SyncClient) -> str:
    eid = str(client.submit("http.approval", {"alert": "x"}).id)
    wait_until(lambda: client.get(eid).status.value == "waiting", timeout=60, what="waiting")
    return eid


# -- sessions -------------------------------------------------------------------------------


def test_the_session_cookie_is_a_server_side_session_not_the_token(server: UiServer) -> None:
    ui = server.client("operator")
    assert ui.cookie is not None and ui.cookie.startswith("kss_")
    assert server.tokens["operator"] not in ui.cookie
    # The cookie is no bearer token: the API refuses it.
    assert Api(server.api.port, token=ui.cookie).get(f"{API}/queues").status == 401
    assert Api(server.api.port, token=server.tokens["operator"]).get(
        f"{API}/queues").status == 200
    assert ui.get("/ui/queues").status == 200


def test_logout_ends_the_session_on_the_server(server: UiServer, client: SyncClient) -> None:
    ui = server.client("operator")
    eid = waiting(server, client)
    page = ui.get(f"/ui/executions/{eid}")
    csrf = ui.csrf(page)
    sessions = count(server, "ui_sessions")
    out = ui.post_form("/ui/logout", {"csrf": csrf})
    assert out.status == 303 and out.headers["location"] == "/ui/login"
    assert count(server, "ui_sessions") == sessions - 1
    # A copy of the cookie kept after the logout is worth nothing.
    assert ui.get("/ui/").status == 303
    refused = ui.post_form(f"/ui/executions/{eid}/approve", {"csrf": csrf, "name": "approval"})
    assert refused.status == 403
    assert q1(server.dsn, server.schema, "SELECT count(*) FROM {s}.signals "
              "WHERE execution_id = %s", [eid]) == 0
    client.cancel(eid)


def test_each_session_has_its_own_csrf_token(server: UiServer, client: SyncClient) -> None:
    eid = waiting(server, client)
    first, second = server.client("operator"), server.client("operator")
    assert first.cookie != second.cookie
    csrf1 = first.csrf(first.get(f"/ui/executions/{eid}"))
    csrf2 = second.csrf(second.get(f"/ui/executions/{eid}"))
    assert csrf1 != csrf2
    # One session's CSRF token does not work in another.
    crossed = second.post_form(f"/ui/executions/{eid}/cancel", {"csrf": csrf1})
    assert crossed.status == 403 and client.get(eid).status.value == "waiting"
    client.cancel(eid)


def test_an_expired_session_is_refused_by_the_server(server: UiServer) -> None:
    ui = server.client("reader")
    assert ui.get("/ui/").status == 200
    q(server.dsn, server.schema, "UPDATE {s}.ui_sessions SET expires_at = now() - interval "
      "'1 second' WHERE expires_at > now()")
    assert ui.get("/ui/").status == 303  # to the login page, whatever the browser keeps


# -- idempotency ----------------------------------------------------------------------------


def test_a_new_submit_is_201_and_a_replay_200_with_the_same_id(server: UiServer) -> None:
    sub = api(server, "submitter")
    key = f"k-{uuid.uuid4()}"
    body = {"args": [{"a": 1}], "queue": "q1", "priority": 3, "timeout": 60, "delay": 30,
            "dedup_key": f"d-{key}"}
    first = sub.post(f"{API}/workflows/http.echo/submit", body,
                     headers={"Idempotency-Key": key})
    assert first.status == 201, first.body
    again = sub.post(f"{API}/workflows/http.echo/submit", body,
                     headers={"Idempotency-Key": key})
    assert again.status == 200 and again.json()["id"] == first.json()["id"]
    plain = sub.post(f"{API}/workflows/http.echo/submit", {"args": [1]})
    assert plain.status == 201


@pytest.mark.parametrize("change", [
    {"queue": "q2"}, {"priority": 4}, {"timeout": 61}, {"delay": 31}, {"delay": None},
    {"dedup_key": "other"}, {"args": [{"a": 2}]},
])
def test_an_idempotency_key_covers_every_submit_field(server: UiServer,
                                                      change: dict[str, Any]) -> None:
    sub = api(server, "submitter")
    key = f"k-{uuid.uuid4()}"
    body = {"args": [{"a": 1}], "queue": "q1", "priority": 3, "timeout": 60, "delay": 30,
            "dedup_key": f"d-{key}"}
    first = sub.post(f"{API}/workflows/http.echo/submit", body,
                     headers={"Idempotency-Key": key})
    assert first.status == 201, first.body
    before = count(server, "executions")
    other = sub.post(f"{API}/workflows/http.echo/submit",
                     {k: v for k, v in {**body, **change}.items() if v is not None},
                     headers={"Idempotency-Key": key})
    assert other.status == 409, (change, other.status, other.body)
    assert "already used" in other.json()["error"]
    assert count(server, "executions") == before


def test_the_python_client_key_covers_options_and_a_resent_start_time(
        server: UiServer, client: SyncClient) -> None:
    key = f"k-{uuid.uuid4()}"
    at = datetime.now(UTC) + timedelta(hours=1)
    first = client.submit("http.echo", 1, queue="q1", start_at=at, idempotency_key=key)
    # Sent again later with the same start time: the same execution, not a conflict.
    assert client.submit("http.echo", 1, queue="q1", start_at=at,
                         idempotency_key=key).id == first.id
    with pytest.raises(kestrel.IdempotencyConflict):
        client.submit("http.echo", 1, queue="q2", start_at=at, idempotency_key=key)
    with pytest.raises(kestrel.IdempotencyConflict):
        client.submit("http.echo", 1, queue="q1", start_at=at + timedelta(seconds=1),
                      idempotency_key=key)
    wake = q1(server.dsn, server.schema, "SELECT wake_at FROM {s}.workflow_executions "
              "WHERE id = %s", [first.id])
    assert abs((wake - at).total_seconds()) < 1e-3  # the time as sent, by the database
    client.cancel(first.id)


def test_fork_honours_the_idempotency_key(server: UiServer, client: SyncClient) -> None:
    op = api(server, "operator")
    eid = str(client.submit("http.echo", {"x": 1}).id)
    wait_until(lambda: client.get(eid).status.value == "completed", timeout=60, what="done")
    key = f"fork-{uuid.uuid4()}"
    forks = count(server, "forks")
    first = op.post(f"{API}/executions/{eid}/fork", {"from_step": 0},
                    headers={"Idempotency-Key": key})
    assert first.status == 201, first.body
    again = op.post(f"{API}/executions/{eid}/fork", {"from_step": 0},
                    headers={"Idempotency-Key": key})
    assert again.status == 200 and again.json()["id"] == first.json()["id"]
    assert count(server, "forks") == forks + 1
    other = op.post(f"{API}/executions/{eid}/fork", {"from_step": 1},
                    headers={"Idempotency-Key": key})
    assert other.status == 409 and count(server, "forks") == forks + 1
    unkeyed = op.post(f"{API}/executions/{eid}/fork", {"from_step": 0})
    assert unkeyed.status == 201 and count(server, "forks") == forks + 2


def test_openapi_documents_created_and_replayed(server: UiServer) -> None:
    doc = server.api.get(f"{API}/openapi.json", token=None).json()
    for path in (f"{API}/workflows/{{workflow}}/submit", f"{API}/executions/{{id}}/fork"):
        responses = doc["paths"][path]["post"]["responses"]
        assert {"201", "200", "409"} <= set(responses), path
        params = {p["name"]: p for p in doc["paths"][path]["post"]["parameters"]}
        assert "409" in params["Idempotency-Key"]["description"]


# -- token revoke ---------------------------------------------------------------------------


def test_token_revoke_by_id_leaves_a_token_named_like_that_id(server: UiServer) -> None:
    from kestrel.config import Config
    from kestrel.errors import ConfigError
    from kestrel.http.commands import token_command

    cfg = Config(schema=server.schema)
    made, _ = token_command(cfg, server.dsn, "create", {"name": f"a-{uuid.uuid4().hex[:8]}",
                                                        "scopes": "read"})
    # A token named like another's id (made before names that look like ids were refused).
    q(server.dsn, server.schema, "INSERT INTO {s}.http_tokens (id, name, scopes, secret_hash) "
      "VALUES (%s, %s, ARRAY['read'], '\\x00')", ["feedfacefeedface", made["id"]])
    done, _ = token_command(cfg, server.dsn, "revoke", {"token": made["id"]})
    assert done == {"revoked": [made["id"]]}
    assert q1(server.dsn, server.schema, "SELECT revoked_at IS NULL FROM {s}.http_tokens "
              "WHERE id = 'feedfacefeedface'") is True
    # By name (no live token has that id now): the named one.
    done, _ = token_command(cfg, server.dsn, "revoke", {"token": made["id"]})
    assert done == {"revoked": ["feedfacefeedface"]}
    with pytest.raises(ConfigError, match="looks like a token id"):
        token_command(cfg, server.dsn, "create", {"name": "0123456789abcdef", "scopes": "read"})


# -- bidirectional controls -----------------------------------------------------------------

RLO = "\u202e"


def test_bidi_controls_are_shown_escaped_and_sent_back_exactly(
        server: UiServer, client: SyncClient) -> None:
    name = f"evil{RLO}gnp.exe"
    eid = str(client.submit("http.approval", {"alert": name}).id)
    wait_until(lambda: client.get(eid).status.value == "waiting", timeout=60, what="waiting")
    client.signal(eid, f"note{RLO}x", {"t": f"a{RLO}b\u2066c\u200fd"})
    ui = server.client("operator")
    page = ui.get(f"/ui/executions/{eid}").body.decode()
    shown = re.sub(r'value="[^"]*"', "", page)  # form fields must keep the value exactly
    for char in (RLO, "\u2066", "\u200f"):
        assert char not in shown
    assert "evil\\u202egnp.exe" in page and "note\\u202ex" in page
    assert "\\u2066" in page and "\\u200f" in page
    client.cancel(eid)

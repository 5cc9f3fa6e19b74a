"""The web UI over plain HTTP against a real ``kestrel-runtime serve``, real workers and a real
PostgreSQL (through PgBouncer too, KESTREL_TEST_VIA): sessions, scopes, CSRF, every page,
hostile input at every form field and query parameter, and HTML escaping of stored values.
The same flows in a real browser are in tests/browser/test_ui.py."""

from __future__ import annotations

import html
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from kestrel.client import SyncClient
from tests.helpers import q, q1, wait_until
from tests.ui_helpers import FORM_KEY, Browserless, UiServer, ui_server

WAITING_PAGES = ("/ui/", "/ui/queues", "/ui/schedules", "/ui/search", "/ui/counts")


@pytest.fixture(scope="module")
def server(pg_dsn: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UiServer]:
    with ui_server(pg_dsn, tmp_path_factory.mktemp("ui")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: UiServer) -> Iterator[SyncClient]:
    c = SyncClient(server.dsn, schema=server.schema, pool_size=1)
    yield c
    c.close()


def status_of(client: SyncClient, eid: str) -> str:
    return str(client.get(eid).status.value)


def waiting_incident(server: UiServer, client: SyncClient) -> str:
    handle = client.submit("http.approval", {"alert": "disk full"})
    eid = str(handle.id)
    wait_until(lambda: status_of(client, eid) == "waiting", timeout=60, what="waiting")
    return eid


def signals_sent(server: UiServer, eid: str) -> int:
    return int(q1(server.dsn, server.schema,
                  "SELECT count(*) FROM (SELECT execution_id FROM {s}.signals UNION ALL "
                  "SELECT execution_id FROM {s}.signal_history) AS s WHERE execution_id = %s",
                  [eid]))  # sent, whether the execution is live or finished


def one_line_refusal(reply: Any, status: int) -> str:
    """The reply is an HTML error page with *status* and a one-line reason; return it."""
    assert reply.status == status, (reply.status, reply.body[:300])
    assert reply.headers["content-type"].startswith("text/html")
    found = re.search(rb'<p id="reason">(.*?)</p>', reply.body, re.S)
    assert found, reply.body[:300]
    reason = html.unescape(found.group(1).decode())
    assert reason and "\n" not in reason and len(reason) <= 300
    return reason


def test_every_page_sends_a_visitor_without_a_session_to_the_login_page(
        server: UiServer) -> None:
    anon = Browserless(server.api)
    root = anon.get("/")
    assert root.status == 307 and root.headers["location"] == "/ui/"
    for path in (*WAITING_PAGES, f"/ui/executions/{uuid.uuid4()}"):
        reply = anon.get(path + "?x=1" if path == "/ui/search" else path)
        assert reply.status == 303, (path, reply.status)
        assert reply.headers["location"].startswith("/ui/login?next=%2Fui"), path
    anon.cookie = "kst_0123456789abcdef_" + "A" * 43  # well-formed, not a token
    assert anon.get("/ui/").status == 303
    anon.cookie = "<script>"
    assert anon.get("/ui/").status == 303
    login = anon.get("/ui/login")
    assert login.status == 200 and b'name="token"' in login.body


def test_login_checks_the_token_and_sets_a_strict_httponly_cookie(server: UiServer) -> None:
    anon = Browserless(server.api)
    bad = anon.post_form("/ui/login", {"token": server.tokens["operator"][:-1] + "x"})
    assert "invalid or revoked" in one_line_refusal(bad, 401)
    assert "set-cookie" not in {k.lower() for k in bad.headers}
    assert "malformed token" in one_line_refusal(
        anon.post_form("/ui/login", {"token": "'; DROP TABLE x; --"}), 401)
    assert "lacks the 'read' scope" in one_line_refusal(
        anon.post_form("/ui/login", {"token": server.tokens["submitter"]}), 403)
    ok = anon.post_form("/ui/login", {"token": server.tokens["reader"],
                                      "next": "/ui/queues"})
    assert ok.status == 303 and ok.headers["location"] == "/ui/queues"
    cookie = ok.headers["set-cookie"]
    assert cookie.startswith("kestrel_session=kss_") and server.tokens["reader"] not in cookie
    attrs = {a.strip().split("=")[0].lower(): a for a in cookie.split(";")[1:]}
    assert "httponly" in attrs and attrs["samesite"].strip().lower() == "samesite=strict"
    assert attrs["path"].strip() == "Path=/ui" and "secure" not in attrs  # plain HTTP
    for target in ("//evil.example/ui", "https://evil.example/", "/ui\\@evil", "/api/v1/x"):
        away = anon.post_form("/ui/login", {"token": server.tokens["reader"], "next": target})
        assert away.headers["location"] == "/ui/", target
    cross = anon.post_form("/ui/login", {"token": server.tokens["reader"]},
                           headers={"Origin": "https://evil.example"})
    assert "cross-site" in one_line_refusal(cross, 403)


def test_an_operator_approves_a_waiting_execution_through_the_form(
        server: UiServer, client: SyncClient) -> None:
    eid = waiting_incident(server, client)
    ui = server.client("operator")
    listed = ui.get("/ui/?status=waiting")
    assert listed.status == 200 and eid.encode() in listed.body
    page = ui.get(f"/ui/executions/{eid}")
    assert page.status == 200 and b"Waiting for signal <code>approval</code>" in page.body
    key = FORM_KEY.search(page.body)
    assert key
    form = {"csrf": ui.csrf(page), "key": key.group(1).decode(), "name": "approval"}
    sent = ui.post_form(f"/ui/executions/{eid}/approve", form)
    assert sent.status == 303 and sent.headers["location"] == (
        f"/ui/executions/{eid}?done=approve&sent=approve%3A{form['key']}")
    again = ui.post_form(f"/ui/executions/{eid}/approve", form)  # a double press
    if again.status == 303:  # still waiting: the form's key makes it the same signal
        assert again.headers["location"].endswith(
            f"?done=duplicate&sent=approve%3A{form['key']}")
    else:  # the first press already completed it
        assert "already finished" in one_line_refusal(again, 409)
    assert client.result(eid, timeout=60) == {"outcome": "approved", "by": "ana"}
    assert signals_sent(server, eid) == 1
    done = ui.get(f"/ui/executions/{eid}")
    assert b'<span class="status st-completed">completed</span>' in done.body
    assert b"approve" not in done.body.split(b"<main>")[1].split(b"Steps")[0]


def test_forms_refuse_without_a_session_the_operate_scope_or_the_csrf_token(
        server: UiServer, client: SyncClient) -> None:
    eid = waiting_incident(server, client)
    operator = server.client("operator")
    reader = server.client("reader")
    good_csrf = operator.csrf(operator.get(f"/ui/executions/{eid}"))
    reader_page = reader.get(f"/ui/executions/{eid}")
    assert reader_page.status == 200 and b'id="approve"' not in reader_page.body
    assert b"no <code>operate</code> scope" in reader_page.body
    anon = Browserless(server.api)
    for action in ("approve", "reject", "signal", "cancel", "retry"):
        path = f"/ui/executions/{eid}/{action}"
        form = {"csrf": good_csrf, "name": "approval", "payload": "{}"}
        assert "not logged in" in one_line_refusal(anon.post_form(path, form), 403)
        assert "lacks the 'operate'" in one_line_refusal(
            reader.post_form(path, {**form, "csrf": reader.csrf(reader_page)}), 403)
        almost = good_csrf[:-1] + ("1" if good_csrf[-1] == "0" else "0")
        for csrf in ("", "0" * 64, almost, good_csrf.upper(), reader.csrf(reader_page)):
            assert "CSRF" in one_line_refusal(
                operator.post_form(path, {**form, "csrf": csrf}), 403)
        no_field = {k: v for k, v in form.items() if k != "csrf"}
        assert "CSRF" in one_line_refusal(operator.post_form(path, no_field), 403)
        assert "cross-site" in one_line_refusal(operator.post_form(
            path, form, headers={"Origin": "http://evil.example"}), 403)
    assert status_of(client, eid) == "waiting" and signals_sent(server, eid) == 0
    cancelled = operator.post_form(f"/ui/executions/{eid}/cancel", {"csrf": good_csrf})
    assert cancelled.status == 303 and status_of(client, eid) == "cancelled"
    retried = operator.post_form(f"/ui/executions/{eid}/retry", {"csrf": good_csrf})
    assert retried.status == 303
    wait_until(lambda: status_of(client, eid) == "waiting", timeout=60, what="waiting again")
    client.cancel(eid)


def test_a_revoked_token_ends_its_sessions(server: UiServer, client: SyncClient,
                                           tmp_path: Path) -> None:
    from tests.http_helpers import make_token

    token = make_token(server.dsn, server.schema, "short-lived", "read,operate")
    ui = Browserless(server.api)
    ui.login(token)
    eid = waiting_incident(server, client)
    page = ui.get(f"/ui/executions/{eid}")
    assert page.status == 200
    csrf = ui.csrf(page)
    q(server.dsn, server.schema,
      "UPDATE {s}.http_tokens SET revoked_at = now() WHERE name = 'short-lived'")
    assert ui.get("/ui/").status == 303
    refused = ui.post_form(f"/ui/executions/{eid}/approve", {"csrf": csrf, "name": "approval"})
    one_line_refusal(refused, 403)
    assert signals_sent(server, eid) == 0
    client.cancel(eid)


def test_log_out_everywhere_ends_the_tokens_sessions_in_every_browser(
        server: UiServer, client: SyncClient) -> None:
    """Issue 41 row 10: a session in another browser survived logout and could still
    approve; only revoking the token (which also cut its API users) ended it. "Log out
    everywhere" ends every session of the token; the token itself goes on."""
    from tests.http_helpers import Api, make_token

    token = make_token(server.dsn, server.schema, "two-browsers", "read,operate")
    laptop, phone, bystander = Browserless(server.api), Browserless(server.api), \
        server.client("operator")
    laptop.login(token)
    phone.login(token)
    eid = waiting_incident(server, client)
    on_phone = phone.get(f"/ui/executions/{eid}")
    assert on_phone.status == 200 and b'id="logout-everywhere"' in on_phone.body
    # A plain logout on the laptop ends the laptop's session only.
    home = laptop.get("/ui/")
    assert laptop.post_form("/ui/logout", {"csrf": laptop.csrf(home)}).status == 303
    assert laptop.get("/ui/").status == 303 and phone.get("/ui/").status == 200
    laptop.login(token)
    home = laptop.get("/ui/")
    out = laptop.post_form("/ui/logout", {"csrf": laptop.csrf(home), "everywhere": "1"})
    assert out.status == 303
    assert laptop.get("/ui/").status == 303 and phone.get("/ui/").status == 303
    refused = phone.post_form(f"/ui/executions/{eid}/approve",
                              {"csrf": phone.csrf(on_phone), "name": "approval"})
    one_line_refusal(refused, 403)
    assert signals_sent(server, eid) == 0
    # The token still works for the API, and another token's session is untouched.
    assert Api(server.api.port, token=token).get(f"/api/v1/executions/{eid}").status == 200
    assert bystander.get("/ui/").status == 200
    client.cancel(eid)


HOSTILE_QUERIES = [
    ("/ui/?status=%00", 400), ("/ui/?workflow=a%00b", 400), ("/ui/?workflow=%ED%A0%80", 400),
    ("/ui/?status=running%27%20OR%201%3D1", 400), ("/ui/?queue=a%20b", 400),
    ("/ui/?since=yesterday", 400), ("/ui/?cursor=not-a-cursor%21", 400),
    ("/ui/?cursor=" + "A" * 300, 400), ("/ui/?limit=5", 400), ("/ui/?status=a&status=b", 400),
    ("/ui/?workflow=" + "w" * 5000, 414), ("/ui/?workflow=" + "w" * 1100, 400),
    ("/ui/executions/not-a-uuid", 400), ("/ui/executions/%27%3B%20DROP%20TABLE%20x", 400),
    (f"/ui/executions/{uuid.UUID(int=0x5eed)}", 404), ("/ui/executions/" + "1" * 2000, 400),
    ("/ui/search?q=%00", 400), ("/ui/search?q=" + "x" * 201, 400),
    ("/ui/search?status=running", 400), ("/ui/search?until=2026-13-45", 400),
    ("/ui/queues?x=1", 400), ("/ui/counts?x=1", 400), ("/ui/nope", 404),
    ("/ui/executions/{id}?done=%00", 400), ("/ui/executions/{id}?other=1", 400),
]


@pytest.mark.parametrize(("path", "status"), HOSTILE_QUERIES, ids=lambda v: str(v)[:40])
def test_hostile_query_parameters_get_a_one_line_4xx_page(
        server: UiServer, client: SyncClient, path: str, status: int) -> None:
    ui = server.client("reader")
    eid = str(client.submit("http.echo", 1).id)
    one_line_refusal(ui.get(path.replace("{id}", eid)), status)


def test_sql_looking_filters_are_just_text(server: UiServer) -> None:
    ui = server.client("reader")
    for text in ("'; DROP TABLE workflow_executions; --", "%", "_", "\\", "$$", "' OR 1=1"):
        listed = ui.get(f"/ui/?workflow={quote(text)}")
        assert listed.status == 200 and b"No executions match." in listed.body, text
        found = ui.get(f"/ui/search?q={quote(text)}")
        assert found.status == 200, text
    assert q1(server.dsn, server.schema,
              "SELECT count(*) FROM {s}.workflow_executions") is not None


def test_hostile_form_fields_are_refused_before_anything_is_written(
        server: UiServer, client: SyncClient) -> None:
    eid = waiting_incident(server, client)
    ui = server.client("operator")
    csrf = ui.csrf(ui.get(f"/ui/executions/{eid}"))
    path = f"/ui/executions/{eid}/signal"
    cases: list[tuple[str, dict[str, str] | str, int, str]] = [
        (path, {"csrf": csrf, "name": "appr\x00oval"}, 400, "NUL"),
        (path, f"csrf={csrf}&name=%ED%A0%80", 400, "not UTF-8"),
        (path, f"csrf={csrf}&name=approval&payload=%FF", 400, "not UTF-8"),
        (path, {"csrf": csrf, "name": ""}, 400, "required"),
        (path, {"csrf": csrf, "name": "n" * 1025}, 400, "over the limit"),
        (path, {"csrf": csrf, "name": "approval", "payload": "{not json"}, 400, "not JSON"),
        (path, {"csrf": csrf, "name": "approval", "payload": "[" * 5000 + "]" * 5000}, 400,
         "not JSON"),
        (path, {"csrf": csrf, "name": "approval", "payload": '"\\ud800"'}, 400, "not JSON"),
        (path, {"csrf": csrf, "name": "approval", "payload": "x" * 300_000}, 413, "cap"),
        (path, f"csrf={csrf}&name=a&name=b", 400, "twice"),
        (f"/ui/executions/{eid}/explode", {"csrf": csrf}, 404, "unknown action"),
        ("/ui/executions/not-a-uuid/cancel", {"csrf": csrf}, 400, "not an execution id"),
        (f"/ui/executions/{uuid.uuid4()}/cancel", {"csrf": csrf}, 404, "no execution"),
        (f"/ui/executions/{eid}/approve", {"csrf": csrf, "key": "k" * 65,
                                           "name": "approval"}, 400, "over the limit"),
    ]
    for target, form, status, words in cases:
        reason = one_line_refusal(ui.post_form(target, form), status)
        assert words.lower() in reason.lower(), (form if isinstance(form, str) else
                                                 {k: v[:40] for k, v in form.items()}, reason)
    as_json = ui.api.post(path, {"csrf": csrf, "name": "approval"}, token=None,
                          headers={"Cookie": f"kestrel_session={ui.cookie}"})
    assert "expected a form" in one_line_refusal(as_json, 400)
    assert status_of(client, eid) == "waiting" and signals_sent(server, eid) == 0
    sent = ui.post_form(path, {"csrf": csrf, "name": "approval",
                               "payload": '{"approved": false, "by": "<b>x</b>"}'})
    assert sent.status == 303
    assert client.result(eid, timeout=60) == {"outcome": "rejected", "by": "<b>x</b>"}


SCRIPT = "<script>alert('x')</script>"


def test_stored_values_are_html_escaped_on_every_page(server: UiServer,
                                                      client: SyncClient) -> None:
    eid = str(client.submit("ui.hostile", SCRIPT).id)
    wait_until(lambda: status_of(client, eid) == "failed", timeout=60, what="failed")
    unknown = q1(server.dsn, server.schema, "SELECT {s}.submit(%s, %s::jsonb)",
                 [SCRIPT + "<i>", '["<i>"]'])  # no worker knows it: it stays queued, listed
    ui = server.client("operator")
    escaped = b"&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;"
    page = ui.get(f"/ui/executions/{eid}")
    assert page.status == 200
    assert SCRIPT.encode() not in page.body
    assert page.body.count(escaped) >= 3  # step error, execution error, event
    assert b"&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;" in page.body
    assert b'\\u003cscript' not in page.body  # JSON shown as text, escaped once, readable
    for path in ("/ui/", f"/ui/executions/{unknown}", "/ui/search?q=alert",
                 f"/ui/search?q={quote(SCRIPT)}", "/ui/queues",
                 # a filter carried into the select-all links and the bulk action's page
                 f"/ui/?workflow={quote(SCRIPT)}", f"/ui/bulk/cancel?workflow={quote(SCRIPT)}",
                 f"/ui/bulk/signal?workflow={quote(SCRIPT + '<i>')}"):
        reply = ui.get(path)
        assert reply.status == 200, path
        assert b"<script>alert" not in reply.body and b"<i>" not in reply.body, path
    listed = ui.get("/ui/")
    assert escaped in listed.body
    found = ui.get("/ui/search?q=alert")
    assert eid.encode() in found.body and b"RuntimeError: " + escaped in found.body
    refused = ui.get(f"/ui/executions/{quote(SCRIPT)}")
    assert SCRIPT.encode() not in refused.body
    client.cancel(str(unknown))


def test_pages_show_queues_schedules_search_and_live_counts(server: UiServer,
                                                            client: SyncClient) -> None:
    done = str(client.submit("http.steps", 3).id)
    assert client.result(done, timeout=60) == 3 * 2 + 2
    ui = server.client("reader")
    page = ui.get(f"/ui/executions/{done}")
    assert page.status == 200
    assert page.body.count(b'<span class="name">http.double</span>') == 2
    assert b"Children <small" in page.body and b"http.echo" in page.body
    assert b"<dt>stage</dt>" in page.body
    counts = ui.get("/ui/counts")
    assert counts.status == 200
    data = counts.json()
    assert set(data) == {"live", "finished_24h"} and data["finished_24h"]["completed"] >= 2
    parked = str(client.submit("http.approval", {}).id)
    wait_until(lambda: status_of(client, parked) == "waiting", timeout=60, what="waiting")
    queues = ui.get("/ui/queues")
    assert queues.status == 200
    row = re.search(rb'>default</a></td>(.*?)</tr>', queues.body, re.S)
    assert row, queues.body
    waiting = int(re.findall(rb'<td class="num">(\d+)</td>', row.group(1))[2])
    assert waiting == int(q1(server.dsn, server.schema, "SELECT count(*) FROM "
                             "{s}.workflow_executions WHERE status = 'waiting'")) >= 1
    # Live workers and the work none of them can claim (FAULTS P4: listed, never failed).
    assert b"No live worker." not in queues.body
    version = q1(server.dsn, server.schema, "SELECT app_version FROM {s}.workers LIMIT 1")
    assert f'<td class="mono">{version}</td>'.encode() in queues.body
    nobody = q1(server.dsn, server.schema, "SELECT {s}.submit('ui.nobody', '[]'::jsonb)")
    listed = ui.get("/ui/queues")
    section = listed.body.split(b'id="unclaimable"')[1].split(b"</section>")[0]
    assert b">ui.nobody</a>" in section and b'<td class="num">1</td>' in section
    assert status_of(client, str(nobody)) == "queued"
    client.cancel(str(nobody))
    client.cancel(parked)
    assert ui.get("/ui/schedules").status == 200
    jump = ui.get(f"/ui/search?q={done}")
    assert jump.status == 303 and jump.headers["location"] == f"/ui/executions/{done}"
    found = ui.get("/ui/search?q=http.steps&status=completed")
    assert found.status == 200 and done.encode() in found.body
    first = ui.get("/ui/")
    for header in ("content-security-policy", "x-frame-options", "x-content-type-options"):
        assert header in {k.lower() for k in first.headers}
    assert ui.get("/ui/static/ui.css").status == 200


def test_tokens_and_cookies_never_reach_the_server_log(server: UiServer) -> None:
    """S5 for the UI: logins, pages and refused forms leave no token in the log."""
    for scope in ("operator", "reader"):
        server.client(scope).get("/ui/")
    Browserless(server.api).post_form("/ui/login", {"token": server.tokens["operator"] + "x"})
    text = server.log.read_text()
    for token in server.tokens.values():
        secret = token[len("kst_0123456789abcdef_"):]
        assert secret not in text and token not in text


def test_long_timelines_and_large_values_are_cut_not_sent_whole(
        server: UiServer, client: SyncClient) -> None:
    from kestrel.http.ui import SHOWN_CHARS, TIMELINE_STEPS

    eid = str(client.submit("ui.many", TIMELINE_STEPS + 7, 3000).id)
    assert client.result(eid, timeout=120) == TIMELINE_STEPS + 7
    page = server.client("reader").get(f"/ui/executions/{eid}")
    assert page.status == 200
    assert page.body.count(b'<span class="name">ui.echo</span>') == TIMELINE_STEPS
    assert b"and 7 later steps not drawn here" in page.body
    assert b"more characters not shown" in page.body
    # Each output is cut to SHOWN_CHARS: the page holds no whole 3,000-character value.
    assert b"x" * (SHOWN_CHARS + 1) not in page.body
    assert len(page.body) < TIMELINE_STEPS * (SHOWN_CHARS + 1000)

    long_error = "<b>" + "e" * 20_000
    failed = str(client.submit("ui.hostile", long_error).id)
    wait_until(lambda: status_of(client, failed) == "failed", timeout=60, what="failed")
    shown = server.client("reader").get(f"/ui/executions/{failed}")
    assert b"e" * (SHOWN_CHARS + 1) not in shown.body and b"<b>" not in shown.body
    searched = server.client("reader").get("/ui/search?q=eeeeeeee")
    assert failed.encode() in searched.body and b"e" * 400 not in searched.body


def test_approve_answers_the_wait_it_shows_whatever_line_breaks_its_name_has(
        server: UiServer, client: SyncClient) -> None:
    """A form sends a line break as CRLF (HTML's form encoding), so a hidden field holding
    ``go\\nnow`` comes back as ``go\\r\\nnow``: Approve used to signal that name, which nobody
    waited for, and say "Approval sent." (issue 26). Now it answers the wait it showed, and
    an Approve that matches no wait sends nothing and says so."""
    ui = server.client("operator")
    for name in ("go\nnow", "go\rnow", "go\r\nnow"):
        eid = str(client.submit("ui.waits_for", name).id)
        wait_until(lambda eid=eid: status_of(client, eid) == "waiting", timeout=60,
                   what="the wait")
        page = ui.get(f"/ui/executions/{eid}")
        key = FORM_KEY.search(page.body)
        assert key
        as_sent = name.replace("\r\n", "\n").replace("\r", "\n").replace("\n", "\r\n")
        form = {"csrf": ui.csrf(page), "key": key.group(1).decode(), "name": as_sent}
        sent = ui.post_form(f"/ui/executions/{eid}/approve", form)
        assert sent.status == 303 and "?done=approve&sent=approve%3A" in sent.headers[
            "location"]
        assert q1(server.dsn, server.schema, "SELECT name FROM {s}.signals WHERE "
                  "execution_id = %s UNION ALL SELECT name FROM {s}.signal_history WHERE "
                  "execution_id = %s", [eid, eid]) == name
        assert client.result(eid, timeout=60)["approved"] is True
    eid = str(client.submit("ui.waits_for", "approval").id)
    wait_until(lambda: status_of(client, eid) == "waiting", timeout=60, what="the wait")
    page = ui.get(f"/ui/executions/{eid}")
    stale = {"csrf": ui.csrf(page), "name": "approval-v1"}  # a form from an older wait
    assert "nothing was sent" in one_line_refusal(
        ui.post_form(f"/ui/executions/{eid}/approve", stale), 409)
    assert signals_sent(server, eid) == 0
    client.cancel(eid)


# -- what on-call sees first (issue 27) -------------------------------------------------------


def text_of(fragment: bytes) -> str:
    """The text a browser shows of an HTML *fragment* whose tags are inline ones (or
    separated by white space): tags dropped, entities decoded, white space collapsed."""
    return " ".join(html.unescape(re.sub(rb"<[^>]*>", b"", fragment).decode()).split())


def listed_waits(body: bytes) -> dict[str, str]:
    """What the executions list says each row waits for (the text a browser shows), by
    execution id; "" for a row that does not wait."""
    rows = re.finditer(rb'<tr>\s*<td><a class="mono" href="/ui/executions/([0-9a-f-]{36})"'
                       rb'(.*?)</tr>', body, re.S)
    return {m.group(1).decode(): text_of(w.group(1)) if (
        w := re.search(rb'<div class="wait">(.*?)</div>', m.group(2), re.S)) else ""
        for m in rows}


def inside(body: bytes, ident: str, tag: str = "section") -> bytes:
    """What the element with id *ident* holds (up to its first closing *tag*)."""
    found = re.search(rb'id="%s"[^>]*>(.*?)</%s>' % (ident.encode(), tag.encode()), body,
                      re.S)
    assert found, f"no element {ident!r} on the page"
    return found.group(1)


def hold(server: UiServer, eid: str, queue: str = "ui-held") -> None:
    """Move a waiting execution to a queue no worker claims (and back with "default"): a
    signal then arrives and stays unconsumed, whatever the workers' speed."""
    q(server.dsn, server.schema,
      "UPDATE {s}.workflow_executions SET queue = %s WHERE id = %s", [queue, eid])


def test_the_list_says_what_each_waiting_row_waits_for_and_since_when(
        server: UiServer, client: SyncClient) -> None:
    hostile = "<script>alert(1)</script>\u202egnp.exe"
    signal = waiting_incident(server, client)  # http.approval: signal "approval"
    named = str(client.submit("ui.waits_for", hostile).id)
    given = str(client.submit("ui.waits_for", "later").id)
    sleeping = str(client.submit("ui.sleeps", 3600).id)
    parent = str(client.submit("ui.parent", "go").id)
    delayed = str(client.submit("http.echo", 1, delay=3600).id)
    finished = str(client.submit("http.echo", 2).id)
    assert client.result(finished, timeout=60) == 2
    for eid in (named, given, sleeping, parent, delayed):
        wait_until(lambda eid=eid: status_of(client, eid) == "waiting", timeout=60,
                   what="the wait")
    wait_until(lambda: q1(server.dsn, server.schema, "SELECT waiting_for FROM "
                          "{s}.workflow_executions WHERE id = %s", [parent]) is not None,
               timeout=60, what="the parent at its child")
    child = str(q1(server.dsn, server.schema,
                   "SELECT id FROM {s}.workflow_executions WHERE parent_id = %s", [parent]))
    wait_until(lambda: status_of(client, child) == "waiting", timeout=60, what="the child")
    # Parked twelve minutes ago as the database records it (park and give_back write
    # updated_at, nothing else does while it waits); and one given back by v1 twice.
    q(server.dsn, server.schema, "UPDATE {s}.workflow_executions "
      "SET updated_at = {s}.kestrel_now() - interval '12 minutes' WHERE id = %s", [signal])
    q(server.dsn, server.schema, "UPDATE {s}.workflow_executions SET given_back_at = "
      "{s}.kestrel_now(), given_back_by = %s, give_backs = 2 WHERE id = %s", [["v1"], given])
    since = q1(server.dsn, server.schema, "SELECT to_char(updated_at AT TIME ZONE 'UTC', "
               "'YYYY-MM-DD HH24:MI') FROM {s}.workflow_executions WHERE id = %s", [signal])

    ui = server.client("reader")
    page = ui.get("/ui/?status=waiting")
    assert page.status == 200
    rows = listed_waits(page.body)
    assert rows[signal] == f"waiting for signal approval · since 12 min ({since} UTC)"
    assert re.search(r"waiting for signal <script>alert\(1\)</script>\\u202egnp\.exe · "
                     r"since \d+ s \(\d{4}-\d\d-\d\d \d\d:\d\d UTC\)$", rows[named]), rows[named]
    assert b"<script>alert(1)" not in page.body and "\u202e".encode() not in page.body
    assert ("waiting for a worker of a newer app version (given back by v1, 2 times; at "
            "signal later) · since") in rows[given]
    assert re.fullmatch(r"sleeping until \d{4}-\d\d-\d\d \d\d:\d\d UTC · since \d+ s "
                        r"\(.* UTC\)", rows[sleeping]), rows[sleeping]
    assert f"waiting for child {child[:8]} · since" in rows[parent]
    assert f'href="/ui/executions/{child}"'.encode() in page.body
    assert "waiting for signal go · since" in rows[child]
    assert "waiting for its delayed start at " in rows[delayed]
    everything = listed_waits(ui.get("/ui/").body)  # the same on the unfiltered list
    assert everything[signal] == rows[signal] and everything[finished] == ""
    for eid in (signal, named, given, sleeping, parent, delayed):
        client.cancel(eid)


def test_the_alert_comes_first_and_a_failure_shows_its_traceback_as_text(
        server: UiServer, client: SyncClient) -> None:
    ui = server.client("operator")
    eid = waiting_incident(server, client)
    body = ui.get(f"/ui/executions/{eid}").body
    # The wait and its answer come before the facts and the step timeline.
    assert (body.index(b'id="waiting"') < body.index(b'id="approve"')
            < body.index(b'<dl class="facts">') < body.index(b'<ol class="timeline">'))
    assert re.search(r"Waiting for signal approval Since \d+ s \(\d{4}-\d\d-\d\d "
                     r"\d\d:\d\d:\d\d UTC\); times out at ",
                     text_of(inside(body, "waiting")))
    client.cancel(eid)

    failed = str(client.submit("ui.breaks", "line one\nline <two> \u202e").id)
    wait_until(lambda: status_of(client, failed) == "failed", timeout=60, what="failed")
    body = ui.get(f"/ui/executions/{failed}").body
    assert (body.index(b'id="failure"') < body.index(b'<dl class="facts">')
            < body.index(b'<ol class="timeline">'))
    alert = inside(body, "failure")
    # Its answer (Retry) in the alert, above the tracebacks, and nowhere else.
    assert body.count(b'id="retry"') == 1
    assert alert.index(b'id="retry"') < alert.index(b'id="step-traceback"')
    assert b"<two>" not in body and "\u202e".encode() not in body and b"\x00" not in body
    raised = "line one\nline <two> \\u202e\\x00\\ud800"  # as stored, then shown
    assert text_of(alert).startswith("Failed: kestrel.errors.StepFailed step 'ui.breaks_badly'"
                                     " failed: builtins.RuntimeError: line one line <two>")
    message = re.search(rb'id="failure-message">(.*?)</p>', alert, re.S)
    assert message and html.unescape(message.group(1).decode()) == (
        f"step 'ui.breaks_badly' failed: builtins.RuntimeError: {raised}")

    def lines_of(ident: str) -> list[str]:
        found = re.search(rb'<pre class="traceback" id="%s">(.*?)</pre>' % ident.encode(),
                          alert, re.S)
        assert found, ident
        return html.unescape(found.group(1).decode()).splitlines()

    # Real line breaks, not the JSON string's \n: one line per frame, the exception last;
    # the step's own (where the code raised) and the workflow's.
    step, workflow = lines_of("step-traceback"), lines_of("traceback")
    for lines in (step, workflow):
        assert lines[0] == "Traceback (most recent call last):"
        assert sum(line.startswith('  File "') for line in lines) >= 2
    assert any("ui_app.py" in line for line in step)
    assert "\n".join(step).endswith(f"RuntimeError: {raised}")
    assert "\n".join(workflow).endswith(
        f"kestrel.errors.StepFailed: step 'ui.breaks_badly' failed: builtins.RuntimeError: "
        f"{raised}")
    assert re.search(r"Raised at step #\d+ ui\.breaks_badly \(attempt \d+\) Traceback",
                     text_of(alert))
    raw = re.search(rb'<details><summary>Raw error \(JSON\)</summary><pre id="raw-error">'
                    rb'(.*?)</pre></details>', alert, re.S)
    assert raw and '"type": "kestrel.errors.StepFailed"' in html.unescape(
        raw.group(1).decode())
    assert b"Traceback (most recent call last):\\n" in raw.group(1)  # the JSON, as stored


def held_incident_page(server: UiServer, client: SyncClient) -> tuple[str, Any, Any, Any]:
    """A waiting incident no worker takes, the operator's UI client, its page and the page's
    form key (a match: ``key.group(1)``)."""
    eid = waiting_incident(server, client)
    hold(server, eid)
    ui = server.client("operator")
    page = ui.get(f"/ui/executions/{eid}")
    key = FORM_KEY.search(page.body)
    assert key
    return eid, ui, page, key


def test_after_approve_the_page_shows_what_was_sent_and_the_new_state(
        server: UiServer, client: SyncClient) -> None:
    """POST/redirect/GET: the page read again after the form says what was sent (read back
    from the database) and shows the new state: the signal received, no Approve button,
    and a state that changes (for the page's script to reload) when the execution moves."""
    eid, ui, page, key = held_incident_page(server, client)
    csrf = ui.csrf(page)
    state_url = f"/ui/executions/{eid}/state"
    state = ui.get(state_url).json()
    assert state["status"] == "waiting" and f'data-state="{state["state"]}"'.encode() in (
        page.body)

    # A signal of another name, hostile: told back escaped; the wait is still open.
    other = ui.post_form(f"/ui/executions/{eid}/signal", {
        "csrf": csrf, "key": key.group(1).decode(), "name": "<i>note</i>\u202e",
        "payload": '{"<b>": "\u202e"}'})
    assert other.status == 303
    told = ui.get(other.headers["location"])
    assert told.status == 200
    assert b"<i>note" not in told.body and b"<b>" not in told.body
    assert "\u202e".encode() not in told.body
    notice = text_of(inside(told.body, "notice", "div"))
    assert notice.startswith("Signal sent. Signal <i>note</i>\\u202e, sent ")
    assert notice.endswith('UTC, with payload: { "<b>": "\\u202e" }')
    assert b'id="approve"' in told.body

    sent = ui.post_form(f"/ui/executions/{eid}/approve",
                        {"csrf": csrf, "key": key.group(1).decode(), "name": "approval"})
    assert sent.status == 303
    assert sent.headers["location"] == (
        f"/ui/executions/{eid}?done=approve&sent=approve%3A{key.group(1).decode()}")
    after = ui.get(sent.headers["location"])
    assert after.status == 200
    notice = text_of(inside(after.body, "notice", "div"))
    assert notice.startswith("Approval sent. Signal approval, sent ")
    assert notice.endswith('UTC, with payload: { "by": "ana", "via": "web UI", '
                           '"approved": true }')  # as stored (jsonb orders keys)
    assert b'id="approve"' not in after.body and b'id="reject"' not in after.body
    assert "Signal approval received: the execution resumes when a worker claims it" in (
        text_of(after.body))
    moved = ui.get(state_url).json()
    assert moved["status"] == "waiting" and moved["state"] != state["state"]
    assert f'data-state="{moved["state"]}"'.encode() in after.body

    hold(server, eid, "default")
    assert client.result(eid, timeout=60) == {"outcome": "approved", "by": "ana"}
    assert ui.get(state_url).json() == {"state": None, "status": "completed"}
    done = ui.get(sent.headers["location"])  # the notice still says what was sent
    assert b"Approval sent. Signal <code>approval</code>" in done.body
    assert b"data-state" not in done.body
    assert ui.get(f"/ui/executions/{eid}?done=approve&sent=" + "x" * 81).status == 400
    assert Browserless(server.api).get(state_url).status == 303  # no session: login


def test_a_fork_links_its_source_and_shows_reused_steps_and_markers_in_place(
        server: UiServer, client: SyncClient) -> None:
    """Issue 27: a fork's page showed its copied steps at negative offsets, patch markers as
    step #-1, no link to the execution it came from, and "Claims 0" on one that ran."""
    source = str(client.submit("ui.many", 3, 10).id)
    assert client.result(source, timeout=60) == 3
    fork = str(client.fork(source, 2).id)
    assert client.result(fork, timeout=60) == 3
    # A patch marker in the source's history (after the fork: this app knows no patch).
    q1(server.dsn, server.schema, "INSERT INTO {s}.operation_outputs (execution_id, "
       "step_id, step_name, output, attempt, lease_epoch, started_at, finished_at) "
       "SELECT id, -1, 'kestrel.patch:p1', '{{\"at\": 1}}', 1, 1, finished_at, finished_at "
       "FROM {s}.workflow_history WHERE id = %s RETURNING 1", [source])
    page = server.client("reader").get(f"/ui/executions/{fork}").body.decode()
    assert f'id="forked-from" href="/ui/executions/{source}"' in page
    assert "reused from the execution it was forked from" in page
    assert "+-" not in page  # no negative offset anywhere
    shown = server.client("reader").get(f"/ui/executions/{source}").body.decode()
    assert 'id="forked-from"' not in shown and "#-1" not in shown
    steps = re.findall(r'<span class="num">([^<]+)</span>', shown)
    assert steps[:3] == ["#0", "patch", "#1"], steps  # the marker where it marks
    assert "new code&#39;s path from step 1 on" in shown or "new code's path from step 1 on" \
        in shown
    assert "<dt>Attempts</dt><dd>1 <small" in shown and "Claims" not in shown


def test_a_notice_comes_from_the_database_never_from_the_link(
        server: UiServer, client: SyncClient) -> None:
    """Issue 41 row 9: ``?done=approve`` said "Approval sent." when nothing was sent. A
    notice now shows only what the database bears out: the signal sent under the form's
    key, a cancelled execution, a retried one."""
    eid, ui, page, key = held_incident_page(server, client)
    for link in ("?done=approve", "?done=reject", "?done=signal", "?done=duplicate",
                 f"?done=approve&sent=approve%3A{key.group(1).decode()}",
                 "?done=approve&sent=approve%3Anever-sent", "?done=cancel", "?done=retry"):
        forged = ui.get(f"/ui/executions/{eid}{link}")
        assert forged.status == 200, link
        assert b'id="notice"' not in forged.body, link
    assert signals_sent(server, eid) == 0
    assert status_of(client, eid) == "waiting"
    # The real thing still says what happened.
    sent = ui.post_form(f"/ui/executions/{eid}/approve",
                        {"csrf": ui.csrf(page), "key": key.group(1).decode(),
                         "name": "approval"})
    assert sent.status == 303
    assert b"Approval sent." in ui.get(sent.headers["location"]).body
    cancelled = ui.post_form(f"/ui/executions/{eid}/cancel", {"csrf": ui.csrf(page)})
    assert cancelled.status == 303
    after = ui.get(cancelled.headers["location"])
    assert b"Cancelled." in after.body
    # Cancelled: a retry link without the form's retry says nothing; the form's, sent twice
    # (a double click), retries once and says so.
    assert b'id="notice"' not in ui.get(f"/ui/executions/{eid}?done=retry").body
    retry_key = FORM_KEY.search(after.body)
    assert retry_key
    form = {"csrf": ui.csrf(after), "key": retry_key.group(1).decode()}
    retried = [ui.post_form(f"/ui/executions/{eid}/retry", form) for _ in range(2)]
    assert [r.status for r in retried] == [303, 303]
    assert retried[0].headers["location"] == (
        f"/ui/executions/{eid}?done=retry&sent=retry%3A{form['key']}")
    assert b"Queued again from its last checkpoint." in ui.get(
        retried[1].headers["location"]).body

"""The HTTP door without a database: signatures checked against the senders' own published
test vectors, the hooks' configuration, Slack actions, tokens, cursors and the OpenAPI
document."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from kestrel.errors import ConfigError
from kestrel.http import auth
from kestrel.http.app import ENDPOINTS
from kestrel.http.hooks import (
    Hook,
    SignatureError,
    load_hooks,
    slack_action,
    slack_event_key,
    slack_reply,
    verify,
)
from kestrel.http.openapi import document
from kestrel.http.refusals import Refusal
from kestrel.http.requests import decode_cursor, encode_cursor, parse_json

# GitHub's documented example ("Validating webhook deliveries").
GH_SECRET, GH_BODY = "It's a Secret to Everybody", b"Hello, World!"
GH_SIG = "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17"
# Slack's documented example ("Verifying requests from Slack").
SLACK_SECRET, SLACK_TS = "8f742231b10e8888abcd99yyyzzz85a5", 1531420618
SLACK_BODY = (
    b"token=xyzz0WbapA4vBCDEFasx0q6G&team_id=T1DC2JH3J&team_domain=testteamnow&channel_id="
    b"G8PSS9T3V&channel_name=foobar&user_id=U2CERLKJA&user_name=roadrunner&command=%2Fwebho"
    b"ok-collect&text=&response_url=https%3A%2F%2Fhooks.slack.com%2Fcommands%2FT1DC2JH3J%2F3"
    b"97700885554%2F96rGlfmibIGlgcZRskXaIFfN&trigger_id=398738663015.47445629121.803a0bc887"
    b"a14d10d2c447fce8b6703c")
SLACK_SIG = "v0=a2114d57b48eac39b9ad189dd8316235a7b4a8d21a10bd27519666489c69b503"


def hook(fmt: str, secret: str) -> Hook:
    return Hook(name="h", workflow="wf", format=fmt, secret=secret.encode())


def test_github_published_vector() -> None:
    gh = hook("github", GH_SECRET)
    headers = {"x-hub-signature-256": GH_SIG, "x-github-delivery": "d-1"}
    assert verify(gh, headers, GH_BODY) == "hook:h:github:" + GH_SIG.removeprefix("sha256=")
    # The key is the signed content's: another delivery id, the same key.
    assert verify(gh, {**headers, "x-github-delivery": "d-2"}, GH_BODY) == verify(
        gh, headers, GH_BODY)
    for bad in ({**headers, "x-hub-signature-256": GH_SIG[:-1] + "8"},
                {**headers, "x-hub-signature-256": GH_SIG.upper()},
                {"x-github-delivery": "d-1"}):
        with pytest.raises(SignatureError):
            verify(gh, bad, GH_BODY)
    with pytest.raises(SignatureError, match="does not match"):
        verify(gh, headers, GH_BODY + b" ")


def test_slack_published_vector_and_window() -> None:
    sl = hook("slack", SLACK_SECRET)
    headers = {"x-slack-signature": SLACK_SIG, "x-slack-request-timestamp": str(SLACK_TS)}
    key = verify(sl, headers, SLACK_BODY, now=SLACK_TS + 299)
    assert key.startswith("hook:h:slack:") and SLACK_SIG not in key
    assert verify(sl, headers, SLACK_BODY, now=SLACK_TS - 299) == key
    for now in (SLACK_TS + 301, SLACK_TS - 301):
        with pytest.raises(SignatureError, match="5 minutes"):
            verify(sl, headers, SLACK_BODY, now=now)
    with pytest.raises(SignatureError, match="does not match"):
        verify(sl, {**headers, "x-slack-request-timestamp": str(SLACK_TS + 1)}, SLACK_BODY,
               now=SLACK_TS)
    with pytest.raises(SignatureError):
        verify(sl, {**headers, "x-slack-request-timestamp": "1e9"}, SLACK_BODY, now=SLACK_TS)


def test_generic_hmac_key_is_the_signature_not_a_header() -> None:
    h = hook("hmac", GH_SECRET)
    headers = {"x-signature-256": GH_SIG}
    assert verify(h, headers, GH_BODY) == verify(h, {**headers, "idempotency-key": "new"},
                                                 GH_BODY)


def test_hooks_config(tmp_path: Path) -> None:
    path = tmp_path / "k.toml"
    path.write_text('procs = 2\n[hooks.gh]\nworkflow = "w"\nformat = "github"\n'
                    'secret_env = "S"\nqueue = "ci"\n')
    hooks = load_hooks(str(path), {"S": "s3cr3t-value"})
    assert hooks["gh"].queue == "ci" and "s3cr3t" not in repr(hooks["gh"])
    assert load_hooks(None) == {}
    with pytest.raises(ConfigError, match=r"variable S .*unset"):
        load_hooks(str(path), {})
    for table in ('[hooks.gh]\nworkflow = "w"\nformat = "gitlab"\nsecret_env = "S"\n',
                  '[hooks.gh]\nworkflow = "w"\nsecret_env = "S"\n',
                  '[hooks.gh]\nworkflow = "w"\nformat = "hmac"\nsecret_env = "S"\nx = 1\n',
                  '[hooks."a b"]\nworkflow = "w"\nformat = "hmac"\nsecret_env = "S"\n',
                  '[hooks.gh]\nworkflow = "w"\nformat = "hmac"\nsecret_env = "S"\nqueue = "a b"\n',
                  '[hooks.gh]\nworkflow = "a\\u0000"\nformat = "hmac"\nsecret_env = "S"\n',
                  '[hooks.gh]\nworkflow = "w"\nformat = "hmac"\nsecret_env = "S"\n'
                  'events = ["push"]\n',
                  '[hooks.gh]\nworkflow = "w"\nformat = "github"\nsecret_env = "S"\n'
                  'events = "push"\n'):
        path.write_text(table)
        with pytest.raises(ConfigError) as err:
            load_hooks(str(path), {"S": "x"})
        assert "\n" not in str(err.value)


def test_the_runtime_config_accepts_hooks_tables(tmp_path: Path) -> None:
    from kestrel.config import load

    path = tmp_path / "k.toml"
    path.write_text('procs = 3\n[hooks.gh]\nworkflow = "w"\nformat = "github"\n'
                    'secret_env = "S"\n')
    assert load({}, environ={}, config_file=str(path)).procs == 3


def test_slack_actions() -> None:
    press = {"type": "block_actions", "user": {"id": "U1", "username": "ana"},
             "channel": {"id": "C1", "name": "ops"},
             "actions": [{"action_id": "reject", "value": "e-1", "action_ts": "17.5"}]}
    action = slack_action(press)
    assert action is not None and not action.approved and action.by == "ana"
    assert action.key == "slack:reject:e-1:17.5"
    assert (action.user_id, action.channel_id) == ("U1", "C1")
    # Every other interaction is none of ours: acknowledged, never refused.
    for other in ([], "x", {"type": "view_submission"}, {"type": "shortcut"},
                  {**press, "actions": []},
                  {**press, "actions": [{"action_id": "ok", "value": "e", "action_ts": "1"}]},
                  {**press, "actions": [{"action_id": "open", "url": "https://x.example"}]}):
        assert slack_action(other) is None
    for bad in ({**press, "actions": [{"action_id": "approve", "value": 5, "action_ts": "1"}]},
                {**press, "actions": [{"action_id": "approve", "value": "e"}]}):
        with pytest.raises(ValueError):
            slack_action(bad)


def test_slack_events_are_keyed_by_their_event_id() -> None:
    h = hook("slack", "s")
    assert slack_event_key(h, {"type": "event_callback", "event_id": "Ev1"}) == (
        "hook:h:slack:event:Ev1")
    assert slack_event_key(h, {"type": "url_verification"}) is None
    assert slack_event_key(h, [1]) is None
    for bad in ({"type": "event_callback"}, {"type": "event_callback", "event_id": 7}):
        with pytest.raises(ValueError):
            slack_event_key(h, bad)


def test_slack_reply_is_a_message_with_mrkdwn_escaped() -> None:
    assert slack_reply("Started <a> & b") == {"response_type": "ephemeral",
                                              "text": "Started &lt;a&gt; &amp; b"}


def test_hooks_config_allow_lists_argument_and_size(tmp_path: Path) -> None:
    path = tmp_path / "k.toml"
    path.write_text('[hooks.s]\nworkflow = "w"\nformat = "slack"\nsecret_env = "S"\n'
                    'approval_users = ["U1"]\napproval_channels = ["C1"]\n'
                    'approval_workflows = ["incident"]\n'
                    '[hooks.g]\nworkflow = "w"\nformat = "github"\nsecret_env = "S"\n'
                    'argument = "envelope"\nmax_body_bytes = 26214400\n')
    hooks = load_hooks(str(path), {"S": "x"})
    s, g = hooks["s"], hooks["g"]
    assert g.argument == "envelope" and g.max_body_bytes == 26214400 and s.argument == "body"
    press = slack_action({"type": "block_actions", "user": {"id": "U1"},
                          "channel": {"id": "C1"},
                          "actions": [{"action_id": "approve", "value": "e",
                                       "action_ts": "1"}]})
    assert press is not None
    assert s.refuses(press, "incident") is None and g.refuses(press, "other") is None
    assert "workflow" in str(s.refuses(press, "other"))
    for table in ('argument = "envelope"', 'approval_users = "U1"', 'approval_users = [1]',
                  'max_body_bytes = 10', 'max_body_bytes = true', 'argument = "raw"'):
        fmt = "github" if "approval" in table else "slack"
        path.write_text(f'[hooks.h]\nworkflow = "w"\nformat = "{fmt}"\nsecret_env = "S"\n'
                        f'{table}\n')
        with pytest.raises(ConfigError):
            load_hooks(str(path), {"S": "x"})


def test_tokens() -> None:
    token = auth.new_token()
    parts = auth.split(f"Bearer {token.text}")
    assert parts == (token.id, token.text[21:])
    row = ("ci", ["read"], token.secret_hash)
    caller = auth.verify(parts[1], row, parts[0])
    assert caller is not None and caller.scopes == {"read"}
    assert token.text not in auth.describe(caller)
    flipped = parts[1][:-1] + ("A" if parts[1][-1] != "A" else "B")
    assert auth.verify(flipped, row, parts[0]) is None
    assert auth.verify(parts[1], None, parts[0]) is None
    for header in (None, "", token.text, f"Basic {token.text}", f"Bearer {token.text}x",
                   "Bearer kst_zz_" + "a" * 43):
        assert auth.split(header) is None
    assert auth.parse_scopes("submit, read") == ("read", "submit")
    for bad in ("", "admin", "read,write", ","):
        with pytest.raises(ConfigError):
            auth.parse_scopes(bad)
    with pytest.raises(ConfigError):
        auth.check_name("a\x00")


def test_cursor_round_trip_and_garbage() -> None:
    import uuid

    when, eid = datetime(2026, 11, 30, 8, 0, 0, 123456, tzinfo=UTC), uuid.uuid4()
    assert decode_cursor(encode_cursor(when, str(eid))) == (when, eid)
    for bad in ("", "zzz", "!!", "A" * 300, encode_cursor(when, "x").replace("A", "B")):
        with pytest.raises(Refusal):
            decode_cursor(bad)


def test_json_bodies_parse_exactly() -> None:
    assert parse_json(b'{"n": 18446744073709551615}') == {"n": 18446744073709551615}
    for bad in (b'"\\ud800"', b"[" * 2000 + b"]" * 2000, b"[1e400]",
                b"[123456789012345678901234567890]", b"\xff", b"{"):
        with pytest.raises(Refusal) as err:
            parse_json(bad)
        assert err.value.status == 400


def test_openapi_documents_every_route_with_its_scope() -> None:
    doc = document(ENDPOINTS)
    for e in ENDPOINTS:
        op = doc["paths"][e.path][e.method.lower()]
        assert op["summary"] == e.summary
        assert ("security" in op) == (e.scope is not None)
    json.dumps(doc)

"""Webhook triggers: ``[hooks.NAME]`` tables of the TOML config and their signatures.

Each hook is ``POST /hooks/NAME``; its body becomes the one argument of its workflow, or,
for a Slack interactive Approve/Reject button, a signal. Signatures are checked exactly as
the senders compute them, over the raw body, with :func:`hmac.compare_digest`:

- ``github``: ``X-Hub-Signature-256: sha256=<hex HMAC-SHA256(secret, body)>``;
  ``X-GitHub-Delivery`` is the idempotency key (a redelivery returns the first execution).
  A ``ping`` (sent when the webhook is created) is answered and starts nothing; with
  ``events = [...]`` other ``X-GitHub-Event`` types are acknowledged and ignored. With
  ``argument = "envelope"`` the workflow gets ``{"event", "delivery", "payload"}`` instead
  of the bare body.
- ``slack``: ``X-Slack-Signature: v0=<hex HMAC-SHA256(secret, "v0:{ts}:{body}")>`` with
  ``X-Slack-Request-Timestamp`` = ts within five minutes of now; an identical request
  replayed inside the window maps to the same idempotency key, so it starts nothing new.
  An Events API ``event_callback`` is keyed by its ``event_id`` instead
  (:func:`slack_event_key`): Slack retries an event with a new timestamp, so a new
  signature, and the retry must find the first execution.
- ``hmac``: ``X-Signature-256: sha256=<hex HMAC-SHA256(secret, body)>``; the idempotency key
  is the signature, so an exact replay of a body returns the first execution (a sender puts
  an event id in the body to tell two equal events apart). An unsigned header could not be
  the key: a captured request replayed with a new one would start new work.

Before a hook's body is read, :func:`precheck` refuses what the headers alone show cannot
be signed right (no signature header or a malformed one, no delivery id, a Slack timestamp
outside the window): such a request costs the server no body. The body itself is read up to
the hook's ``max_body_bytes`` (default: ``--http-max-body-bytes``), the most an unsigned
sender can make the server hold, since a signature over the body can only be checked once
all of it is in.

The secret is read from the environment variable the hook names (``secret_env``), at start:
a hook whose secret is missing stops the server from starting rather than accepting unsigned
calls. No secret, signature or body is ever logged.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kestrel import codec
from kestrel.codec import QUEUE_NAME
from kestrel.errors import ConfigError, SerializationError

FORMATS = ("github", "slack", "hmac")
ARGUMENTS = ("body", "envelope")
KEYS = frozenset({"workflow", "format", "secret_env", "queue", "events", "argument",
                  "max_body_bytes", "approval_workflows", "approval_users",
                  "approval_channels"})
MAX_BODY_BYTES = 256 * 1024 * 1024
"""The most a hook's ``max_body_bytes`` may be (the same ceiling as http_max_body_bytes)."""
SIGNATURE_HEADERS = {"github": "X-Hub-Signature-256", "slack": "X-Slack-Signature",
                     "hmac": "X-Signature-256"}
_HEX_SHA256 = re.compile(r"[0-9a-fA-F]{64}")
HOOK_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
SLACK_WINDOW_S = 300.0
"""Slack's own advice: refuse a request whose timestamp is more than five minutes off."""


@dataclass(frozen=True, slots=True)
class Hook:
    """One configured webhook (its secret is held, never shown in repr)."""

    name: str
    workflow: str
    format: str
    secret: bytes = field(default=b"", repr=False)
    queue: str = "default"
    events: frozenset[str] | None = None
    """GitHub only: the X-GitHub-Event types that start the workflow (None: all)."""
    argument: str = "body"
    """GitHub only: ``body`` (the payload is the argument) or ``envelope`` (``{"event":
    X-GitHub-Event, "delivery": X-GitHub-Delivery, "payload": body}``)."""
    max_body_bytes: int | None = None
    """The largest body this hook reads (None: the server's http_max_body_bytes)."""
    approval_workflows: frozenset[str] | None = None
    """Slack only: the workflows whose executions a button press may approve (None: any)."""
    approval_users: frozenset[str] | None = None
    """Slack only: the user ids (``U…``) who may press Approve/Reject (None: anyone)."""
    approval_channels: frozenset[str] | None = None
    """Slack only: the channel ids (``C…``) a press may come from (None: any)."""

    @property
    def header(self) -> str:
        """The header its signature comes in."""
        return SIGNATURE_HEADERS[self.format]

    def accepts(self, event: str | None) -> bool:
        """Whether a GitHub delivery of *event* starts the workflow (never a ping)."""
        if event == "ping":
            return False
        return self.events is None or event in self.events

    def refuses(self, action: SlackAction, workflow: str) -> str | None:
        """Why this hook's allow-lists refuse *action* on an execution of *workflow*, in
        words for a 403 (None: allowed)."""
        if self.approval_users is not None and action.user_id not in self.approval_users:
            return "this Slack user may not approve or reject through this hook"
        if (self.approval_channels is not None
                and action.channel_id not in self.approval_channels):
            return "approvals from this Slack channel are not accepted by this hook"
        if self.approval_workflows is not None and workflow not in self.approval_workflows:
            return "this hook may not approve or reject executions of that workflow"
        return None


class SignatureError(Exception):
    """A request whose signature is missing, malformed, wrong or stale (401)."""


def load_hooks(path: str | None, environ: dict[str, str] | None = None) -> dict[str, Hook]:
    """Return the hooks of the TOML file *path* (``[hooks.NAME]``, at the top level or in a
    ``[kestrel]`` table); none without a file.

    Raises:
        ConfigError: a hook misses a key, names an unknown format, has a bad name or queue, or
            its ``secret_env`` is unset or empty.
    """
    if not path:
        return {}
    env = os.environ if environ is None else environ
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read hooks from config file {path}: {exc}") from None
    tables = data.get("hooks") or data.get("kestrel", {}).get("hooks") or {}
    if not isinstance(tables, dict):
        raise ConfigError(f"config file {path}: hooks must be tables, [hooks.NAME]")
    hooks = {}
    for name, spec in tables.items():
        hooks[name] = _hook(path, name, spec, env)
    return hooks


def _hook(path: str, name: str, spec: Any, env: Any) -> Hook:
    where = f"config file {path}: [hooks.{name}]"
    if not HOOK_NAME.fullmatch(name):
        raise ConfigError(f"{where}: a hook name is 1-64 of A-Z a-z 0-9 _ . -")
    if not isinstance(spec, dict):
        raise ConfigError(f"{where} must be a table")
    unknown = sorted(set(spec) - KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}")
    for key in ("workflow", "format", "secret_env"):
        if not isinstance(spec.get(key), str) or not spec[key]:
            raise ConfigError(f"{where}: {key} is required (a string)")
    if spec["format"] not in FORMATS:
        raise ConfigError(f"{where}: format must be one of {', '.join(FORMATS)}")
    queue = spec.get("queue", "default")
    if not isinstance(queue, str) or not QUEUE_NAME.fullmatch(queue):
        raise ConfigError(f"{where}: queue names are 1-128 of A-Z a-z 0-9 _ . : -")
    try:
        codec.check_text(spec["workflow"], what="its workflow name")
    except SerializationError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    events = spec.get("events")
    if events is not None and (spec["format"] != "github" or not isinstance(events, list)
                               or not all(isinstance(e, str) and e for e in events)):
        raise ConfigError(f"{where}: events is a list of GitHub event names (github only)")
    argument = spec.get("argument", "body")
    if argument not in ARGUMENTS or (argument != "body" and spec["format"] != "github"):
        raise ConfigError(f"{where}: argument is body or envelope (envelope: github only)")
    cap = spec.get("max_body_bytes")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int)
                            or not 1024 <= cap <= MAX_BODY_BYTES):
        raise ConfigError(f"{where}: max_body_bytes must be an integer, 1 KiB-256 MiB")
    lists = {}
    for key in ("approval_workflows", "approval_users", "approval_channels"):
        value = spec.get(key)
        if value is not None and (spec["format"] != "slack" or not isinstance(value, list)
                                  or not all(isinstance(v, str) and v for v in value)):
            raise ConfigError(f"{where}: {key} is a list of strings (slack only)")
        lists[key] = frozenset(value) if value is not None else None
    secret = env.get(spec["secret_env"], "")
    if not secret:
        raise ConfigError(f"{where}: the environment variable {spec['secret_env']} (its "
                          "secret_env) is unset or empty")
    return Hook(name=name, workflow=spec["workflow"], format=spec["format"],
                secret=secret.encode(), queue=queue,
                events=frozenset(events) if events is not None else None,
                argument=argument, max_body_bytes=cap, **lists)


def precheck(hook: Hook, headers: Any, *, now: float | None = None) -> None:
    """What :func:`verify` checks that needs no body: the signature header is there and of
    the sender's form (``sha256=`` or ``v0=`` and 64 hex digits), GitHub's delivery id is
    there, Slack's timestamp is inside the window.

    Raises:
        SignatureError: the reason (a request that no body could make valid).
    """
    name = hook.header
    given = headers.get(name.lower())
    prefix = "v0=" if hook.format == "slack" else "sha256="
    if not given:
        raise SignatureError(f"missing {name} header")
    if not (given.startswith(prefix) and _HEX_SHA256.fullmatch(given[len(prefix):])):
        raise SignatureError(f"{name} must be {prefix}<hex>")
    if hook.format == "github" and not headers.get("x-github-delivery"):
        raise SignatureError("missing X-GitHub-Delivery header")
    if hook.format == "slack":
        stamp = headers.get("x-slack-request-timestamp")
        if not stamp or not re.fullmatch(r"\d{1,12}", stamp):
            raise SignatureError("X-Slack-Request-Timestamp must be Unix seconds")
        if abs((time.time() if now is None else now) - int(stamp)) > SLACK_WINDOW_S:
            raise SignatureError("X-Slack-Request-Timestamp is more than 5 minutes from now "
                                 "(stale or replayed)")


def _hex_hmac(secret: bytes, message: bytes) -> str:
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def _same(expected: str, given: str) -> bool:
    return hmac.compare_digest(expected.encode(), given.encode("utf-8", "replace"))


def verify(hook: Hook, headers: Any, body: bytes, *, now: float | None = None) -> str:
    """Check the signature of a request to *hook*; return the idempotency key it carries.

    *headers* is a case-insensitive mapping; *now* the current Unix time (default: this
    machine's clock, the one Slack's window is defined against).

    Raises:
        SignatureError: the reason, in words that never include the secret or the body.
    """
    if hook.format == "github":
        signature = _check_prefixed(hook, headers.get("x-hub-signature-256"),
                                    "X-Hub-Signature-256", body)
        if not headers.get("x-github-delivery"):
            raise SignatureError("missing X-GitHub-Delivery header")
        # Keyed by what GitHub signed, the body, not by the delivery id beside it: a
        # captured delivery replayed under a new X-GitHub-Delivery (or X-GitHub-Event, which
        # the signature does not cover either) finds the first execution, where it started
        # new work (issue 41 row 6). GitHub's own redeliveries are the same bytes.
        return f"hook:{hook.name}:github:{signature}"
    if hook.format == "slack":
        return _verify_slack(hook, headers, body, time.time() if now is None else now)
    signature = _check_prefixed(hook, headers.get("x-signature-256"), "X-Signature-256", body)
    return f"hook:{hook.name}:sig:{signature}"


def _check_prefixed(hook: Hook, header: str | None, name: str, body: bytes) -> str:
    if not header:
        raise SignatureError(f"missing {name} header")
    if not header.startswith("sha256="):
        raise SignatureError(f"{name} must be sha256=<hex>")
    expected = "sha256=" + _hex_hmac(hook.secret, body)
    if not _same(expected, header):
        raise SignatureError(f"{name} does not match the body")
    return header[7:]


def _verify_slack(hook: Hook, headers: Any, body: bytes, now: float) -> str:
    signature = headers.get("x-slack-signature")
    stamp = headers.get("x-slack-request-timestamp")
    if not signature or not stamp:
        raise SignatureError("missing X-Slack-Signature or X-Slack-Request-Timestamp header")
    if not re.fullmatch(r"\d{1,12}", stamp):
        raise SignatureError("X-Slack-Request-Timestamp must be Unix seconds")
    if abs(now - int(stamp)) > SLACK_WINDOW_S:
        raise SignatureError("X-Slack-Request-Timestamp is more than 5 minutes from now "
                             "(stale or replayed)")
    if not signature.startswith("v0="):
        raise SignatureError("X-Slack-Signature must be v0=<hex>")
    expected = "v0=" + _hex_hmac(hook.secret, b"v0:" + stamp.encode() + b":" + body)
    if not _same(expected, signature):
        raise SignatureError("X-Slack-Signature does not match the body")
    # A replay inside the window is the same bytes, so the same signature: the same key.
    return f"hook:{hook.name}:slack:{hashlib.sha256(signature.encode()).hexdigest()}"


def slack_event_key(hook: Hook, payload: Any) -> str | None:
    """The idempotency key of a Slack Events API delivery: its ``event_id``, the same in
    every retry (``X-Slack-Retry-Num``), so a retry finds the first execution however its
    timestamp and signature changed. None when *payload* is not an ``event_callback``.

    Raises:
        ValueError: an ``event_callback`` without a usable ``event_id``.
    """
    if not isinstance(payload, dict) or payload.get("type") != "event_callback":
        return None
    event_id = payload.get("event_id")
    if not isinstance(event_id, str) or not event_id:
        raise ValueError("an event_callback must carry its event_id")
    return f"hook:{hook.name}:slack:event:{event_id}"


@dataclass(frozen=True, slots=True)
class SlackAction:
    """A Slack interactive Approve/Reject button press, as a signal to send."""

    execution_id: str
    approved: bool
    by: str
    key: str
    user_id: str = ""
    channel_id: str = ""


def slack_action(payload: Any) -> SlackAction | None:
    """Return the approval in a Slack interaction *payload* (the parsed JSON of the form
    field ``payload``), or None for any other interaction: a link button, another button, a
    modal submission or closing, a shortcut, a select menu. Slack expects each of those
    acknowledged with an empty 200 within three seconds; they start nothing here.

    An approval is a ``block_actions`` whose first action has ``action_id`` ``approve`` or
    ``reject`` and the execution id as its ``value``. The signal's idempotency key is the
    action's own ``action_ts`` with the button, so each press is delivered at most once
    however often Slack retries it.

    Raises:
        ValueError: an approve/reject press that is malformed (no value or action_ts).
    """
    if not isinstance(payload, dict) or payload.get("type") != "block_actions":
        return None
    actions = payload.get("actions")
    if not isinstance(actions, list) or not actions or not isinstance(actions[0], dict):
        return None
    action = actions[0]
    action_id, value = action.get("action_id"), action.get("value")
    if action_id not in ("approve", "reject"):
        return None
    if not isinstance(value, str):
        raise ValueError("actions[0].value must be the execution id")
    user = payload.get("user")
    by = user_id = ""
    if isinstance(user, dict):
        by = str(user.get("username") or user.get("name") or user.get("id") or "")
        user_id = str(user.get("id") or "")
    channel = payload.get("channel")
    channel_id = str(channel.get("id") or "") if isinstance(channel, dict) else ""
    stamp = action.get("action_ts")
    if not isinstance(stamp, str) or not stamp:
        raise ValueError("actions[0].action_ts is missing")
    key = f"slack:{action_id}:{value}:{stamp}"
    return SlackAction(execution_id=value, approved=action_id == "approve", by=by, key=key,
                       user_id=user_id, channel_id=channel_id)


def slack_reply(text: str) -> dict[str, str]:
    """A slash command's reply as the Slack message it must be: only its invoker sees it
    (``ephemeral``), and ``&``, ``<`` and ``>`` are escaped as Slack's mrkdwn requires."""
    escaped = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return {"response_type": "ephemeral", "text": escaped}

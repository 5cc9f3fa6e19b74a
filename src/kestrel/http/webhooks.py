"""The webhooks, ``POST /hooks/{name}``: a request signed as its hook's format says
(GitHub, Slack or a plain HMAC; :mod:`kestrel.http.hooks` checks the signature) submits the
hook's workflow with the body as its argument (or inside the GitHub envelope), or, from
Slack, answers a slash command, an Events API callback or an Approve/Reject press (an
``approval`` signal, sent as the API's :func:`~kestrel.http.api.send_signal` sends it).

A hook's statements run on a pool of their own (the route's ``pool="hooks"``), so a burst
of deliveries cannot take the API's and the web UI's connections. Answers are the API's JSON
(:func:`~kestrel.http.api.ok`), refusals the API's one-line JSON errors.
"""

from __future__ import annotations

import json
import logging
import uuid
from urllib.parse import parse_qsl

import psycopg
from starlette.requests import Request
from starlette.responses import Response

from kestrel import codec, statements
from kestrel._client_common import count_submitted
from kestrel.http.api import ok, send_signal
from kestrel.http.hooks import (
    Hook,
    SignatureError,
    slack_action,
    slack_event_key,
    slack_reply,
)
from kestrel.http.hooks import precheck as precheck_signature
from kestrel.http.hooks import verify as verify_signature
from kestrel.http.refusals import Refusal
from kestrel.http.requests import parse_json, read_capped, trace_context

log = logging.getLogger("kestrel.http")


async def hook(request: Request) -> Response:
    """A configured webhook: verify its signature, then submit its workflow with the body
    as the one argument, or turn a Slack Approve/Reject press into an ``approval`` signal.

    A JSON body goes to the database as the very bytes the sender signed, and PostgreSQL
    parses it under the rules of ``submit`` (the SQL door's, the same at every door): exact,
    nothing written when a rule is broken, and a 25 MB GitHub delivery costs the server a
    copy or two of its bytes, never a Python object tree.
    """
    state = request.app.state
    name = request.path_params["name"]
    spec: Hook | None = state.hooks.get(name)
    if spec is None:
        raise Refusal(404, f"unknown hook {codec.printable(name, 80)!r}")
    challenge = {"WWW-Authenticate": f'HMAC-SHA256 realm="hook", header="{spec.header}"'}
    try:
        # What can be checked before the body is, so a request that cannot be signed
        # right costs no read (a stale Slack timestamp, a missing or malformed header).
        precheck_signature(spec, request.headers)
    except SignatureError as exc:
        raise Refusal(401, str(exc), challenge) from None
    # Every hook body held in this process, signed or not yet known, counts against one
    # budget until its request is answered: unsigned senders once grew the server by 578 MiB.
    async with state.hook_budget.holding():
        return await _verified(request, spec, challenge)


async def _verified(request: Request, spec: Hook, challenge: dict[str, str]) -> Response:
    """The rest of :func:`hook`: read the body within the budget, verify, submit or
    signal."""
    state = request.app.state
    cap = spec.max_body_bytes or state.cfg.http_max_body_bytes
    body = await read_capped(request, cap, state.hook_budget)
    if body is None:
        raise Refusal(413, f"request body over hook {spec.name}'s cap of {cap} bytes")
    try:
        key = verify_signature(spec, request.headers, body)
    except SignatureError as exc:
        raise Refusal(401, str(exc), challenge) from None
    codec.check_text(key, what="idempotency key (the delivery id)")
    if spec.format == "slack":
        return await _slack_hook(request, spec, key, body)
    event = request.headers.get("x-github-event")
    if spec.format == "github":  # not in the key, but in the envelope: the same rules
        codec.check_text(request.headers.get("x-github-delivery"),
                         what="X-GitHub-Delivery header")
    if spec.format == "github" and not spec.accepts(event):
        return ok({"ignored": codec.printable(event or "", 100)})
    if _is_form(request):
        form = _form(body)
        if spec.format == "github" and "payload" in form:
            body = form["payload"].encode()
        else:
            body = codec.encode(form, what="form body").encode()
    envelope = None
    if spec.format == "github" and spec.argument == "envelope":
        envelope = json.dumps({
            "event": codec.check_text(event or "", what="X-GitHub-Event header"),
            "delivery": request.headers.get("x-github-delivery", "")})
    eid = await _hook_submit(request, spec, key, body, envelope)
    return ok({"id": str(eid), "workflow": spec.workflow})


async def _slack_hook(request: Request, spec: Hook, key: str, body: bytes) -> Response:
    """Slack: slash commands, interactions (Approve/Reject and the rest) and the Events API,
    each answered the way Slack expects within its three seconds."""
    if _is_form(request):
        form = _form(body)
        if form.get("ssl_check") == "1":
            return Response(b"", 200)  # Slack checking the certificate: nothing to start
        if "payload" in form:
            return await _slack_interaction(request, spec, form["payload"])
        eid = await _hook_submit(request, spec, key,
                                 codec.encode(form, what="form body").encode())
        reply = slack_reply(f"Started {spec.workflow} ({eid}).")
        return ok({**reply, "id": str(eid), "workflow": spec.workflow})
    payload = parse_json(body)
    if isinstance(payload, dict) and payload.get("type") == "url_verification":
        return ok({"challenge": payload.get("challenge")})
    if isinstance(payload, dict) and payload.get("type") == "app_rate_limited":
        return Response(b"", 200)
    try:
        event_key = slack_event_key(spec, payload)
    except ValueError as exc:
        raise Refusal(400, str(exc)) from None
    if event_key is not None:
        key = codec.check_text(event_key, what="idempotency key (the event_id)")
    eid = await _hook_submit(request, spec, key, body)
    return ok({"id": str(eid), "workflow": spec.workflow})


async def _slack_interaction(request: Request, spec: Hook, raw: str) -> Response:
    """An interaction: an Approve/Reject press becomes the ``approval`` signal (if the
    hook's allow-lists let it); any other one is acknowledged with an empty 200."""
    try:
        action = slack_action(parse_json(raw.encode()))
    except ValueError as exc:
        raise Refusal(400, str(exc)) from None
    if action is None:
        return Response(b"", 200)
    app = request.app
    if (spec.approval_workflows is not None or spec.approval_users is not None
            or spec.approval_channels is not None):
        workflow = (await app.state.client.get(action.execution_id)).workflow
        reason = spec.refuses(action, workflow)
        if reason is not None:
            log.info("a Slack press refused by the allow-lists of hook %s", spec.name)
            raise Refusal(403, reason)
    delivered = await send_signal(app, action.execution_id, "approval",
                                  {"approved": action.approved, "by": action.by}, action.key)
    return ok({"id": action.execution_id, "signal": "approval",
               "approved": action.approved, "delivered": delivered})


async def _hook_submit(request: Request, spec: Hook, key: str, body: bytes,
                       envelope: str | None = None) -> uuid.UUID:
    """Submit *spec*'s workflow with *body* (JSON text) as its argument, or inside
    *envelope*, under this server's ``max_payload_bytes`` (413 over it, 400 for a body that
    is not one storable JSON value; nothing written either way)."""
    state = request.app.state
    cap: int = state.cfg.max_payload_bytes
    if len(body) > cap:
        raise Refusal(413, f"the hook's argument is {len(body)} bytes, over the cap of "
                       f"{cap} bytes (--max-payload-bytes)")
    if not body.strip():
        raise Refusal(400, "malformed JSON body: it is empty")
    try:
        eid: uuid.UUID = await state.client.read(statements.http.hook_submit(
            state.q, workflow=spec.workflow, body=body, envelope=envelope,
            queue=spec.queue, key=key, max_bytes=cap, trace=trace_context(request)))
    except psycopg.errors.CharacterNotInRepertoire:
        raise Refusal(400, "request body is not UTF-8") from None
    except (psycopg.errors.InvalidTextRepresentation, psycopg.errors.UntranslatableCharacter,
            psycopg.errors.StatementTooComplex) as exc:
        # The primary message only: PostgreSQL's detail and context quote the body.
        raise Refusal(400, f"malformed JSON body: {exc.diag.message_primary}") from None
    count_submitted(spec.workflow)
    return eid


def _is_form(request: Request) -> bool:
    ctype = request.headers.get("content-type", "")
    return ctype.split(";")[0].strip().lower() == "application/x-www-form-urlencoded"


def _form(body: bytes) -> dict[str, str]:
    try:
        # errors="strict": a percent-escape that is not UTF-8 is refused, never replaced.
        pairs = parse_qsl(body.decode("utf-8"), keep_blank_values=True, strict_parsing=False,
                          max_num_fields=1000, errors="strict")
    except (UnicodeDecodeError, ValueError):
        raise Refusal(400, "malformed form body") from None
    return dict(pairs)


__all__ = ["hook"]

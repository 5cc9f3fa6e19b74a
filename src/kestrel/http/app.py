"""The ASGI application of the HTTP door: :func:`create_app`.

Routes are declared once in :data:`ENDPOINTS` (method, path, scope, handler, what it does),
which builds both the Starlette routes and the OpenAPI document, so the two cannot drift.
Every change goes through the kestrel :class:`~kestrel.client.Client` and so through the
same SQL functions as Python, SQL and the CLI: one set of rules at every door.

What the web UI (mounted under ``/ui`` by :func:`create_app`'s caller) finds on
``app.state``: ``client`` (a :class:`kestrel.client.Client`, opened at start-up in the
serving process, after any fork), ``q`` (the statements, for :mod:`kestrel.http.store`
reads run with ``client.read``), ``workflows``, ``hooks`` and ``cfg``. What both doors share
is in modules of its own, which the UI imports instead of this one: tokens
(:func:`kestrel.http.auth.check_token`), refusals (:mod:`kestrel.http.refusals`) and request
parts (:mod:`kestrel.http.requests`).

Errors are one line of JSON, ``{"error": "..."}``, with a 4xx status and nothing written;
no request body, token or secret is ever logged (a route's template, never its path, is
what a log line names).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from urllib.parse import parse_qsl

import orjson
import psycopg
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Match, Mount, Route

from kestrel import codec, db, tracing
from kestrel._client_common import count_submitted
from kestrel.client_async import Client
from kestrel.codec import QUEUE_NAME
from kestrel.config import Config
from kestrel.errors import (
    IdempotencyConflict,
    InvalidState,
)
from kestrel.http import auth, store
from kestrel.http.hooks import (
    Hook,
    SignatureError,
    slack_action,
    slack_event_key,
    slack_reply,
)
from kestrel.http.hooks import precheck as precheck_signature
from kestrel.http.hooks import verify as verify_signature
from kestrel.http.observe import RequestMetrics, route_templates
from kestrel.http.refusals import Refusal, classify, template
from kestrel.http.requests import (
    DIGITS,
    decode_cursor,
    encode_cursor,
    parse_json,
    parse_time,
    read_capped,
    read_json,
)
from kestrel.sql import queries
from kestrel.types import Status

log = logging.getLogger("kestrel.http")

API = "/api/v1"
MAX_PAGE = 500


BEARER_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="kestrel"'}
"""What a 401 of the API says it wants (RFC 9110 §11.6.1: every 401 names a challenge)."""


def error_response(status: int, reason: str,
                   headers: Mapping[str, str] | None = None) -> Response:
    """``{"error": reason}`` as one line of ASCII JSON (hostile text escaped, never raw);
    a 401 without *headers* carries the API's bearer challenge."""
    text = codec.printable(" ".join(str(reason).split()), 500)
    body = json.dumps({"error": text}, ensure_ascii=True)
    if headers is None and status == 401:
        headers = BEARER_CHALLENGE
    return Response(body + "\n", status_code=status, media_type="application/json",
                    headers=dict(headers) if headers else None)


def ok(data: Any, status: int = 200) -> Response:
    """*data* as JSON (the values come from the database or were checked on the way in)."""
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


def _object(value: Any, allowed: Iterable[str]) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise Refusal(400, "the body must be a JSON object")
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise Refusal(400, f"unknown field(s): {', '.join(map(ascii, unknown))}")
    return value


def execution_id(request: Request) -> uuid.UUID:
    """The ``{id}`` path parameter as a UUID (400 otherwise)."""
    raw = request.path_params["id"]
    try:
        return uuid.UUID(raw)
    except ValueError:
        raise Refusal(400, f"{codec.printable(raw, 80)!r} is not an execution id (a UUID)"
                       ) from None


def _header_key(request: Request) -> str | None:
    key = request.headers.get("idempotency-key")
    if key is not None:
        codec.check_text(key, what="Idempotency-Key header")
    return key


def _number(body: dict[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise Refusal(400, f"{name} must be a number of seconds")
    return float(value)


def _text(body: dict[str, Any], name: str, default: str | None = None) -> str | None:
    value = body.get(name, default)
    if value is not None and not isinstance(value, str):
        raise Refusal(400, f"{name} must be a string")
    return value


# -- auth ------------------------------------------------------------------------------------


async def require(request: Request, scope: str) -> auth.Caller:
    """The caller of *request* if its bearer token is live and has *scope*.

    Raises:
        Refusal: 401 without a valid token, 403 with one that lacks *scope*.
    """
    header = request.headers.get("authorization")
    if auth.split(header) is None:
        raise Refusal(401, "missing or malformed bearer token (Authorization: Bearer kst_…)")
    return await auth.check_token(request.app.state,
                                  header.partition(" ")[2] if header else "", scope)


# -- the JSON API ----------------------------------------------------------------------------


async def submit(request: Request) -> Response:
    """Start an execution of ``{workflow}``: 201 with its id. An ``Idempotency-Key`` header
    makes it idempotent: the same key and the same body answer 200 with the execution the
    first request started (also when a ``dedup_key`` returned a live one), the same key with
    another body 409. The key covers every field (args, queue, priority, timeout, delay,
    dedup_key) and the workflow. A well-formed W3C ``traceparent`` header (and
    ``tracestate``) is the execution's trace context; a malformed one is ignored."""
    await require(request, "submit")
    state = request.app.state
    name = request.path_params["workflow"]
    if state.workflows is not None and name not in state.workflows:
        raise Refusal(404, f"unknown workflow {codec.printable(name, 200)!r}")
    body = _object(await read_json(request), ("args", "queue", "priority", "timeout", "delay",
                                              "dedup_key"))
    args = body.get("args", [])
    if not isinstance(args, list):
        raise Refusal(400, "args must be a JSON array")
    priority = body.get("priority", 0)
    eid, created = await state.client.submit_created(
        name, *args, queue=_text(body, "queue", "default"), priority=priority,
        idempotency_key=_header_key(request), timeout=_number(body, "timeout"),
        delay=_number(body, "delay"), dedup_key=_text(body, "dedup_key"),
        trace=_trace_context(request))
    return ok({"id": str(eid), "workflow": name}, 201 if created else 200)


def _trace_context(request: Request) -> tracing.TraceContext | None:
    """The request's W3C trace context (exactly one well-formed traceparent header, and
    the tracestate if well formed), or None."""
    return tracing.from_headers(request.headers.getlist("traceparent"),
                                request.headers.getlist("tracestate"))


async def signal(request: Request) -> Response:
    """Send a signal (``name``, ``payload``) to an execution, at most once per
    ``Idempotency-Key``: sent again, ``delivered`` is false (the first signal sent under a
    key is the one delivered)."""
    await require(request, "operate")
    eid = execution_id(request)
    body = _object(await read_json(request), ("name", "payload"))
    name = body.get("name")
    if not isinstance(name, str):
        raise Refusal(400, "name (the signal's name, a string) is required")
    delivered = await send_signal(request.app, eid, name, body.get("payload"),
                                  _header_key(request))
    return ok({"id": str(eid), "signal": name, "delivered": delivered})


async def send_signal(app: Starlette, eid: uuid.UUID | str, name: str, payload: Any,
                      key: str | None) -> bool:
    """Signal *eid*; False when a signal with *key* was delivered before.

    A replay whose first delivery finished the execution is still answered False, not
    refused: the SQL function sees a finished execution before it sees the key.

    Raises:
        InvalidState: it has finished and never got a signal with *key*.
    """
    try:
        return bool(await app.state.client.signal(eid, name, payload, idempotency_key=key))
    except InvalidState:
        if key is not None and await app.state.client.read(
                store.signal_sent(app.state.q, id=uuid.UUID(str(eid)), key=key)):
            return False
        raise


async def cancel(request: Request) -> Response:
    """Cancel an execution and its live children."""
    await require(request, "operate")
    eid = execution_id(request)
    return ok({"id": str(eid), "status": await request.app.state.client.cancel(eid)})


async def retry(request: Request) -> Response:
    """Re-run a failed, cancelled or quarantined execution from its last checkpoint."""
    await require(request, "operate")
    eid = execution_id(request)
    await request.app.state.client.retry(eid, idempotency_key=_header_key(request))
    return ok({"id": str(eid), "status": "queued"})


async def fork(request: Request) -> Response:
    """Start a new execution that reuses the first ``from_step`` checkpoints: 201 with its
    id. With an ``Idempotency-Key`` the same key and body answer 200 with the fork the first
    request made; the same key for another execution or step, 409."""
    await require(request, "operate")
    eid = execution_id(request)
    body = _object(await read_json(request), ("from_step",))
    step = body.get("from_step")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 2**31:
        raise Refusal(400, "from_step must be an integer in [0, 2^31)")
    key = _header_key(request)
    if key is None:
        handle = await request.app.state.client.fork(eid, step)
        return ok({"id": str(handle.id), "forked_from": str(eid), "from_step": step}, 201)
    new, created = await keyed_fork(request.app, eid, step, key)
    return ok({"id": str(new), "forked_from": str(eid), "from_step": step},
              201 if created else 200)


FORK_KEYS = uuid.UUID("5b0e3f4c-1d0a-4c57-9a53-2f1e8d1c6a26")
"""The namespace of the fork ids made from Idempotency-Keys (uuid5)."""


async def keyed_fork(app: Starlette, eid: uuid.UUID, step: int,
                     key: str) -> tuple[uuid.UUID, bool]:
    """Fork *eid* from *step* under Idempotency-Key *key*: the fork's id is made from the
    key, so the SQL function fork() returns the same fork when the request is sent again.
    Returns its id and whether this request made it.

    Raises:
        Refusal: 409 when the key was used for a fork of another execution or step.
    """
    new = uuid.uuid5(FORK_KEYS, key)

    async def made_before() -> bool:
        source = await app.state.client.read(store.fork_source(app.state.q, id=new))
        if source is None:
            return False
        if source != (eid, step):
            raise Refusal(409, f"Idempotency-Key {codec.printable(key, 80)!r} was used for "
                                f"the fork of {source[0]} from step {source[1]}")
        return True

    if await made_before():
        return new, False
    try:
        # fork() with a caller-chosen id (the statement the client's fork() runs).
        await app.state.client.read(db.value(app.state.q.fork, {
            "id": eid, "from_step": step, "new_id": new, "idempotency_key": None}))
    except (IdempotencyConflict, psycopg.errors.UniqueViolation):
        # The same key sent twice at once: the other request made the fork first.
        if await made_before():
            return new, False
        raise
    return new, True


def _time(params: Mapping[str, str], name: str) -> datetime | None:
    text = params.get(name)
    if text is None:
        return None
    try:
        return parse_time(text)
    except ValueError:
        raise Refusal(400, f"{name} must be an ISO 8601 time") from None


LIST_PARAMS = ("status", "workflow", "queue", "since", "until", "limit", "cursor")


async def list_executions(request: Request) -> Response:
    """Executions newest first, live and finished, filtered, one keyset page at a time."""
    await require(request, "read")
    params = request.query_params
    unknown = sorted(set(params) - set(LIST_PARAMS))
    if unknown:
        raise Refusal(400, f"unknown query parameter(s): {', '.join(map(ascii, unknown))}")
    status = params.get("status")
    if status is not None and status not in {s.value for s in Status}:
        raise Refusal(400, f"status must be one of {', '.join(s.value for s in Status)}")
    workflow = params.get("workflow")
    if workflow is not None:
        codec.check_text(workflow, what="workflow")
    queue = params.get("queue")
    if queue is not None and not QUEUE_NAME.fullmatch(queue):
        raise Refusal(400, "queue names are 1-128 of A-Z a-z 0-9 _ . : -")
    limit_text = params.get("limit", "50")
    if not DIGITS.fullmatch(limit_text) or not 1 <= int(limit_text) <= MAX_PAGE:
        raise Refusal(400, f"limit must be an integer in [1, {MAX_PAGE}]")
    limit = int(limit_text)
    cursor = params.get("cursor")
    after = decode_cursor(cursor) if cursor else None
    state = request.app.state
    rows = await state.client.read(store.page_executions(
        state.q, status=status, workflow=workflow, queue=queue, since=_time(params, "since"),
        until=_time(params, "until"), after=after, limit=limit + 1))
    page = rows[:limit]
    more = len(rows) > limit
    next_cursor = encode_cursor(page[-1][1], page[-1][0]["id"]) if more and page else None
    return ok({"executions": [r for r, _ in page], "next_cursor": next_cursor})


def _step(s: Any, created: datetime) -> dict[str, Any]:
    return {"step_id": s.step_id, "name": s.name, "attempt": s.attempt,
            "started_at": s.started_at.isoformat(), "finished_at": s.finished_at.isoformat(),
            "offset_ms": round((s.started_at - created).total_seconds() * 1000, 1),
            "duration_ms": round((s.finished_at - s.started_at).total_seconds() * 1000, 1),
            "output": s.output, "error": s.error}


async def get_execution(request: Request) -> Response:
    """One execution with its step timeline, events, pending signals, children, what it
    waits for and its deadline."""
    await require(request, "read")
    eid = execution_id(request)
    state = request.app.state
    ex = await state.client.get(eid)
    steps = await state.client.steps(eid)
    wait = await state.client.read(store.get_wait(state.q, id=eid)) or {}
    return ok({
        "id": str(ex.id), "workflow": ex.workflow, "queue": ex.queue, "priority": ex.priority,
        "status": ex.status.value, "claims": ex.attempts, "args": ex.args,
        "result": ex.result, "error": ex.error,
        "created_at": ex.created_at.isoformat(),
        "started_at": ex.started_at.isoformat() if ex.started_at else None,
        "finished_at": ex.finished_at.isoformat() if ex.finished_at else None,
        **wait,
        "steps": [_step(s, ex.created_at) for s in steps],
        "events": await state.client.read(store.list_events(state.q, id=eid)),
        "pending_signals": await state.client.read(store.pending_signals(state.q, id=eid)),
        "children": await state.client.read(store.list_children(state.q, id=eid)),
    })


async def list_queues(request: Request) -> Response:
    """Each queue with live depth by status, its oldest queued age and its limits."""
    await require(request, "read")
    state = request.app.state
    stats = await state.client.stats()
    limits = await state.client.read(store.list_queue_limits(state.q))
    found: dict[str, dict[str, Any]] = {}
    for name in sorted({*(s.queue for s in stats.queues), *limits}):
        found[name] = {"queue": name, "depth": {}, "oldest_queued_age_s": None,
                       "limits": limits.get(name)}
    for s in stats.queues:
        found[s.queue]["depth"][s.status] = s.count
        if s.status == "queued":
            found[s.queue]["oldest_queued_age_s"] = s.oldest_age_s
    return ok({"queues": list(found.values())})


async def list_schedules(request: Request) -> Response:
    """Every cron schedule with its last tick."""
    await require(request, "read")
    state = request.app.state
    return ok({"schedules": await state.client.read(store.list_schedules(state.q))})


async def list_workflows(request: Request) -> Response:
    """The workflows this server accepts (those its ``--app`` registers)."""
    await require(request, "read")
    names = request.app.state.workflows
    return ok({"workflows": sorted(names) if names is not None else None})


async def openapi(request: Request) -> Response:
    """The OpenAPI 3.1 document of this API."""
    from kestrel.http.openapi import document

    return ok(document(ENDPOINTS))


async def healthz(request: Request) -> Response:
    """The server is up (no database round trip, no token)."""
    return ok({"ok": True})


# -- webhooks --------------------------------------------------------------------------------


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
    cap = spec.max_body_bytes or state.cfg.http_max_body_bytes
    body = await read_capped(request, cap)
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
        eid: uuid.UUID = await state.client.read(store.hook_submit(
            state.q, workflow=spec.workflow, body=body, envelope=envelope,
            queue=spec.queue, key=key, max_bytes=cap, trace=_trace_context(request)))
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


# -- the route table -------------------------------------------------------------------------


Handler = Callable[[Request], Awaitable[Response]]


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One route: what the OpenAPI document says of it, and its handler."""

    method: str
    path: str
    handler: Handler
    scope: str | None
    summary: str
    body: dict[str, Any] | None = None
    query: tuple[str, ...] = ()
    headers: tuple[str, ...] = ()
    tags: tuple[str, ...] = field(default=("executions",))
    pool: str = "api"
    """Whose database connections it uses: ``api`` (shared with the web UI) or ``hooks``
    (``--http-hook-pool-size`` of its own, so neither kind of traffic starves the other)."""
    answers: tuple[tuple[str, str], ...] = (("200", "OK"),)
    """Its success statuses and what each means (the OpenAPI document's responses)."""


_CREATED = (("201", "Created: this request started it."),
            ("200", "An idempotent replay: a request with the same Idempotency-Key and body "
                    "started it before; nothing new was started."))


_ARGS_BODY = {"type": "object", "additionalProperties": False, "properties": {
    "args": {"type": "array"}, "queue": {"type": "string"},
    "priority": {"type": "integer"}, "timeout": {"type": "number"},
    "delay": {"type": "number"}, "dedup_key": {"type": "string"}}}

ENDPOINTS: tuple[Endpoint, ...] = (
    Endpoint("GET", "/healthz", healthz, None, "Liveness.", tags=("meta",)),
    Endpoint("GET", f"{API}/openapi.json", openapi, None, "This document.", tags=("meta",)),
    Endpoint("GET", f"{API}/workflows", list_workflows, "read", "Registered workflows.",
             tags=("workflows",)),
    Endpoint("POST", f"{API}/workflows/{{workflow}}/submit", submit, "submit",
             "Submit an execution.", body=_ARGS_BODY, headers=("Idempotency-Key",),
             tags=("workflows",), answers=_CREATED),
    Endpoint("GET", f"{API}/executions", list_executions, "read",
             "List executions, newest first (keyset pages).", query=LIST_PARAMS),
    Endpoint("GET", f"{API}/executions/{{id}}", get_execution, "read",
             "One execution: steps, events, pending signals, children, wait, deadline."),
    Endpoint("POST", f"{API}/executions/{{id}}/signal", signal, "operate",
             "Send a signal.", body={"type": "object", "required": ["name"],
                                     "additionalProperties": False,
                                     "properties": {"name": {"type": "string"},
                                                    "payload": {}}},
             headers=("Idempotency-Key",),
             answers=(("200", "Sent (delivered: true), or already sent under the same "
                              "Idempotency-Key (delivered: false)."),)),
    Endpoint("POST", f"{API}/executions/{{id}}/cancel", cancel, "operate",
             "Cancel it and its live children."),
    Endpoint("POST", f"{API}/executions/{{id}}/retry", retry, "operate",
             "Re-run a failed, cancelled or quarantined execution.",
             headers=("Idempotency-Key",)),
    Endpoint("POST", f"{API}/executions/{{id}}/fork", fork, "operate",
             "Start a new execution from its first from_step checkpoints.",
             body={"type": "object", "required": ["from_step"], "additionalProperties": False,
                   "properties": {"from_step": {"type": "integer", "minimum": 0}}},
             headers=("Idempotency-Key",), answers=_CREATED),
    Endpoint("GET", f"{API}/queues", list_queues, "read", "Queues: depth and limits.",
             tags=("queues",)),
    Endpoint("GET", f"{API}/schedules", list_schedules, "read", "Cron schedules.",
             tags=("schedules",)),
    Endpoint("POST", "/hooks/{name}", hook, None,
             "A configured webhook (GitHub, Slack or HMAC signature instead of a token).",
             body={}, tags=("hooks",), pool="hooks"),
)


def _guarded(handler: Handler, pool: str = "api") -> Handler:
    async def endpoint(request: Request) -> Response:
        # Each request runs in a task of its own: the pool choice ends with it.
        POOL.set(pool)
        response = await _answer(request)
        # The route's template, never its path or query: those hold values callers chose.
        log.debug("%s %s %d", request.method, template(request), response.status_code)
        return response

    async def _answer(request: Request) -> Response:
        try:
            return await handler(request)
        except Exception as exc:  # each request fails alone; the server keeps serving
            refusal = classify(exc, request)
            return error_response(refusal.status, refusal.reason, refusal.headers)

    endpoint.__doc__ = handler.__doc__
    return endpoint


@asynccontextmanager
async def _lifespan(app: Starlette) -> AsyncIterator[None]:
    state = app.state
    state.client = HttpClient(state.dsn, schema=state.cfg.schema,
                              max_payload_bytes=state.cfg.max_payload_bytes,
                              pool_size=max(2, state.cfg.pool_size),
                              connection_mode=state.cfg.connection_mode,
                              listen_dsn=state.cfg.listen_dsn or None,
                              hook_pool_size=state.cfg.http_hook_pool_size)
    try:
        yield
    finally:
        await state.client.close()


POOL: ContextVar[str] = ContextVar("kestrel_http_pool", default="api")
"""The pool a request's statements borrow from, set by its route (:attr:`Endpoint.pool`)."""


class HttpClient(Client):
    """The kestrel client with two more calls, :meth:`read` (the door's own reads) and
    :meth:`submit_created` (which tells a new execution from an idempotent replay), and a
    second pool of ``hook_pool_size`` connections for the webhooks' statements (those run
    while :data:`POOL` is ``hooks``): a burst of deliveries cannot take the API's and the
    web UI's connections, nor they the hooks'."""

    def __init__(self, *args: Any, hook_pool_size: int = 2, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._hooks = Client(*args, **{**kwargs, "pool_size": hook_pool_size})

    async def read(self, stmt: db.Stmt[Any]) -> Any:
        """Run one read statement of :mod:`kestrel.http.store` on a pooled connection."""
        return await self._run(stmt)

    @asynccontextmanager
    async def _borrow(self, timeout: float | None = None,
                      ) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        if POOL.get() == "hooks":
            async with self._hooks._borrow(timeout) as conn:
                yield conn
            return
        async with super()._borrow(timeout) as conn:
            yield conn

    async def close(self) -> None:
        """Close both pools."""
        try:
            await self._hooks.close()
        finally:
            await super().close()

    async def submit_created(self, wf: str, *args: Any, queue: str = "default",
                             priority: int = 0, idempotency_key: str | None = None,
                             timeout: float | None = None, delay: float | None = None,
                             dedup_key: str | None = None,
                             trace: tracing.TraceContext | None = None,
                             ) -> tuple[uuid.UUID, bool]:
        """:meth:`submit`, returning the execution's id and whether this call started it:
        the id is chosen here, so any other id returned is an execution started before
        (the same idempotency key, or a live one holding the dedup key). *trace* (the
        request's trace context) replaces the current span's."""
        params = self._submit_params(wf, args, queue, priority, idempotency_key, timeout,
                                     delay, None, dedup_key, "return")
        if trace is not None:
            params["traceparent"], params["tracestate"] = trace
        params["id"] = chosen = uuid.uuid4()
        eid = await self._run(db.value(self._q.submit, params, key=idempotency_key))
        if eid == chosen:
            count_submitted(params["workflow"])
        return eid, eid == chosen


def create_app(cfg: Config, *, dsn: str, workflows: Iterable[str] | None,
               hooks: Mapping[str, Hook] | None = None,
               routes: Sequence[BaseRoute] = ()) -> Starlette:
    """Return the ASGI app of the HTTP door.

    *workflows*: the names a submit may start (404 for others); None accepts any name.
    *hooks*: the configured webhooks by name. *routes*: more routes (the web UI's, under
    ``/ui``), served next to the API's. The database client is created at start-up (the
    lifespan), in the process that serves, so the app can be built before a fork.
    """
    routes = [*routes, *(Route(e.path, _guarded(e.handler, e.pool), methods=[e.method])
                         for e in ENDPOINTS)]
    app = Starlette(routes=routes, lifespan=_lifespan,
                    middleware=[Middleware(RequestMetrics, templates=route_templates(routes))],
                    exception_handlers={404: _not_found, 405: _not_allowed,
                                        Exception: _internal_error})
    app.state.cfg = cfg
    app.state.dsn = dsn
    app.state.q = queries(cfg.schema)
    app.state.workflows = frozenset(workflows) if workflows is not None else None
    app.state.hooks = dict(hooks or {})
    return app


async def _not_found(request: Request, exc: Exception) -> Response:
    return error_response(404, "no such route")


async def _not_allowed(request: Request, exc: Exception) -> Response:
    # Every method some route serves at this path: Starlette's own Allow names only those
    # of the first route that matched it (the UI has GET and POST /ui/login apart).
    scope = {k: v for k, v in request.scope.items() if k not in ("root_path", "route")}
    allowed = _methods(request.app.routes, {**scope, "method": "\0"})
    return error_response(405, f"method {request.method} not allowed here",
                          {"Allow": ", ".join(sorted(allowed))})


def _methods(routes: Iterable[BaseRoute], scope: dict[str, Any]) -> set[str]:
    found: set[str] = set()
    for route in routes:
        match, child = route.matches(scope)
        if match is Match.NONE:
            continue
        if isinstance(route, Mount):
            found |= _methods(route.routes, {**scope, **child})
        else:
            found |= set(getattr(route, "methods", None) or ())
    return found


async def _internal_error(request: Request, exc: Exception) -> Response:
    # The type only (FAULTS S5); Starlette re-raises it to uvicorn, which logs it.
    return error_response(500, "internal error")


__all__ = [
    "ENDPOINTS",
    "Endpoint",
    "Refusal",
    "create_app",
    "error_response",
    "ok",
    "read_json",
    "require",
]

"""The JSON API's handlers under ``/api/v1``: submit, the execution's calls (get, signal,
cancel, retry, fork), the lists (executions, queues, schedules, workflows), each behind
:func:`require` (a bearer token with the route's scope).

Every change goes through the kestrel :class:`~kestrel.client.Client` (``app.state.client``)
and so through the same SQL functions as Python, SQL and the CLI: one set of rules at every
door. A handler answers with :func:`ok` or raises; the route table
(:data:`kestrel.http.app.ENDPOINTS`) turns what it raised into the one-line JSON refusal.
The webhooks (:mod:`kestrel.http.webhooks`) signal as :func:`send_signal` does.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from datetime import datetime
from typing import Any

import orjson
import psycopg
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response

from kestrel import buckets, codec, statements
from kestrel._client_common import Debounce, tag_filter
from kestrel.codec import QUEUE_NAME
from kestrel.errors import (
    IdempotencyConflict,
    InvalidState,
)
from kestrel.http import auth
from kestrel.http.refusals import Refusal
from kestrel.http.requests import (
    DIGITS,
    check_query_text,
    decode_cursor,
    encode_cursor,
    read_json,
    tag_params,
    time_param,
    trace_context,
)
from kestrel.types import Status

API = "/api/v1"
MAX_PAGE = 500


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


def _header_key(request: Request, caller: auth.Caller) -> str | None:
    """The request's ``Idempotency-Key``, scoped to the caller's token: two callers using
    the same key get an execution each, and neither ever sees the other's (issue 41 row 8:
    a submit-only token learned another caller's execution from a 409, got it back as its
    own, and could squat keys others would use)."""
    key = request.headers.get("idempotency-key")
    if key is None:
        return None
    codec.check_text(key, what="Idempotency-Key header")
    return f"http:{caller.token_id}:{key}"


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


def _tags(body: dict[str, Any]) -> dict[str, str] | None:
    value = body.get("tags")
    if value is not None and not isinstance(value, dict):
        raise Refusal(400, "tags must be a JSON object of names to text")
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


# -- the handlers ----------------------------------------------------------------------------


async def submit(request: Request) -> Response:
    """Start an execution of ``{workflow}``: 201 with its id. An ``Idempotency-Key`` header
    makes it idempotent: the same key and the same body answer 200 with the execution the
    first request started (also when a ``dedup_key`` returned a live one), the same key with
    another body 409. The key covers every field (args, queue, priority, timeout, delay,
    dedup_key, debounce_key, debounce, debounce_max, concurrency_key, tags) and the workflow. With a
    ``debounce_key`` and ``debounce`` (seconds), a submit while the key's execution has not
    started replaces its arguments and answers 200 with its id. A well-formed W3C
    ``traceparent`` header (and ``tracestate``) is the execution's trace context; a
    malformed one is ignored."""
    caller = await require(request, "submit")
    state = request.app.state
    name = request.path_params["workflow"]
    if state.workflows is not None and name not in state.workflows:
        raise Refusal(404, f"unknown workflow {codec.printable(name, 200)!r}")
    body = _object(await read_json(request), ("args", "queue", "priority", "timeout", "delay",
                                              "dedup_key", "debounce_key", "debounce",
                                              "debounce_max", "concurrency_key", "tags"))
    args = body.get("args", [])
    if not isinstance(args, list):
        raise Refusal(400, "args must be a JSON array")
    priority = body.get("priority", 0)
    eid, created = await state.client.submit_created(
        name, *args, queue=_text(body, "queue", "default"), priority=priority,
        idempotency_key=_header_key(request, caller), timeout=_number(body, "timeout"),
        delay=_number(body, "delay"), dedup_key=_text(body, "dedup_key"),
        trace=trace_context(request),
        debounce=Debounce.of(_text(body, "debounce_key"), _number(body, "debounce"),
                             _number(body, "debounce_max")),
        concurrency_key=_text(body, "concurrency_key"), tags=_tags(body))
    return ok({"id": str(eid), "workflow": name}, 201 if created else 200)


async def signal(request: Request) -> Response:
    """Send a signal (``name``, ``payload``) to an execution, at most once per
    ``Idempotency-Key``: sent again, ``delivered`` is false (the first signal sent under a
    key is the one delivered)."""
    caller = await require(request, "operate")
    eid = execution_id(request)
    body = _object(await read_json(request), ("name", "payload"))
    name = body.get("name")
    if not isinstance(name, str):
        raise Refusal(400, "name (the signal's name, a string) is required")
    delivered = await send_signal(request.app, eid, name, body.get("payload"),
                                  _header_key(request, caller))
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
        sent_to = uuid.UUID(str(eid))
        if key is not None and await app.state.client.read_of(
                sent_to, lambda q: statements.http.signal_sent(q, id=sent_to, key=key)):
            return False
        raise


async def cancel(request: Request) -> Response:
    """Cancel an execution and its live children."""
    await require(request, "operate")
    eid = execution_id(request)
    return ok({"id": str(eid), "status": await request.app.state.client.cancel(eid)})


async def retry(request: Request) -> Response:
    """Re-run a failed, cancelled or quarantined execution from its last checkpoint."""
    caller = await require(request, "operate")
    eid = execution_id(request)
    await request.app.state.client.retry(eid, idempotency_key=_header_key(request, caller))
    return ok({"id": str(eid), "status": "queued"})


async def fork(request: Request) -> Response:
    """Start a new execution that reuses the first ``from_step`` checkpoints: 201 with its
    id. With an ``Idempotency-Key`` the same key and body answer 200 with the fork the first
    request made; the same key for another execution or step, 409."""
    caller = await require(request, "operate")
    eid = execution_id(request)
    body = _object(await read_json(request), ("from_step",))
    step = body.get("from_step")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 2**31:
        raise Refusal(400, "from_step must be an integer in [0, 2^31)")
    key = _header_key(request, caller)
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
    new = await app.state.client.in_bucket_of(eid, uuid.uuid5(FORK_KEYS, key))

    async def made_before() -> bool:
        source = await app.state.client.read_of(
            new, lambda q: statements.client.fork_source(q, id=new))
        if source is None:
            return False
        if source != (eid, step):
            raise Refusal(409, f"Idempotency-Key {codec.printable(key.split(':', 2)[-1], 80)!r} "
                                f"was used for the fork of {source[0]} from step {source[1]}")
        return True

    if await made_before():
        return new, False
    try:
        # fork() with a caller-chosen id (the statement the client's fork() runs).
        await app.state.client.read_of(eid, lambda q: statements.client.fork(
            q, id=eid, from_step=step, new_id=new, idempotency_key=None))
    except (IdempotencyConflict, psycopg.errors.UniqueViolation):
        # The same key sent twice at once: the other request made the fork first.
        if await made_before():
            return new, False
        raise
    return new, True




LIST_PARAMS = ("status", "workflow", "queue", "since", "until", "tag", "limit", "cursor")


async def list_executions(request: Request) -> Response:
    """Executions newest first, live and finished, filtered, one keyset page at a time;
    ``tag=NAME:VALUE`` may be repeated (all must match)."""
    await require(request, "read")
    check_query_text(request)  # its length: the header cap, and each parameter's own
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
    since, until = time_param(params, "since"), time_param(params, "until")
    tags = tag_filter(tag_params(params.getlist("tag")))
    rows = buckets.merge_pages(await state.client.read_each(
        lambda q: statements.http.page_executions(
            q, status=status, workflow=workflow, queue=queue, since=since, until=until,
            after=after, limit=limit + 1, tags=tags)), limit + 1)
    page = rows[:limit]
    more = len(rows) > limit
    next_cursor = encode_cursor(page[-1][1], page[-1][0]["id"]) if more and page else None
    return ok({"executions": [r for r, _ in page], "next_cursor": next_cursor})


def _step(s: Any, created: datetime) -> dict[str, Any]:
    return {"step_id": s.step_id, "name": s.name, "attempt": s.attempt,
            "started_at": s.started_at.isoformat(), "finished_at": s.finished_at.isoformat(),
            "offset_ms": round((s.started_at - created).total_seconds() * 1000, 1),
            "duration_ms": round((s.finished_at - s.started_at).total_seconds() * 1000, 1),
            "output": s.output, "error": s.error,
            "failed_tries": [{"attempt": t.attempt, "type": t.type, "message": t.message,
                              "failed_at": t.failed_at.isoformat()} for t in s.tries]}


async def get_execution(request: Request) -> Response:
    """One execution with its step timeline, events, pending signals, children, what it
    waits for and its deadline."""
    await require(request, "read")
    eid = execution_id(request)
    state = request.app.state
    ex = await state.client.get(eid)
    steps = await state.client.steps(eid)
    wait = await state.client.read_of(eid, lambda q: statements.http.get_wait(q, id=eid)) or {}
    return ok({
        "id": str(ex.id), "workflow": ex.workflow, "queue": ex.queue, "priority": ex.priority,
        "status": ex.status.value, "claims": ex.lease_epoch, "attempts": ex.attempts,
        "args": ex.args,
        "result": ex.result, "error": ex.error,
        "created_at": ex.created_at.isoformat(),
        "started_at": ex.started_at.isoformat() if ex.started_at else None,
        "finished_at": ex.finished_at.isoformat() if ex.finished_at else None,
        "tags": ex.tags or {}, "concurrency_key": ex.concurrency_key,
        **wait,
        "steps": [_step(s, ex.created_at) for s in steps],
        "events": await state.client.read_of(
            eid, lambda q: statements.http.list_events(q, id=eid)),
        "pending_signals": await state.client.read_of(
            eid, lambda q: statements.http.pending_signals(q, id=eid)),
        "children": await state.client.read_of(
            eid, lambda q: statements.http.list_children(q, id=eid)),
    })


async def list_queues(request: Request) -> Response:
    """Each queue with live depth by status, its oldest queued age and its limits."""
    await require(request, "read")
    state = request.app.state
    stats = await state.client.stats()
    limits = await state.client.read(statements.http.list_queue_limits(state.q))
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
    return ok({"schedules": await state.client.read(statements.http.list_schedules(state.q))})


async def list_workflows(request: Request) -> Response:
    """The workflows this server accepts (those its ``--app`` registers)."""
    await require(request, "read")
    names = request.app.state.workflows
    return ok({"workflows": sorted(names) if names is not None else None})


__all__ = [
    "API",
    "FORK_KEYS",
    "LIST_PARAMS",
    "MAX_PAGE",
    "cancel",
    "execution_id",
    "fork",
    "get_execution",
    "keyed_fork",
    "list_executions",
    "list_queues",
    "list_schedules",
    "list_workflows",
    "ok",
    "require",
    "retry",
    "send_signal",
    "signal",
    "submit",
]

"""The ASGI application of the HTTP door: :func:`create_app`.

Routes are declared once in :data:`ENDPOINTS` (method, path, scope, handler, what it does),
which builds both the Starlette routes and the OpenAPI document, so the two cannot drift.
The handlers live elsewhere: the JSON API's in :mod:`kestrel.http.api`, the webhooks' in
:mod:`kestrel.http.webhooks`, the web UI's (mounted under ``/ui`` by :func:`create_app`'s
caller) in :mod:`kestrel.http.ui`. This module is what wraps them: the route table, the
guard that turns whatever a handler raised into a refusal (:mod:`kestrel.http.refusals`),
the request metrics middleware, the lifespan that opens the database client, and the
answers to routes nobody serves.

What the handlers of both doors find on ``app.state``: ``client`` (a :class:`HttpClient`,
opened at start-up in the serving process, after any fork), ``q`` (the statements, for
:mod:`kestrel.statements.http` reads run with ``client.read``), ``workflows``, ``hooks`` and
``cfg``.

Errors are one line of JSON, ``{"error": "..."}``, with a 4xx status and nothing written;
no request body, token or secret is ever logged (a route's template, never its path, is
what a log line names).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, TypeVar

import psycopg
from psycopg_pool import PoolTimeout
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Match, Mount, Route

from kestrel import buckets, codec, connections, db, ids, metrics, statements, tracing
from kestrel._client_common import Debounce, count_submitted
from kestrel.client_async import Client
from kestrel.config import Config
from kestrel.http import bulk
from kestrel.http.api import (
    API,
    LIST_PARAMS,
    cancel,
    fork,
    get_execution,
    list_executions,
    list_queues,
    list_schedules,
    list_workflows,
    ok,
    require,
    retry,
    signal,
    submit,
)
from kestrel.http.hooks import Hook
from kestrel.http.observe import RequestMetrics, route_templates
from kestrel.http.openapi import document
from kestrel.http.refusals import Refusal, classify, template
from kestrel.http.requests import BodyBudget, read_json
from kestrel.http.webhooks import hook
from kestrel.sql import Queries, queries

log = logging.getLogger("kestrel.http")

T = TypeVar("T")


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


# -- the door's own routes -------------------------------------------------------------------


async def openapi(request: Request) -> Response:
    """The OpenAPI 3.1 document of this API."""
    return ok(document(ENDPOINTS))


async def healthz(request: Request) -> Response:
    """The server is up (no database round trip, no token)."""
    return ok({"ok": True})


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
    "delay": {"type": "number"}, "dedup_key": {"type": "string"},
    "debounce_key": {"type": "string"}, "debounce": {"type": "number", "exclusiveMinimum": 0},
    "debounce_max": {"type": "number", "exclusiveMinimum": 0},
    "concurrency_key": {"type": "string"},
    "tags": {"type": "object", "maxProperties": 32,
             "additionalProperties": {"type": "string", "minLength": 1, "maxLength": 256}}}}

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
    Endpoint("POST", f"{API}/executions/bulk", bulk.bulk, "operate",
             "Cancel, retry or signal every execution a filter matches: one page per "
             "request (dry_run: count and sample); the same key and cursor sent again act "
             "on nothing twice.", body=bulk.BODY,
             answers=(("200", "This page done (or counted): next_cursor goes on, null "
                              "when every page was done."),)),
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
                              hook_pool_size=state.cfg.http_hook_pool_size,
                              statement_timeout=state.cfg.http_statement_timeout)
    try:
        yield
    finally:
        await state.client.close()


POOL: ContextVar[str] = ContextVar("kestrel_http_pool", default="api")
"""The pool a request's statements borrow from, set by its route (:attr:`Endpoint.pool`)."""


SEVER_GRACE_S = 1.0
"""Seconds past a request's budget after which what the server could not end (a wait in
PgBouncer's queue, a link gone quiet) is cut by closing its connection."""


class HttpClient(Client):
    """The kestrel client with two more calls, :meth:`read` (the door's own reads) and
    :meth:`submit_created` (which tells a new execution from an idempotent replay), and a
    second pool of ``hook_pool_size`` connections for the webhooks' statements (those run
    while :data:`POOL` is ``hooks``): a burst of deliveries cannot take the API's and the
    web UI's connections, nor they the hooks'. Every connection of both carries the
    request's budget (:meth:`_borrow`)."""

    _connection_class = connections.BudgetConnection

    def __init__(self, *args: Any, hook_pool_size: int = 2, statement_timeout: float = 5.0,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._hooks = Client(*args, **{**kwargs, "pool_size": hook_pool_size})
        self._hooks._connection_class = connections.BudgetConnection
        self._statement_timeout = statement_timeout

    async def read(self, stmt: statements.Stmt[Any]) -> Any:
        """Run one read statement of :mod:`kestrel.statements.http` on a pooled connection.
        Its schema is the one served (bucket 0 of a namespace: tokens, sessions, schedules,
        the queues' limits)."""
        return await self._run(stmt)

    async def read_script(self, script: statements.Script[T]) -> T:
        """Run *script* (statements of :mod:`kestrel.statements.http`) in one transaction on
        a pooled connection, in the schema served."""
        async with self._borrow() as conn:
            return await db.run_script(conn, script)

    async def read_of(self, execution_id: uuid.UUID,
                      make: Callable[[Queries], statements.Stmt[T]]) -> T:
        """Run the read *make(q)* in the schema holding *execution_id* (its bucket's, in a
        namespace spread over buckets; kestrel.buckets)."""
        return await self._run(make(await self._of(execution_id)))

    async def in_bucket_of(self, execution_id: uuid.UUID, made: uuid.UUID) -> uuid.UUID:
        """*made*, an id made for an execution that lives with *execution_id* (a fork), in
        that one's bucket: unchanged outside a namespace."""
        qs = await self._namespace()
        if len(qs) == 1:
            return made
        return buckets.with_bucket(made, buckets.bucket_of(execution_id, len(qs)))

    async def read_each(self, make: Callable[[Queries], statements.Stmt[T]]) -> list[T]:
        """The read *make(q)* in every schema served (each bucket's), bucket 0 first."""
        parts: list[T] = await self._every(make)
        return parts

    async def read_by_bucket(self, ids: Sequence[uuid.UUID],
                             make: Callable[[Queries, list[uuid.UUID]],
                                            statements.Stmt[dict[str, Any]]],
                             ) -> dict[str, Any]:
        """The read *make(q, ids)* of the *ids* in each bucket's schema, merged by id."""
        qs = await self._namespace()
        groups: dict[int, list[uuid.UUID]] = {}
        for eid in ids:
            groups.setdefault(buckets.bucket_of(eid, len(qs)) if len(qs) > 1 else 0,
                              []).append(eid)
        found: dict[str, Any] = {}
        for k, group in groups.items():
            found.update(await self._run(make(qs[k], group)))
        return found

    @asynccontextmanager
    async def _borrow(self, timeout: float | None = None,
                      ) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """A connection of the request's pool, for at most ``statement_timeout`` seconds,
        the wait for it included (issue 41 row 5: a table lock held elsewhere hung every
        request, each holding a pool connection). Past them the request is refused 503 with
        Retry-After and its connection goes back to the pool idle.

        The server keeps the budget, not this process: what the request runs is one
        transaction whose ``SET LOCAL statement_timeout`` is the budget left once a
        connection is borrowed, so PostgreSQL itself ends a statement that waits on a lock
        and nothing is left on the connection (PgBouncer-safe). No cancel request is ever
        sent: through PgBouncer 1.18 a cancel is forwarded on a server connection of its
        own, may wait for one without bound (psycopg's cancel blocks until it is), and can
        reach another client's statement once the server connection has moved on. What
        the server cannot bound (a wait in PgBouncer's queue, a link gone quiet) is cut
        :data:`SEVER_GRACE_S` later by closing the connection's socket."""
        borrow = self._hooks._borrow if POOL.get() == "hooks" else super()._borrow
        budget = self._statement_timeout
        deadline = time.monotonic() + budget
        try:
            async with borrow(min(budget, timeout or budget)) as conn, \
                    connections.budget(conn, deadline, SEVER_GRACE_S):
                yield conn
        except (PoolTimeout, connections.Overrun):
            metrics.get().http_refused.labels("statement_timeout").inc()
            raise Refusal(503, f"the database did not answer within "
                               f"{budget:g} s (a lock or a slow statement); "
                               "try again", {"Retry-After": "1"}) from None

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
                             debounce: Debounce | None = None,
                             concurrency_key: str | None = None,
                             tags: dict[str, str] | None = None,
                             ) -> tuple[uuid.UUID, bool]:
        """:meth:`submit`, returning the execution's id and whether this call started it:
        the id is chosen here, so any other id returned is an execution started before
        (the same idempotency key, a live one holding the dedup key, or the debounce key's
        pending one). *trace* (the request's trace context) replaces the current span's."""
        params = self._submit_params(wf, args, queue, priority, idempotency_key, timeout,
                                     delay, None, dedup_key, "return", debounce,
                                     concurrency_key=concurrency_key, tags=tags)
        if trace is not None:
            params["traceparent"], params["tracestate"] = trace
        q, bucket = await self._submit_to(params)
        # In a namespace, the id names the bucket chosen (kestrel.buckets).
        params["id"] = chosen = ids.new_id(bucket=bucket)
        eid = await self._run(statements.client.submit(q, params))
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
    app.state.hook_budget = BodyBudget(cfg.http_hook_body_budget_bytes)
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

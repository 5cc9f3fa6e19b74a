"""HTTP metrics of the door: every request by method, route template and status, and its
duration (``kestrel_http_requests_total``, ``kestrel_http_request_duration_seconds``).

The ``route`` label is the template of the route that answered (``/api/v1/executions/{id}``,
``/ui/executions/{id}``), looked up in a table built once from the app's routes, or
``unmatched``: never the path a client sent, so the label's values are as few as the routes
(FAULTS S2). ``method`` is one of a fixed few or ``other``. In the supervisor's HTTP child
these land in the multiprocess directory and show on the supervisor's ``/metrics``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from starlette.routing import BaseRoute, Mount
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kestrel import metrics

METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
UNMATCHED = "unmatched"


def route_templates(routes: Iterable[BaseRoute], prefix: str = "") -> dict[int, str]:
    """Each route's full template by ``id(route)`` (routes live as long as the app; Starlette
    routes are not hashable): a mount's own entry is ``PREFIX/{path}``, its routes' entries
    carry its prefix."""
    table: dict[int, str] = {}
    for route in routes:
        path = str(getattr(route, "path", ""))
        if isinstance(route, Mount):
            table[id(route)] = f"{prefix}{path}/{{path}}"
            table.update(route_templates(route.routes, prefix + path))
        else:
            table[id(route)] = f"{prefix}{path}" or "/"
    return table


class RequestMetrics:
    """ASGI middleware: count and time each HTTP request under its route's template."""

    def __init__(self, app: ASGIApp, templates: Mapping[int, str]) -> None:
        self.app = app
        self.templates = templates

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # what the client gets when the app raises before answering

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            record(scope, self.templates, status, time.perf_counter() - started)


def record(scope: Scope, templates: Mapping[int, str], status: int, seconds: float) -> None:
    """Count one answered request (route from ``scope["route"]``, set by the router)."""
    route: Any = scope.get("route")
    template = templates.get(id(route), UNMATCHED) if route is not None else UNMATCHED
    method = scope.get("method", "")
    method = method if method in METHODS else "other"
    m = metrics.get()
    m.child(m.http_requests, method, template, str(status)).inc()
    m.child(m.http_seconds, method, template).observe(seconds)

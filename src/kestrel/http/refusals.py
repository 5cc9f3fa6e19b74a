"""How both doors refuse a request: one exception, :class:`Refusal`, and one ladder,
:func:`classify`, from whatever a handler raised to a status and a one-line reason. The API
answers it as one line of JSON (:func:`kestrel.http.app.error_response`), the UI as a page
(:func:`kestrel.http.ui.render.error_page`); nothing was written in either case. Log lines
name the route's template and an error's type or SQLSTATE, never a message: it may quote
the request's values (FAULTS S5).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import psycopg
from starlette.requests import ClientDisconnect, Request

from kestrel.errors import (
    DuplicateExecution,
    ExecutionNotFound,
    IdempotencyConflict,
    InvalidState,
    KestrelError,
    PayloadTooLarge,
)

log = logging.getLogger("kestrel.http")


class Refusal(Exception):
    """A request refused with *status* and a one-line *reason* (nothing was written);
    *headers* go with the answer (a 401's challenge, a 405's ``Allow``)."""

    def __init__(self, status: int, reason: str,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.headers = headers


def status_of(exc: KestrelError) -> int:
    """The HTTP status of a typed kestrel error: 413, 404, 409, else 400."""
    if isinstance(exc, PayloadTooLarge):
        return 413
    if isinstance(exc, ExecutionNotFound):
        return 404
    if isinstance(exc, IdempotencyConflict | DuplicateExecution | InvalidState):
        return 409
    return 400


def classify(exc: Exception, request: Request, *, internal: str = "internal error",
             ) -> Refusal:
    """The refusal for *exc*, raised while answering *request*: a :class:`Refusal` as it
    is, a kestrel error by :func:`status_of`, the database unavailable 503, a value the
    database refuses (class 22) 400, another database error 500 with its SQLSTATE, a client
    gone before its body 400, anything else (a bug of ours) 500 with *internal* as the
    reason. The database's answers and our bugs are logged."""
    if isinstance(exc, Refusal):
        return exc
    if isinstance(exc, KestrelError):
        return Refusal(status_of(exc), str(exc))
    if isinstance(exc, psycopg.OperationalError):
        log.warning("database unavailable on %s %s", request.method, template(request))
        return Refusal(503, "database unavailable; try again")
    if isinstance(exc, psycopg.Error) and (exc.sqlstate or "").startswith("22"):
        # A data exception: the database refused a value the request carried (a hook's body
        # parsed by PostgreSQL: `1e1000000` overflows numeric). The client's to fix, as the
        # API's own checks say; the reply names the class, never the message (it may quote
        # the value).
        log.info("database refused a value (%s) on %s %s", exc.sqlstate, request.method,
                 template(request))
        what = ("a number in the request is out of range" if exc.sqlstate == "22003"
                else "a value in the request is malformed")
        return Refusal(400, f"{what} (SQLSTATE {exc.sqlstate})")
    if isinstance(exc, psycopg.Error):
        log.error("database error %s on %s %s", exc.sqlstate, request.method,
                  template(request))
        return Refusal(500, f"database error {exc.sqlstate}")
    if isinstance(exc, ClientDisconnect):
        return Refusal(400, "the client went away before its body was read")
    log.error("internal error %s on %s %s", type(exc).__name__, request.method,
              template(request))
    return Refusal(500, internal)


def template(request: Request) -> str:
    """The route template *request* matched (``/api/v1/executions/{id}``), never its path."""
    return str(getattr(request.scope.get("route"), "path", "?"))

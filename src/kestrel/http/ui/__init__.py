"""The web UI of the HTTP door: server-rendered pages under ``/ui`` (Jinja2, no JS build).

Pages: executions (filters and live counts; what each waiting row waits for and since
when), one execution (first its alert: what it waits for with approve/reject/send forms, or
its failure with the traceback as text; then the step timeline, events, child tree, cancel
and retry; a form redirects back to it saying what it sent, and its script reloads it when
the execution's state changes), queues, schedules and a search over history. Every read is
a statement of :mod:`kestrel.statements.http` (shared with the JSON API) or of
``sql/queries/ui.sql``; every change goes through the kestrel client, so the same SQL
functions and rules as at every other door.

Sessions. The login page takes an API token and starts a session; the cookie holds the
session's secret, never the token, and each form carries the session's CSRF token
(:mod:`kestrel.http.sessions`). Pages need ``read``; forms need ``operate``.

Where things are: :mod:`~kestrel.http.ui.render` (the templates, their filters and the
views of a wait or a failure), :mod:`~kestrel.http.ui.pages` (the GET pages and the checks
every request gets first), :mod:`~kestrel.http.ui.forms` (the POST forms, login and
logout) and :func:`routes` here. The UI imports no module of the JSON API
(``tests/unit/test_layering.py``).

Bad input (unknown parameters, NUL, lone surrogates, over-long values, ids that are not
UUIDs, unknown ids) gets a 4xx page with a one-line reason before anything is written.
Output is HTML-escaped everywhere (Jinja2 autoescape), and a Content-Security-Policy allows
only this server's own CSS and script.
"""

from __future__ import annotations

from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from kestrel.http.refusals import Refusal
from kestrel.http.requests import read_form
from kestrel.http.sessions import COOKIE, Session, csrf_token
from kestrel.http.ui import bulk
from kestrel.http.ui.forms import act, login, login_page, logout
from kestrel.http.ui.pages import (
    TIMELINE_STEPS,
    counts_json,
    execution,
    execution_state,
    executions,
    like_pattern,
    not_found,
    page,
    queues,
    root,
    schedules,
    search,
)
from kestrel.http.ui.render import (
    HERE,
    SHOWN_CHARS,
    TEMPLATES,
    TRACEBACK_CHARS,
    ago,
    failure_view,
)


def routes() -> list[BaseRoute]:
    """The UI's routes, for :func:`kestrel.http.app.create_app` to mount."""
    return [
        Route("/", root, methods=["GET"]),
        Route("/ui", root, methods=["GET"]),
        Mount("/ui", routes=[
            Route("/", page(executions), methods=["GET"]),
            Route("/counts", page(counts_json), methods=["GET"]),
            Route("/executions/{id}", page(execution), methods=["GET"]),
            Route("/executions/{id}/state", page(execution_state), methods=["GET"]),
            Route("/executions/{id}/{action}", act, methods=["POST"]),
            Route("/bulk/{action}", page(bulk.confirm, scope="operate"), methods=["GET"]),
            Route("/bulk/{action}", bulk.act, methods=["POST"]),
            Route("/queues", page(queues), methods=["GET"]),
            Route("/schedules", page(schedules), methods=["GET"]),
            Route("/search", page(search), methods=["GET"]),
            Route("/login", login_page, methods=["GET"]),
            Route("/login", login, methods=["POST"]),
            Route("/logout", logout, methods=["POST"]),
            Mount("/static", app=StaticFiles(directory=HERE / "static"), name="static"),
            Route("/{rest:path}", not_found, methods=["GET", "POST"]),
        ]),
    ]


__all__ = [
    "COOKIE",
    "HERE",
    "SHOWN_CHARS",
    "TEMPLATES",
    "TIMELINE_STEPS",
    "TRACEBACK_CHARS",
    "Refusal",
    "Session",
    "ago",
    "csrf_token",
    "failure_view",
    "like_pattern",
    "read_form",
    "routes",
]

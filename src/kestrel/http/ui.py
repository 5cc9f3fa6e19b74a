"""The web UI of the HTTP door: server-rendered pages under ``/ui`` (Jinja2, no JS build).

Pages: executions (filters and live counts; what each waiting row waits for and since
when), one execution (first its alert: what it waits for with approve/reject/send forms, or
its failure with the traceback as text; then the step timeline, events, child tree, cancel
and retry; a form redirects back to it saying what it sent, and its script reloads it when
the execution's state changes), queues, schedules and a search over history. Every read is
a statement of :mod:`kestrel.http.store` (shared with the JSON API) or of
``sql/queries/ui.sql``; every change goes through the kestrel client, so the same SQL
functions and rules as at every other door.

Sessions. The login page takes an API token and starts a session; the cookie holds the
session's secret, never the token, and each form carries the session's CSRF token
(:mod:`kestrel.http.sessions`). Pages need ``read``; forms need ``operate``.

Bad input (unknown parameters, NUL, lone surrogates, over-long values, ids that are not
UUIDs, unknown ids) gets a 4xx page with a one-line reason before anything is written.
Output is HTML-escaped everywhere (Jinja2 autoescape), and a Content-Security-Policy allows
only this server's own CSS and script.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import secrets
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import jinja2
from markupsafe import Markup
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from kestrel import codec
from kestrel.codec import QUEUE_NAME
from kestrel.db import Stmt
from kestrel.errors import (
    ExecutionNotFound,
    KestrelError,
)
from kestrel.http import auth, sessions, store
from kestrel.http.refusals import Refusal, classify
from kestrel.http.requests import decode_cursor, encode_cursor, parse_time, read_form
from kestrel.http.sessions import COOKIE, Session, csrf_token, current_session
from kestrel.sql import Queries
from kestrel.types import Status

log = logging.getLogger("kestrel.http.ui")

HERE = Path(__file__).parent
PAGE = 50
MAX_QUERY_BYTES = 4096
SHOWN_CHARS = 2000
"""How much of a JSON value (arguments, outputs, payloads) a page shows before cutting."""
FINISHED_WINDOW = timedelta(hours=24)
SEARCH_DAYS = 30
TREE_NODES = 200
TIMELINE_STEPS = 500
"""Most steps the execution page draws (a long loop of steps would make a page of megabytes)."""
TREE_DEPTH = 5
TRACEBACK_CHARS = 16_000
"""How much of a failure's traceback the execution page shows (its end: the frame that
raised is there)."""
TERMINAL = tuple(s.value for s in Status if s.terminal)
ACTIONS = ("approve", "reject", "signal", "cancel", "retry")
SIGNAL_ACTIONS = ("approve", "reject", "signal")
NOTICES = {"approve": "Approval sent.", "reject": "Rejection sent.", "signal": "Signal sent.",
           "cancel": "Cancelled.", "retry": "Queued again from its last checkpoint.",
           "duplicate": "Already sent from this form; nothing sent twice."}

SECURITY_HEADERS = {
    # Inline style attributes only (the timeline's bar widths, computed here); no inline
    # script, nothing from another origin.
    "Content-Security-Policy": ("default-src 'none'; style-src 'self'; script-src 'self'; "
                                "style-src-attr 'unsafe-inline'; img-src 'self' data:; "
                                "connect-src 'self'; form-action 'self'; base-uri 'none'; "
                                "frame-ancestors 'none'"),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}

# -- rendering -------------------------------------------------------------------------------


def _short_json(value: Any, limit: int = SHOWN_CHARS) -> str:
    text = json.dumps(value, indent=2, ensure_ascii=False, default=str)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}\n… ({len(text) - limit} more characters not shown)"


def _cut(value: Any, limit: int = SHOWN_CHARS) -> str:
    text = str(value)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text) - limit} more)"


def _when(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    return str(value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S"))


def _minute(value: Any) -> str:
    """*value* to the minute in UTC ("2026-12-01 18:02"), for "since … (…)"."""
    if value is None:
        return "—"
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    return str(value.astimezone(UTC).strftime("%Y-%m-%d %H:%M"))


def ago(seconds: float) -> str:
    """A duration as a person reads it at a glance, whole units down: "40 s", "12 min",
    "5 h", "3 days"."""
    s = max(int(seconds), 0)
    if s < 90:
        return f"{s} s"
    if s < 90 * 60:
        return f"{s // 60} min"
    if s < 48 * 3600:
        return f"{s // 3600} h"
    return f"{s // 86400} days"


def _traceback(value: Any, limit: int = TRACEBACK_CHARS) -> str:
    """A traceback as text to show: each line cut at :data:`SHOWN_CHARS` (the exception's
    line may quote a huge message), then its end, at most *limit* characters (the frame that
    raised and the exception are at the end)."""
    text = "\n".join(_cut(line) for line in str(value).splitlines())
    if len(text) <= limit:
        return text
    return f"… ({len(text) - limit} earlier characters not shown)\n{text[-limit:]}"


def _ms(value: float | None) -> str:
    if value is None:
        return "—"
    if value < 1000:
        return f"{value:.1f} ms"
    if value < 120_000:
        return f"{value / 1000:.2f} s"
    return f"{value / 60_000:.1f} min"


# Bidirectional controls (embeddings, overrides, isolates, marks): shown raw, one in a name
# or a payload reorders the text around it on the page (a right-to-left override makes
# "evil\u202egnp.exe" read "evilexe.png"). Every value a page shows has them written as
# visible escapes instead.
_BIDI = re.compile("[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


class Verbatim(str):
    """A value a page must hold exactly as it is (a form field sent back to the server),
    exempt from :func:`visible`; still HTML-escaped."""


def visible(value: Any) -> Any:
    """*value* with every bidirectional control character written as ``\\uXXXX``: every
    value a template prints goes through this (Jinja2's finalize), before HTML escaping.
    Markup (already safe HTML made here) and :class:`Verbatim` values are left alone."""
    if isinstance(value, str) and not isinstance(value, Verbatim | Markup) \
            and _BIDI.search(value):
        return _BIDI.sub(lambda m: f"\\u{ord(m.group()):04x}", value)
    return value


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"),
                             autoescape=True, undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True, finalize=visible)
    env.filters.update(json=_short_json, cut=_cut, when=_when, ms=_ms, verbatim=Verbatim,
                       minute=_minute, traceback=_traceback)
    return env


TEMPLATES = _environment()


def render(request: Request, template: str, *, status: int = 200,
           session: Session | None = None, **context: Any) -> HTMLResponse:
    """*template* rendered with *context*, with the UI's security headers."""
    html = TEMPLATES.get_template(template).render(
        session=session, path=request.url.path, statuses=[s.value for s in Status], **context)
    return HTMLResponse(html, status_code=status, headers=SECURITY_HEADERS)


def error_page(request: Request, status: int, reason: str,
               session: Session | None = None) -> HTMLResponse:
    """The one-line *reason* of a refusal as a page (hostile text made printable)."""
    line = codec.printable(" ".join(str(reason).split()), 300)
    return render(request, "error.html", status=status, session=session, status_code=status,
                  reason=line)


def _checked(form: Mapping[str, str], name: str, *, what: str, max_chars: int = 1024,
             required: bool = True) -> str | None:
    value = form.get(name)
    if value is None or value == "":
        if required:
            raise Refusal(400, f"{what} is required")
        return None
    try:
        return codec.check_text(value, what=what, max_chars=max_chars)
    except KestrelError as exc:
        raise Refusal(400, str(exc)) from None


def _safe_next(target: str | None) -> str:
    """Where to go after logging in: a path of this UI only (no open redirect)."""
    if (target and target.startswith("/ui") and not target.startswith("//")
            and "\\" not in target and all(31 < ord(c) < 127 for c in target)):
        return target
    return "/ui/"


# -- handlers --------------------------------------------------------------------------------

Page = Callable[[Request, Session], Awaitable[Response]]


def page(handler: Page, *, scope: str = "read") -> Callable[[Request], Awaitable[Response]]:
    """A GET page: a request without a session is sent to the login page; one whose token
    lacks *scope* gets 403; refusals and database trouble become error pages."""

    async def endpoint(request: Request) -> Response:
        session: Session | None = None
        try:
            _check_query(request)
            session = await current_session(request)
            if session is None:
                target = request.url.path + (f"?{request.url.query}" if request.url.query
                                             else "")
                return RedirectResponse(f"/ui/login?{urlencode({'next': target})}", 303)
            if not session.can(scope):
                raise Refusal(403, f"this token lacks the {scope!r} scope")
            return await handler(request, session)
        except Exception as exc:
            return _refusal(request, exc, session)

    endpoint.__doc__ = handler.__doc__
    return endpoint


def _refusal(request: Request, exc: Exception, session: Session | None) -> Response:
    refusal = classify(exc, request, internal="internal error; the server log names it")
    return error_page(request, refusal.status, refusal.reason, session)


def _check_query(request: Request) -> None:
    raw = request.scope.get("query_string", b"")
    if len(raw) > MAX_QUERY_BYTES:
        raise Refusal(414, f"query string over {MAX_QUERY_BYTES} bytes")
    for name, value in request.query_params.multi_items():
        for text in (name, value):
            if "\x00" in text or "\ufffd" in text:
                raise Refusal(400, "a query parameter holds NUL or bytes that are not UTF-8")


def _params(request: Request, allowed: tuple[str, ...]) -> dict[str, str]:
    params = request.query_params
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise Refusal(400, f"unknown query parameter(s): {', '.join(map(ascii, unknown))}")
    if len(params.multi_items()) != len(params):
        raise Refusal(400, "a query parameter is given twice")
    return {k: v for k, v in params.items() if v != ""}


def _time(params: Mapping[str, str], name: str) -> datetime | None:
    text = params.get(name)
    if text is None:
        return None
    try:
        return parse_time(text)
    except ValueError:
        raise Refusal(400, f"{name} must be a time like 2026-01-31T09:30") from None


def _status(params: Mapping[str, str], allowed: tuple[str, ...]) -> str | None:
    status = params.get("status")
    if status is not None and status not in allowed:
        raise Refusal(400, f"status must be one of {', '.join(allowed)}")
    return status


def _execution_id(text: str) -> uuid.UUID:
    try:
        if len(text) > 64:
            raise ValueError
        return uuid.UUID(text)
    except ValueError:
        raise Refusal(400, f"{codec.printable(text, 60)!r} is not an execution id (a UUID)"
                      ) from None


async def _read(request: Request, stmt: Stmt[Any]) -> Any:
    return await request.app.state.client.read(stmt)


def _q(request: Request) -> Queries:
    q: Queries = request.app.state.q
    return q


async def counts(request: Request) -> dict[str, Any]:
    """Live executions by status and those finished in the last 24 hours by status."""
    rows = await _read(request, Stmt(_q(request).ui_counts,
                                     {"finished_window": FINISHED_WINDOW},
                                     lambda rows: rows))
    live = {s.value: 0 for s in Status if not s.terminal}
    finished = dict.fromkeys(TERMINAL, 0)
    for status, n, is_live in rows:
        (live if is_live else finished)[status] = int(n)
    return {"live": live, "finished_24h": finished}


def _wait_view(row: tuple[Any, ...]) -> dict[str, Any]:
    """A ``ui_waits`` row as the pages show it: *kind* (``signal``, ``child``, ``sleep``,
    ``start`` for a delayed start, ``version`` for a give-back to a newer app version),
    the signal's name or the child's id, *until* (a sleep's end, a wait's timeout, a
    give-back's retry), *since* when it waits and how long ago that is by the database's
    clock, and whether what it waits for has *arrived* (it resumes at its next claim)."""
    (_id, waiting_for, wait_deadline, wake_at, since, given_back_at, given_back_by,
     give_backs, arrived, now) = row
    view: dict[str, Any] = {"signal": None, "child_id": None, "until": wait_deadline,
                            "since": since, "ago": ago((now - since).total_seconds()),
                            "arrived": bool(arrived),
                            "versions": ", ".join(given_back_by or []) or "an older version",
                            "give_backs": int(give_backs or 0)}
    if waiting_for is None:
        view.update(kind="start", until=wake_at)
    elif waiting_for == "kestrel.sleep":
        view.update(kind="sleep", until=wake_at)
    elif waiting_for.startswith("kestrel.child:"):
        view.update(kind="child", child_id=waiting_for.removeprefix("kestrel.child:"))
    else:
        view.update(kind="signal", signal=waiting_for)
    if given_back_at is not None:  # it waits for a worker of another version first
        view.update(kind="version", retry_at=wake_at)
    return view


def _waits(request: Request, ids: list[uuid.UUID]) -> Awaitable[dict[str, dict[str, Any]]]:
    """What each waiting execution of *ids* waits for and since when, by id."""
    return _read(request, Stmt(_q(request).ui_waits, {"ids": ids}, lambda rows: {
        str(r[0]): _wait_view(r) for r in rows}))


def failure_view(error: Any, steps: Sequence[Any] = ()) -> dict[str, Any] | None:
    """A stored error (``{"type", "message", "traceback"}``) as the execution page shows
    it: the three as text (the traceback with its line breaks), the raw JSON, and the last
    failed step of *steps* with its own traceback (where the code raised, when the
    execution failed with :class:`~kestrel.errors.StepFailed`); None when there is none."""
    if error is None:
        return None
    step = next((s for s in reversed(steps) if s.error), None)
    if not isinstance(error, dict):
        return {"type": "error", "message": str(error), "traceback": None, "raw": error,
                "step": step, "step_traceback": None}
    trace = error.get("traceback")
    step_trace = step.error.get("traceback") if step and isinstance(step.error, dict) \
        else None
    return {"type": str(error.get("type") or "error"),
            "message": str(error.get("message") or ""),
            "traceback": str(trace) if trace else None, "raw": error, "step": step,
            "step_traceback": str(step_trace) if step_trace else None}


async def executions(request: Request, session: Session) -> Response:
    """Executions newest first, filtered by status, workflow, queue and creation time."""
    params = _params(request, ("status", "workflow", "queue", "since", "until", "cursor"))
    status = _status(params, tuple(s.value for s in Status))
    workflow = params.get("workflow")
    if workflow is not None:
        _checked(params, "workflow", what="workflow")
    queue = params.get("queue")
    if queue is not None and not QUEUE_NAME.fullmatch(queue):
        raise Refusal(400, "queue names are 1-128 of A-Z a-z 0-9 _ . : -")
    cursor = params.get("cursor")
    after = decode_cursor(cursor) if cursor else None
    rows = await _read(request, store.page_executions(
        _q(request), status=status, workflow=workflow, queue=queue,
        since=_time(params, "since"), until=_time(params, "until"), after=after,
        limit=PAGE + 1))
    page_rows = rows[:PAGE]
    waiting = [uuid.UUID(r["id"]) for r, _ in page_rows if r["status"] == "waiting"]
    waits = await _waits(request, waiting) if waiting else {}
    next_url = None
    if len(rows) > PAGE and page_rows:
        nxt = {k: v for k, v in params.items() if k != "cursor"}
        nxt["cursor"] = encode_cursor(page_rows[-1][1], page_rows[-1][0]["id"])
        next_url = f"/ui/?{urlencode(nxt)}"
    return render(request, "executions.html", session=session, filters=params,
                  rows=[{**r, "wait": waits.get(r["id"])} for r, _ in page_rows],
                  next_url=next_url,
                  counts=await counts(request))


async def counts_json(request: Request, session: Session) -> Response:
    """The live counts as JSON, for the executions page's refresh."""
    _params(request, ())
    return JSONResponse(await counts(request), headers={"Cache-Control": "no-store"})


async def _tree(request: Request, root: uuid.UUID) -> list[dict[str, Any]]:
    """The child tree below *root*, depth-first, each node with its depth (bounded)."""
    found: list[dict[str, Any]] = []

    async def walk(eid: uuid.UUID, depth: int) -> None:
        if depth > TREE_DEPTH or len(found) >= TREE_NODES:
            return
        for child in await _read(request, store.list_children(_q(request), id=eid)):
            if len(found) >= TREE_NODES:
                return
            found.append({**child, "depth": depth})
            await walk(uuid.UUID(child["id"]), depth + 1)

    await walk(root, 0)
    return found


async def execution(request: Request, session: Session) -> Response:
    """One execution: its state, wait, step timeline, events, signals and child tree."""
    params = _params(request, ("done", "sent"))
    eid = _execution_id(request.path_params["id"])
    client = request.app.state.client
    ex = await client.get(eid)
    notice = await _notice(request, eid, params)
    steps = await client.steps(eid)
    wait = await _read(request, store.get_wait(_q(request), id=eid)) or {}
    waits = await _waits(request, [eid]) if ex.status.value == "waiting" else {}
    end = ex.finished_at or max([s.finished_at for s in steps], default=ex.created_at)
    span_ms = max((end - ex.created_at).total_seconds() * 1000, 1.0)
    timeline = []
    for s in sorted(steps, key=_timeline_order)[:TIMELINE_STEPS]:
        offset = (s.started_at - ex.created_at).total_seconds() * 1000
        duration = (s.finished_at - s.started_at).total_seconds() * 1000
        timeline.append({
            "step": s, "offset_ms": offset, "duration_ms": duration,
            # A fork's copied checkpoints ran before the fork existed: no negative offset.
            "reused": offset < 0, "marker": _marker_at(s),
            "left": min(max(offset / span_ms * 100, 0), 100),
            "width": min(max(duration / span_ms * 100, 0.5), 100)})
    return render(
        request, "execution.html", session=session, ex=ex, wait=wait, timeline=timeline,
        waits=waits.get(str(eid)), failure=failure_view(ex.error, steps)
        if ex.status.value in ("failed", "quarantined") else None,
        state=None if ex.status.terminal else _state(ex, waits.get(str(eid))),
        events=await _read(request, store.list_events(_q(request), id=eid)),
        signals=await _read(request, store.pending_signals(_q(request), id=eid)),
        tree=await _tree(request, eid), notice=notice, form_key=secrets.token_hex(16),
        forked=await client.forked_from(eid),
        hidden_steps=max(len(steps) - TIMELINE_STEPS, 0))


def _marker_at(step: Any) -> int | None:
    """For a patch marker (a negative step id), the position it marks; else None."""
    if step.step_id >= 0:
        return None
    at = step.output.get("at") if isinstance(step.output, dict) else None
    return at if isinstance(at, int) else 0


def _timeline_order(step: Any) -> tuple[int, int]:
    """Steps by position, a patch marker just before the position it marks."""
    at = _marker_at(step)
    return (step.step_id, 1) if at is None else (at, 0)


async def _notice(request: Request, eid: uuid.UUID, params: Mapping[str, str],
                  ) -> dict[str, Any] | None:
    """The notice after a form's redirect (``?done=ACTION``): for a signal, what was sent
    (``&sent=ACTION:KEY``, the form's idempotency key: the signal is read back from the
    database, so the notice shows what arrived, name and payload, not what a link says)."""
    done = params.get("done")
    if done not in NOTICES:
        return None
    notice: dict[str, Any] = {"text": NOTICES[done], "signal": None}
    sent = _checked(params, "sent", what="sent", max_chars=80, required=False)
    if sent and sent.partition(":")[0] in SIGNAL_ACTIONS:
        notice["signal"] = await _read(request, Stmt(
            _q(request).ui_sent_signal, {"id": eid, "key": f"ui:{sent}"},
            lambda rows: {"name": rows[0][0], "payload": rows[0][1], "at": rows[0][2]}
            if rows else None))
    return notice


def _state(ex: Any, wait: dict[str, Any] | None) -> str:
    """What the execution page shows of a live execution, in a few words: the page's script
    reloads the page when the state endpoint answers something else."""
    parts = [ex.status.value, str(ex.waiting_for), str(ex.given_back_at is not None),
             str(bool(wait and wait["arrived"])), str(ex.finished_at is not None)]
    return hashlib.sha256("\x1f".join(parts).encode("utf-8", "backslashreplace")
                          ).hexdigest()[:16]


async def execution_state(request: Request, session: Session) -> Response:
    """The state of one execution (as :func:`_state`), for the execution page's reload
    after an approval: ``{"state": …}``, or null once it has finished."""
    _params(request, ())
    eid = _execution_id(request.path_params["id"])
    ex = await request.app.state.client.get(eid)
    waits = await _waits(request, [eid]) if ex.status.value == "waiting" else {}
    state = None if ex.status.terminal else _state(ex, waits.get(str(eid)))
    return JSONResponse({"state": state, "status": ex.status.value},
                        headers={"Cache-Control": "no-store"})


async def queues(request: Request, session: Session) -> Response:
    """Each queue: live depth by status, its oldest queued age and its limits; the live
    workers (what they claim, their app version) and the work none of them can claim."""
    _params(request, ())
    stats = await request.app.state.client.stats()
    limits = await _read(request, store.list_queue_limits(_q(request)))
    found: dict[str, dict[str, Any]] = {}
    for name in sorted({*(s.queue for s in stats.queues), *limits}):
        found[name] = {"queue": name, "depth": {}, "oldest": None, "limits": limits.get(name)}
    for s in stats.queues:
        found[s.queue]["depth"][s.status] = s.count
        if s.status == "queued":
            found[s.queue]["oldest"] = s.oldest_age_s
    client = request.app.state.client
    return render(request, "queues.html", session=session, queues=list(found.values()),
                  running=stats.running_by_worker, workers=await client.workers(),
                  unclaimable=await client.unclaimable(limit=PAGE))


async def schedules(request: Request, session: Session) -> Response:
    """Every cron schedule with its last tick."""
    _params(request, ())
    rows = await _read(request, store.list_schedules(_q(request)))
    return render(request, "schedules.html", session=session, schedules=rows)


def like_pattern(text: str) -> str:
    r"""An ILIKE pattern matching *text* anywhere, its ``%``, ``_`` and ``\`` escaped."""
    escaped = text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


async def search(request: Request, session: Session) -> Response:
    """Finished executions whose workflow, error, arguments or key contain the text; an
    execution id goes straight to its page."""
    params = _params(request, ("q", "status", "since", "until"))
    text = _checked(params, "q", what="search text", max_chars=200, required=False) or ""
    text = text.strip()
    try:
        return RedirectResponse(f"/ui/executions/{uuid.UUID(text)}", 303)
    except ValueError:
        pass
    status = _status(params, TERMINAL)
    now = datetime.now(UTC)
    since = _time(params, "since") or now - timedelta(days=SEARCH_DAYS)
    until = _time(params, "until") or now + timedelta(days=1)
    rows = await _read(request, Stmt(_q(request).search_history, {
        "since": since, "until": until, "status": status, "pattern": like_pattern(text),
        "limit": PAGE}, lambda rows: [
            {"id": str(r[0]), "workflow": r[1], "queue": r[2], "status": r[3],
             "claims": r[4], "created_at": r[5], "finished_at": r[6],
             "parent_id": str(r[7]) if r[7] else None,
             "error": f"{r[8]}: {r[9]}" if r[8] else None} for r in rows]))
    return render(request, "search.html", session=session, q=text, filters=params,
                  since=since, until=until, rows=rows, limit=PAGE)


async def login_page(request: Request) -> Response:
    """The login form: paste a token."""
    try:
        _check_query(request)
        params = _params(request, ("next",))
    except Refusal as exc:
        return error_page(request, exc.status, exc.reason)
    return render(request, "login.html", next=_safe_next(params.get("next")))


async def login(request: Request) -> Response:
    """Check the pasted token like a bearer token; set the session cookie."""
    try:
        if not sessions.same_origin(request):
            raise Refusal(403, "cross-site login refused")
        form = await read_form(request, cap=8192)
        token = (_checked(form, "token", what="token", max_chars=200) or "").strip()
        caller, cookie = await sessions.start(request, token)
    except Exception as exc:
        return _refusal(request, exc, None)
    log.info("UI login by %s", auth.describe(caller))
    response = RedirectResponse(_safe_next(form.get("next")), 303)
    sessions.set_cookie(response, request, cookie)
    return response


async def logout(request: Request) -> Response:
    """End the session: delete it on the server and clear the cookie (the token itself
    stays valid)."""
    try:
        try:
            session = await current_session(request)
        except Refusal:  # a token without read: nothing to protect, just log out
            session = None
        if session is not None:
            await sessions.checked_form(request, session, cap=8192)
            await sessions.end(request, session)
            log.info("UI logout by %s", auth.describe(session.caller))
    except Exception as exc:
        return _refusal(request, exc, None)
    response = RedirectResponse("/ui/login", 303)
    sessions.clear_cookie(response, request)
    return response


async def act(request: Request) -> Response:
    """A form on the execution page: approve, reject, send a signal, cancel or retry.

    Needs a session whose token has ``operate`` and the session's CSRF token; anything
    else is refused with 403 before the form is even parsed, and nothing is written.
    """
    session: Session | None = None
    try:
        session = await current_session(request)
        if session is None:
            raise Refusal(403, "not logged in (or the session's token was revoked)")
        if not session.can("operate"):
            raise Refusal(403, "this token lacks the 'operate' scope")
        form = await sessions.checked_form(request, session)
        action = request.path_params["action"]
        if action not in ACTIONS:
            raise Refusal(404, f"unknown action {codec.printable(action, 40)!r}")
        eid = _execution_id(request.path_params["id"])
        done = await _perform(request, session, action, eid, form)
    except Exception as exc:
        return _refusal(request, exc, session)
    log.info("UI %s on an execution by %s", action, auth.describe(session.caller))
    # POST/redirect/GET: the page is read again, showing the new state; a signal's form key
    # goes along so that its notice shows what was sent.
    back = {"done": done}
    key = form.get("key")
    if action in SIGNAL_ACTIONS and key:
        back["sent"] = f"{action}:{key}"
    return RedirectResponse(f"/ui/executions/{eid}?{urlencode(back)}", 303)


async def _perform(request: Request, session: Session, action: str, eid: uuid.UUID,
                   form: Mapping[str, str]) -> str:
    client = request.app.state.client
    key = _checked(form, "key", what="form key", max_chars=64, required=False)
    form_key = f"ui:{action}:{key}" if key else None
    if action in ("approve", "reject", "signal"):
        name = _checked(form, "name", what="signal name")
        if action != "signal":
            waited = await _waited_for(request, eid, str(name))
            if waited is None:
                if form_key and await _read(request, store.signal_sent(
                        _q(request), id=eid, key=form_key)):
                    return "duplicate"
                raise Refusal(409, f"this execution is not waiting for signal "
                              f"{codec.printable(str(name), 80)!r}: nothing was sent")
            name = waited
        if action == "signal":
            payload_text = form.get("payload", "").strip() or "null"
            try:
                payload = codec.decode_exact(payload_text)
            except (ValueError, RecursionError) as exc:
                raise Refusal(400, f"payload is not JSON: {exc}") from None
        else:
            payload = {"approved": action == "approve", "by": session.caller.name,
                       "via": "web UI"}
        delivered = await client.signal(eid, name, payload, idempotency_key=form_key)
        return action if delivered else "duplicate"
    if action == "cancel":
        await client.cancel(eid)
        return action
    await client.retry(eid)
    return action


async def _waited_for(request: Request, eid: uuid.UUID, name: str) -> str | None:
    """The name of the signal *eid* waits for if the form's *name* is that name as a
    browser submits it, or None. A form sends every line break as CRLF, so a hidden field
    holding ``a\nb`` comes back as ``a\r\nb``: Approve must answer the wait it was shown,
    never signal a name nobody waits for and say it was sent.

    Raises:
        ExecutionNotFound: no such execution.
    """
    wait = await _read(request, store.get_wait(_q(request), id=eid))
    if wait is None:
        raise ExecutionNotFound(f"no execution {eid}")
    waiting = wait.get("waiting") or {}
    if waiting.get("kind") == "signal" and _as_sent(waiting["signal"]) == _as_sent(name):
        return str(waiting["signal"])
    return None


def _as_sent(text: str) -> str:
    """*text* with its line breaks as an HTML form submits them (CRLF)."""
    return text.replace("\r\n", "\n").replace("\r", "\n").replace("\n", "\r\n")


async def root(request: Request) -> Response:
    """``/`` and ``/ui``: to the executions page."""
    return RedirectResponse("/ui/", 307)


async def not_found(request: Request) -> Response:
    """Any other path under ``/ui``."""
    return error_page(request, 404, "no such page")


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
    "Refusal",
    "Session",
    "csrf_token",
    "like_pattern",
    "read_form",
    "routes",
]

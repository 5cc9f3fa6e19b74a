"""The web UI's pages (GET): executions with live counts, one execution (its alert,
timeline, events, child tree and the state its script polls), queues, schedules and the
search over history; and what every page and form does with a request first
(:func:`page`, :func:`check_query`, :func:`query_params`, :func:`checked`,
:func:`execution_id`, :func:`refusal_page`).

Every read is a statement of :mod:`kestrel.statements.http` (shared with the JSON API) or of
``sql/queries/ui.sql``, run with :func:`read`.
"""

from __future__ import annotations

import hashlib
import secrets
import uuid
from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar
from urllib.parse import urlencode

from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response

from kestrel import buckets, codec, statements
from kestrel._client_common import tag_filter
from kestrel.codec import QUEUE_NAME
from kestrel.errors import KestrelError
from kestrel.http.refusals import Refusal, classify
from kestrel.http.requests import (
    check_query,
    decode_cursor,
    encode_cursor,
    tag_params,
    time_param,
)
from kestrel.http.sessions import Session, current_session
from kestrel.http.ui.render import error_page, failure_view, render, wait_view
from kestrel.sql import Queries
from kestrel.statements import Stmt
from kestrel.types import Status

T = TypeVar("T")

PAGE = 50
FINISHED_WINDOW = timedelta(hours=24)
SEARCH_DAYS = 30
TREE_NODES = 200
TIMELINE_STEPS = 500
"""Most steps the execution page draws (a long loop of steps would make a page of megabytes)."""
TREE_DEPTH = 5
TERMINAL = tuple(s.value for s in Status if s.terminal)
SIGNAL_ACTIONS = ("approve", "reject", "signal")
NOTICES = {"approve": "Approval sent.", "reject": "Rejection sent.", "signal": "Signal sent.",
           "cancel": "Cancelled.", "retry": "Queued again from its last checkpoint.",
           "duplicate": "Already sent from this form; nothing sent twice."}


# -- what every page and form does first ---------------------------------------------------

Page = Callable[[Request, Session], Awaitable[Response]]


def page(handler: Page, *, scope: str = "read") -> Callable[[Request], Awaitable[Response]]:
    """A GET page: a request without a session is sent to the login page; one whose token
    lacks *scope* gets 403; refusals and database trouble become error pages."""

    async def endpoint(request: Request) -> Response:
        session: Session | None = None
        try:
            check_query(request)
            session = await current_session(request)
            if session is None:
                target = request.url.path + (f"?{request.url.query}" if request.url.query
                                             else "")
                return RedirectResponse(f"/ui/login?{urlencode({'next': target})}", 303)
            if not session.can(scope):
                raise Refusal(403, f"this token lacks the {scope!r} scope")
            return await handler(request, session)
        except Exception as exc:
            return refusal_page(request, exc, session)

    endpoint.__doc__ = handler.__doc__
    return endpoint


def refusal_page(request: Request, exc: Exception, session: Session | None) -> Response:
    """What a page or form answers for *exc*: the refusal's one-line reason as an error
    page (:func:`~kestrel.http.refusals.classify`)."""
    refusal = classify(exc, request, internal="internal error; the server log names it")
    return error_page(request, refusal.status, refusal.reason, session)


def operator(session: Session | None) -> Session:
    """*session* if its token may act (``operate``): a form that changes something is
    refused with 403 otherwise, before it is even parsed, and nothing is written."""
    if session is None:
        raise Refusal(403, "not logged in (or the session's token was revoked)")
    if not session.can("operate"):
        raise Refusal(403, "this token lacks the 'operate' scope")
    return session


def query_params(request: Request, allowed: tuple[str, ...]) -> dict[str, str]:
    """The query's parameters, each of *allowed* at most once, the empty ones left out
    (400 for any other parameter or one given twice)."""
    params = request.query_params
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise Refusal(400, f"unknown query parameter(s): {', '.join(map(ascii, unknown))}")
    if len(params.multi_items()) != len(params):
        raise Refusal(400, "a query parameter is given twice")
    return {k: v for k, v in params.items() if v != ""}


def checked(form: Mapping[str, str], name: str, *, what: str, max_chars: int = 1024,
            required: bool = True) -> str | None:
    """The text of *form*'s field *name* (called *what* in a refusal), checked as every
    door checks text (400 otherwise); None when it is empty and not *required*."""
    value = form.get(name)
    if value is None or value == "":
        if required:
            raise Refusal(400, f"{what} is required")
        return None
    try:
        return codec.check_text(value, what=what, max_chars=max_chars)
    except KestrelError as exc:
        raise Refusal(400, str(exc)) from None


def execution_id(text: str) -> uuid.UUID:
    """*text* (a path's ``{id}``) as an execution id (400 for anything but a UUID)."""
    try:
        if len(text) > 64:
            raise ValueError
        return uuid.UUID(text)
    except ValueError:
        raise Refusal(400, f"{codec.printable(text, 60)!r} is not an execution id (a UUID)"
                      ) from None


async def read(request: Request, stmt: Stmt[Any]) -> Any:
    """Run *stmt*, a read, with the door's client, in the schema served (a namespace's
    bucket 0)."""
    return await request.app.state.client.read(stmt)


async def read_of(request: Request, eid: uuid.UUID, make: Callable[[Queries], Stmt[T]]) -> T:
    """Run the read *make(q)* in the schema holding execution *eid* (its bucket's)."""
    found: T = await request.app.state.client.read_of(eid, make)
    return found


def queries_of(request: Request) -> Queries:
    """The statements of the schema this server serves."""
    q: Queries = request.app.state.q
    return q




def _status(params: Mapping[str, str], allowed: tuple[str, ...]) -> str | None:
    status = params.get("status")
    if status is not None and status not in allowed:
        raise Refusal(400, f"status must be one of {', '.join(allowed)}")
    return status


# -- the pages -------------------------------------------------------------------------------


async def counts(request: Request) -> dict[str, Any]:
    """Live executions by status and those finished in the last 24 hours by status."""
    parts = await request.app.state.client.read_each(
        lambda q: statements.ui.ui_counts(q, finished_window=FINISHED_WINDOW))
    live = {s.value: 0 for s in Status if not s.terminal}
    finished = dict.fromkeys(TERMINAL, 0)
    for status, n, is_live in (row for part in parts for row in part):
        (live if is_live else finished)[status] += int(n)
    return {"live": live, "finished_24h": finished}


async def _waits(request: Request, ids: list[uuid.UUID]) -> dict[str, dict[str, Any]]:
    """What each waiting execution of *ids* waits for and since when, by id."""
    rows = await request.app.state.client.read_by_bucket(
        ids, lambda q, group: statements.ui.ui_waits(q, ids=group))
    return {eid: wait_view(row) for eid, row in rows.items()}


async def executions(request: Request, session: Session) -> Response:
    """Executions newest first, filtered by status, workflow, queue, creation time and a tag
    (``tag=NAME:VALUE``)."""
    params = query_params(request, ("status", "workflow", "queue", "since", "until", "tag",
                                    "cursor"))
    status = _status(params, tuple(s.value for s in Status))
    workflow = params.get("workflow")
    if workflow is not None:
        checked(params, "workflow", what="workflow")
    queue = params.get("queue")
    if queue is not None and not QUEUE_NAME.fullmatch(queue):
        raise Refusal(400, "queue names are 1-128 of A-Z a-z 0-9 _ . : -")
    cursor = params.get("cursor")
    after = decode_cursor(cursor) if cursor else None
    since, until = time_param(params, "since"), time_param(params, "until")
    tags = tag_filter(tag_params([params["tag"]] if "tag" in params else []))
    rows = buckets.merge_pages(await request.app.state.client.read_each(
        lambda q: statements.http.page_executions(
            q, status=status, workflow=workflow, queue=queue, since=since, until=until,
            after=after, limit=PAGE + 1, tags=tags)), PAGE + 1)
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
    query_params(request, ())
    return JSONResponse(await counts(request), headers={"Cache-Control": "no-store"})


async def _tree(request: Request, root: uuid.UUID) -> list[dict[str, Any]]:
    """The child tree below *root*, depth-first, each node with its depth (bounded)."""
    found: list[dict[str, Any]] = []

    async def walk(eid: uuid.UUID, depth: int) -> None:
        if depth > TREE_DEPTH or len(found) >= TREE_NODES:
            return
        for child in await read_of(request, eid, lambda q: statements.http.list_children(
                q, id=eid)):
            if len(found) >= TREE_NODES:
                return
            found.append({**child, "depth": depth})
            await walk(uuid.UUID(child["id"]), depth + 1)

    await walk(root, 0)
    return found


async def execution(request: Request, session: Session) -> Response:
    """One execution: its state, wait, step timeline, events, signals and child tree."""
    params = query_params(request, ("done", "sent"))
    eid = execution_id(request.path_params["id"])
    client = request.app.state.client
    ex = await client.get(eid)
    notice = await _notice(request, eid, params, ex)
    steps = await client.steps(eid)
    wait = await read_of(request, eid, lambda q: statements.http.get_wait(q, id=eid)) or {}
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
        events=await read_of(request, eid, lambda q: statements.http.list_events(q, id=eid)),
        signals=await read_of(request, eid,
                              lambda q: statements.http.pending_signals(q, id=eid)),
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


async def _notice(request: Request, eid: uuid.UUID, params: Mapping[str, str], ex: Any,
                  ) -> dict[str, Any] | None:
    """The notice after a form's redirect (``?done=ACTION``), only where the database bears it
    out, never because a link says so (issue 41 row 9: ``?done=approve`` said "Approval
    sent." when nothing was). A signal's (``&sent=ACTION:KEY``, the form's idempotency key)
    is read back: the notice shows what arrived, name and payload, or nothing when no signal
    was sent under that key; a retry's likewise (``&sent=retry:KEY``: the key the retry
    recorded). A cancel's shows once the execution is cancelled."""
    done = params.get("done")
    if done not in NOTICES:
        return None
    sent = checked(params, "sent", what="sent", max_chars=80, required=False)
    if done in (*SIGNAL_ACTIONS, "duplicate"):
        if not sent or sent.partition(":")[0] not in SIGNAL_ACTIONS:
            return None
        signal = await read_of(request, eid, lambda q: statements.ui.ui_sent_signal(
            q, id=eid, key=f"ui:{sent}"))
        return {"text": NOTICES[done], "signal": signal} if signal else None
    status = ex.status.value
    if done == "cancel" and status != "cancelled":
        return None
    if done == "retry" and not (sent and sent.startswith("retry:") and await _retried(
            request, eid, sent)):
        return None
    return {"text": NOTICES[done], "signal": None}


async def _retried(request: Request, eid: uuid.UUID, sent: str) -> bool:
    """Whether the form's retry (``retry:KEY``) was recorded for *eid*."""
    return bool(await read_of(request, eid, lambda q: statements.ui.ui_retried(
        q, id=eid, key=f"ui:{sent}")))


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
    query_params(request, ())
    eid = execution_id(request.path_params["id"])
    ex = await request.app.state.client.get(eid)
    waits = await _waits(request, [eid]) if ex.status.value == "waiting" else {}
    state = None if ex.status.terminal else _state(ex, waits.get(str(eid)))
    return JSONResponse({"state": state, "status": ex.status.value},
                        headers={"Cache-Control": "no-store"})


async def queues(request: Request, session: Session) -> Response:
    """Each queue: live depth by status, its oldest queued age and its limits; the live
    workers (what they claim, their app version) and the work none of them can claim."""
    query_params(request, ())
    stats = await request.app.state.client.stats()
    limits = await read(request, statements.http.list_queue_limits(queries_of(request)))
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
    query_params(request, ())
    rows = await read(request, statements.http.list_schedules(queries_of(request)))
    return render(request, "schedules.html", session=session, schedules=rows)


def like_pattern(text: str) -> str:
    r"""An ILIKE pattern matching *text* anywhere, its ``%``, ``_`` and ``\`` escaped."""
    escaped = text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


async def search(request: Request, session: Session) -> Response:
    """Finished executions whose workflow, error, arguments or key contain the text; an
    execution id goes straight to its page."""
    params = query_params(request, ("q", "status", "since", "until"))
    text = checked(params, "q", what="search text", max_chars=200, required=False) or ""
    text = text.strip()
    try:
        return RedirectResponse(f"/ui/executions/{uuid.UUID(text)}", 303)
    except ValueError:
        pass
    status = _status(params, TERMINAL)
    now = datetime.now(UTC)
    since = time_param(params, "since") or now - timedelta(days=SEARCH_DAYS)
    until = time_param(params, "until") or now + timedelta(days=1)
    rows = buckets.merge_finished(await request.app.state.client.read_each(
        lambda q: statements.ui.search_history(
            q, since=since, until=until, status=status, pattern=like_pattern(text),
            limit=PAGE)), PAGE)
    return render(request, "search.html", session=session, q=text, filters=params,
                  since=since, until=until, rows=rows, limit=PAGE)


async def root(request: Request) -> Response:
    """``/`` and ``/ui``: to the executions page."""
    return RedirectResponse("/ui/", 307)


async def not_found(request: Request) -> Response:
    """Any other path under ``/ui``."""
    return error_page(request, 404, "no such page")


__all__ = [
    "PAGE",
    "SIGNAL_ACTIONS",
    "TIMELINE_STEPS",
    "check_query",
    "checked",
    "execution_id",
    "like_pattern",
    "page",
    "queries_of",
    "query_params",
    "read",
    "read_of",
    "refusal_page",
]

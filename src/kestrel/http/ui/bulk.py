"""The executions list's select-all actions (issue 42, item 4): cancel, retry or signal every
execution the list's filters match, as ``kestrel-runtime cancel --status …`` does.

``GET /ui/bulk/{action}?<the list's filters>`` shows how many match now and a sample, with a
form to confirm (an ``operate`` token; the session's CSRF token). Its ``POST`` acts on up to
:data:`PAGES_PER_PRESS` pages (:meth:`kestrel.Client.bulk`) and shows what it did; when more
remain, a form goes on from where it stopped under the same key, so nothing is acted on
twice, however often a form is sent.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from kestrel import codec
from kestrel.codec import QUEUE_NAME
from kestrel.http import auth, sessions
from kestrel.http.refusals import Refusal
from kestrel.http.requests import decode_cursor, encode_cursor, tag_params, time_param
from kestrel.http.sessions import Session, current_session
from kestrel.http.ui.pages import checked, operator, query_params, refusal_page
from kestrel.http.ui.render import render
from kestrel.types import BulkResult, Match, Status

log = logging.getLogger("kestrel.http.ui")

ACTIONS = ("cancel", "retry", "signal")
FILTERS = ("status", "workflow", "queue", "since", "until", "tag")
PAGES_PER_PRESS = 10
"""Pages of 200 one press of the form acts on (2,000 executions): a request stays seconds
long; the page then offers to go on."""


def _action(request: Request) -> str:
    action = str(request.path_params["action"])
    if action not in ACTIONS:
        raise Refusal(404, f"unknown bulk action {codec.printable(action, 40)!r}")
    return action


def _match(params: Mapping[str, str]) -> Match:
    """The list's filters as a bulk action's (400 for a bad one, or for none at all)."""
    status = params.get("status")
    if status is not None and status not in {s.value for s in Status}:
        raise Refusal(400, f"status must be one of {', '.join(s.value for s in Status)}")
    workflow = checked(params, "workflow", what="workflow", required=False)
    queue = params.get("queue")
    if queue is not None and not QUEUE_NAME.fullmatch(queue):
        raise Refusal(400, "queue names are 1-128 of A-Z a-z 0-9 _ . : -")
    match = Match(status=status, workflow=workflow, queue=queue,
                  since=time_param(params, "since"), until=time_param(params, "until"),
                  tags=tag_params([params["tag"]] if params.get("tag") else []))
    if not match.given():
        raise Refusal(400, "filter the list first (status, workflow, queue, time or tag): an "
                           "action on every execution is not offered")
    return match


async def confirm(request: Request, session: Session) -> Response:
    """How many executions the filters match now, a sample, and the form that acts."""
    action = _action(request)
    params = query_params(request, FILTERS)
    match = _match(params)
    counted: BulkResult = await request.app.state.client.bulk(action, match, dry_run=True)
    return render(request, "bulk.html", session=session, action=action, filters=params,
                  counted=counted, done=None, form_key=secrets.token_hex(16), cursor=None,
                  signal_name=None, signal_payload=None)


async def act(request: Request) -> Response:
    """The confirmed form: act on up to :data:`PAGES_PER_PRESS` pages; show what was done
    and, when more remain, the form that goes on under the same key."""
    session: Session | None = None
    try:
        session = operator(await current_session(request))
        form = await sessions.checked_form(request, session)
        action = _action(request)
        filters = {k: form[k] for k in FILTERS if form.get(k)}
        match = _match(filters)
        key = checked(form, "key", what="form key", max_chars=64)
        cursor = form.get("cursor") or None
        name, payload = _signal(action, form)
        done: BulkResult = await request.app.state.client.bulk(
            action, match, signal=name, payload=payload,
            key=f"ui:{session.caller.token_id}:{key}",
            after=decode_cursor(cursor) if cursor else None, pages=PAGES_PER_PRESS)
    except Exception as exc:
        return refusal_page(request, exc, session)
    log.info("UI bulk %s of %d (%d acted) by %s", action, done.matched, done.acted,
             auth.describe(session.caller))
    return render(request, "bulk.html", session=session, action=action, filters=filters,
                  counted=None, done=done, form_key=key, signal_name=name,
                  signal_payload=form.get("payload", ""),
                  cursor=None if done.cursor is None
                  else encode_cursor(done.cursor[0], str(done.cursor[1])))


def _signal(action: str, form: Mapping[str, str]) -> tuple[str | None, Any]:
    if action != "signal":
        return None, None
    name = checked(form, "name", what="signal name")
    text = form.get("payload", "").strip() or "null"
    try:
        return name, codec.decode_exact(text)
    except (ValueError, RecursionError) as exc:
        raise Refusal(400, f"payload is not JSON: {exc}") from None

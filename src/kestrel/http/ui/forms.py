"""The web UI's forms (POST) and its login page: approve, reject, send a signal, cancel
or retry an execution (:func:`act`), log in with a token and log out. Each form's checks
(a live session, its scope, same origin, the session's CSRF token) come before the form is
read, and nothing is written when one fails; the session itself is
:mod:`kestrel.http.sessions`'. Every change goes through the kestrel client, so the same
SQL functions and rules as at every other door.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from urllib.parse import urlencode

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from kestrel import codec, statements
from kestrel.errors import ExecutionNotFound
from kestrel.http import auth, sessions
from kestrel.http.refusals import Refusal
from kestrel.http.requests import read_form
from kestrel.http.sessions import Session, current_session
from kestrel.http.ui.pages import (
    SIGNAL_ACTIONS,
    check_query,
    checked,
    execution_id,
    operator,
    query_params,
    read_of,
    refusal_page,
)
from kestrel.http.ui.render import error_page, render

log = logging.getLogger("kestrel.http.ui")

ACTIONS = ("approve", "reject", "signal", "cancel", "retry")


def _safe_next(target: str | None) -> str:
    """Where to go after logging in: a path of this UI only (no open redirect)."""
    if (target and target.startswith("/ui") and not target.startswith("//")
            and "\\" not in target and all(31 < ord(c) < 127 for c in target)):
        return target
    return "/ui/"


async def login_page(request: Request) -> Response:
    """The login form: paste a token."""
    try:
        check_query(request)
        params = query_params(request, ("next",))
    except Refusal as exc:
        return error_page(request, exc.status, exc.reason)
    return render(request, "login.html", next=_safe_next(params.get("next")))


async def login(request: Request) -> Response:
    """Check the pasted token like a bearer token; set the session cookie."""
    try:
        if not sessions.same_origin(request):
            raise Refusal(403, "cross-site login refused")
        form = await read_form(request, cap=8192)
        token = (checked(form, "token", what="token", max_chars=200) or "").strip()
        caller, cookie = await sessions.start(request, token)
    except Exception as exc:
        return refusal_page(request, exc, None)
    log.info("UI login by %s", auth.describe(caller))
    response = RedirectResponse(_safe_next(form.get("next")), 303)
    sessions.set_cookie(response, request, cookie)
    return response


async def logout(request: Request) -> Response:
    """End the session: delete it on the server and clear the cookie (the token itself
    stays valid). With ``everywhere=1`` (the "Log out everywhere" button), every session of
    the token ends, in every browser."""
    try:
        try:
            session = await current_session(request)
        except Refusal:  # a token without read: nothing to protect, just log out
            session = None
        if session is not None:
            form = await sessions.checked_form(request, session, cap=8192)
            everywhere = form.get("everywhere") == "1"
            await sessions.end(request, session, everywhere=everywhere)
            log.info("UI logout%s by %s", " everywhere" if everywhere else "",
                     auth.describe(session.caller))
    except Exception as exc:
        return refusal_page(request, exc, None)
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
        session = operator(await current_session(request))
        form = await sessions.checked_form(request, session)
        action = request.path_params["action"]
        if action not in ACTIONS:
            raise Refusal(404, f"unknown action {codec.printable(action, 40)!r}")
        eid = execution_id(request.path_params["id"])
        done = await _perform(request, session, action, eid, form)
    except Exception as exc:
        return refusal_page(request, exc, session)
    log.info("UI %s on an execution by %s", action, auth.describe(session.caller))
    # POST/redirect/GET: the page is read again, showing the new state; a signal's form key
    # goes along so that its notice shows what was sent.
    back = {"done": done}
    key = form.get("key")
    if (action in SIGNAL_ACTIONS or action == "retry") and key:
        back["sent"] = f"{action}:{key}"
    return RedirectResponse(f"/ui/executions/{eid}?{urlencode(back)}", 303)


async def _perform(request: Request, session: Session, action: str, eid: uuid.UUID,
                   form: Mapping[str, str]) -> str:
    client = request.app.state.client
    key = checked(form, "key", what="form key", max_chars=64, required=False)
    form_key = f"ui:{action}:{key}" if key else None
    if action in ("approve", "reject", "signal"):
        name = checked(form, "name", what="signal name")
        if action != "signal":
            waited = await _waited_for(request, eid, str(name))
            if waited is None:
                if form_key:
                    key_used = form_key
                    sent: bool = await read_of(request, eid, lambda q: statements.http.signal_sent(
                        q, id=eid, key=key_used))
                    if sent:
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
    await client.retry(eid, idempotency_key=form_key)  # sent twice, retried once
    return action


async def _waited_for(request: Request, eid: uuid.UUID, name: str) -> str | None:
    """The name of the signal *eid* waits for if the form's *name* is that name as a
    browser submits it, or None. A form sends every line break as CRLF, so a hidden field
    holding ``a\nb`` comes back as ``a\r\nb``: Approve must answer the wait it was shown,
    never signal a name nobody waits for and say it was sent.

    Raises:
        ExecutionNotFound: no such execution.
    """
    wait = await read_of(request, eid, lambda q: statements.http.get_wait(q, id=eid))
    if wait is None:
        raise ExecutionNotFound(f"no execution {eid}")
    waiting = wait.get("waiting") or {}
    if waiting.get("kind") == "signal" and _as_sent(waiting["signal"]) == _as_sent(name):
        return str(waiting["signal"])
    return None


def _as_sent(text: str) -> str:
    """*text* with its line breaks as an HTML form submits them (CRLF)."""
    return text.replace("\r\n", "\n").replace("\r", "\n").replace("\n", "\r\n")


__all__ = ["ACTIONS", "act", "login", "login_page", "logout"]

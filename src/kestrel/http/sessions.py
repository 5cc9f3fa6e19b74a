"""The web UI's sessions: who is logged in, the session cookie and the CSRF token of its forms.

The login page takes an API token (``kestrel-runtime token create``); the server checks it
exactly as the API checks a bearer token (:func:`kestrel.http.auth.check_token`) and starts a
session (:func:`start`): a row in ``ui_sessions`` holding the SHA-256 of a fresh random
secret, the token's id and an expiry (:data:`SESSION_TTL_S`). The cookie (``HttpOnly;
SameSite=Strict``, ``Secure`` over TLS) holds that secret, never the token, so it is no
bearer token on the API. Every request looks the session up with its token
(:func:`current_session`), so a logout (which deletes the row), the expiry or revoking the
token ends it at once, whatever the browser keeps. Each form carries a CSRF token
(:func:`csrf_token`): an HMAC keyed with the session's secret, so each session has its own,
which only the cookie's holder knows and the server never stores; it is compared in
constant time, and a POST whose ``Origin`` is another site is refused too
(:func:`checked_form`).

The pages and forms that use these are :mod:`kestrel.http.ui`'s; this module imports neither
door (``tests/unit/test_layering.py``).
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response

from kestrel import statements
from kestrel.http import auth
from kestrel.http.refusals import Refusal
from kestrel.http.requests import MAX_FORM_BYTES, read_form

COOKIE = "kestrel_session"
SESSION_TTL_S = 12 * 3600
"""How long a UI session lasts from its login (the cookie's max-age too)."""


@dataclass(frozen=True, slots=True)
class Session:
    """A logged-in operator: the token's caller, the CSRF token of this session and the hash
    that finds its row (for logout)."""

    caller: auth.Caller
    csrf: str
    secret_hash: bytes = b""

    def can(self, scope: str) -> bool:
        """Whether the session's token holds *scope*."""
        return scope in self.caller.scopes


def csrf_token(cookie: str) -> str:
    """The CSRF token of the session whose cookie is *cookie*: an HMAC keyed with its
    secret, so a new session (each login) has a new one."""
    return hmac.new(cookie.encode(), b"kestrel-ui-csrf-v1", hashlib.sha256).hexdigest()


async def current_session(request: Request) -> Session | None:
    """The session of *request*'s cookie if it is live (logged in, not expired, its token
    not revoked), else None.

    Raises:
        Refusal: 403 when the session's token lacks ``read``.
    """
    cookie = request.cookies.get(COOKIE)
    secret_hash = auth.session_hash(cookie)
    if cookie is None or secret_hash is None:
        return None
    state = request.app.state
    row = await state.client.read(statements.http.get_session(state.q, secret_hash=secret_hash))
    if row is None:
        return None
    caller = auth.Caller(token_id=row[0], name=row[1], scopes=frozenset(row[2]))
    if "read" not in caller.scopes:
        raise Refusal(403, "this token lacks the 'read' scope")
    return Session(caller, csrf_token(cookie), secret_hash)


def same_origin(request: Request) -> bool:
    """Whether a POST comes from this site: its ``Origin`` is this server's, or it has none
    (not a browser's cross-site POST; the CSRF token still guards it)."""
    origin = request.headers.get("origin")
    if origin is None:
        return True
    return origin == f"{request.url.scheme}://{request.headers.get('host', '')}"


async def checked_form(request: Request, session: Session,
                       cap: int = MAX_FORM_BYTES) -> dict[str, str]:
    """The form of a POST made from one of *session*'s pages.

    Raises:
        Refusal: 403 from another site or without the session's CSRF token; the refusals
            of :func:`~kestrel.http.requests.read_form`.
    """
    if not same_origin(request):
        raise Refusal(403, "cross-site form refused")
    form = await read_form(request, cap)
    if not hmac.compare_digest(form.get("csrf", "").encode(), session.csrf.encode()):
        raise Refusal(403, "the form's CSRF token does not match this session")
    return form


async def start(request: Request, token: str) -> tuple[auth.Caller, str]:
    """Start a session for *token* (checked as a bearer token with ``read``): its caller
    and the cookie's value, the session's secret.

    Raises:
        Refusal: 401 for a token that is not live, 403 for one without ``read``.
    """
    state = request.app.state
    caller = await auth.check_token(state, token, "read")
    cookie, secret_hash = auth.new_session()
    started = await state.client.read_script(statements.http.create_session(
        state.q, secret_hash=secret_hash, token_id=caller.token_id, ttl_s=SESSION_TTL_S))
    if started is None:  # revoked between the check and the insert
        raise Refusal(401, "invalid or revoked token")
    return caller, cookie


async def end(request: Request, session: Session, *, everywhere: bool = False) -> None:
    """End *session* on the server: its row is deleted, its cookie opens nothing more. With
    *everywhere*, every session of its token, in any browser (the token stays valid)."""
    state = request.app.state
    if everywhere:
        await state.client.read(statements.http.end_token_sessions(
            state.q, token_id=session.caller.token_id))
    else:
        await state.client.read(statements.http.end_session(
            state.q, secret_hash=session.secret_hash))


def set_cookie(response: Response, request: Request, cookie: str) -> None:
    """Give the browser the session's *cookie* with *response*."""
    response.set_cookie(COOKIE, cookie, max_age=SESSION_TTL_S, path="/ui", httponly=True,
                        samesite="strict", secure=request.url.scheme == "https")


def clear_cookie(response: Response, request: Request) -> None:
    """Tell the browser, with *response*, to forget the session's cookie."""
    response.delete_cookie(COOKIE, path="/ui", httponly=True, samesite="strict",
                           secure=request.url.scheme == "https")


__all__ = [
    "COOKIE",
    "SESSION_TTL_S",
    "Session",
    "checked_form",
    "clear_cookie",
    "csrf_token",
    "current_session",
    "end",
    "same_origin",
    "set_cookie",
    "start",
]

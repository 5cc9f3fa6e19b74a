"""Bearer tokens with scopes for the HTTP API.

A token reads ``kst_<id>_<secret>``: *id* (16 hex digits) is public and finds the row;
*secret* (43 URL-safe characters, 256 random bits) is never stored, only its SHA-256, which
the server compares with :func:`hmac.compare_digest`. A plain hash is enough for a secret of
256 random bits (nothing to brute-force, unlike a password), and it costs the server
microseconds per request instead of a password hash's tens of milliseconds.

Scopes: ``read`` (every GET), ``operate`` (signal, cancel, retry, fork), ``submit`` (start
executions). Every request but the health check and the OpenAPI document needs a token, also
from loopback: a process on the same host is not trusted for being there.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from typing import Any

from kestrel import codec, statements
from kestrel.errors import ConfigError
from kestrel.http.refusals import Refusal

SCOPES = ("read", "operate", "submit")
TOKEN = re.compile(r"kst_([0-9a-f]{16})_([A-Za-z0-9_-]{43})")
TOKEN_ID = re.compile(r"[0-9a-f]{16}")
SESSION = re.compile(r"kss_([A-Za-z0-9_-]{43})")
"""A web UI session cookie: ``kss_<secret>`` (256 random bits), never a token: the API does
not take it, and the server keeps only its SHA-256 (``ui_sessions``)."""
_DUMMY_HASH = hashlib.sha256(b"no such token").digest()


@dataclass(frozen=True, slots=True)
class NewToken:
    """A token as made by :func:`new_token`: the text to hand out once, and what is stored."""

    id: str
    text: str
    secret_hash: bytes


@dataclass(frozen=True, slots=True)
class Caller:
    """Who made a request: the token's name and scopes (never the token itself)."""

    token_id: str
    name: str
    scopes: frozenset[str]


def new_token() -> NewToken:
    """Return a fresh random token."""
    token_id = secrets.token_hex(8)
    secret = secrets.token_urlsafe(32)
    return NewToken(token_id, f"kst_{token_id}_{secret}", _hash(secret))


def _hash(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


def parse_scopes(text: str) -> tuple[str, ...]:
    """Return the scopes in the comma-separated *text*, each once, in canonical order.

    Raises:
        ConfigError: one is unknown, or there are none.
    """
    given = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in given if s not in SCOPES]
    if unknown or not given:
        raise ConfigError(f"scopes must be a comma-separated subset of {','.join(SCOPES)}, "
                          f"got {codec.printable(text, 80)!r}")
    return tuple(s for s in SCOPES if s in given)


def check_name(name: str) -> str:
    """Return *name* if it can name a token (1-128 printable characters).

    Raises:
        ConfigError: it cannot.
    """
    if not re.fullmatch(r"[A-Za-z0-9_.:@-]{1,128}", name):
        raise ConfigError(f"token name {codec.printable(name, 80)!r}: use 1-128 of "
                          "A-Z a-z 0-9 _ . : @ -")
    if TOKEN_ID.fullmatch(name):
        raise ConfigError(f"token name {name!r} looks like a token id (16 hex digits), "
                          "which `token revoke` would take for one; choose another")
    return name


def new_session() -> tuple[str, bytes]:
    """A fresh UI session: the cookie value (``kss_…``) and the hash the server stores."""
    secret = secrets.token_urlsafe(32)
    return f"kss_{secret}", _hash(secret)


def session_hash(cookie: str | None) -> bytes | None:
    """The stored hash of a session cookie, or None when *cookie* is not one."""
    match = SESSION.fullmatch(cookie or "")
    return _hash(match.group(1)) if match else None


def split(header: str | None) -> tuple[str, str] | None:
    """Return (id, secret) from an ``Authorization: Bearer kst_…`` header, or None when it
    is absent or not a kestrel token."""
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer":
        return None
    match = TOKEN.fullmatch(value.strip())
    return (match.group(1), match.group(2)) if match else None


def verify(secret: str, row: tuple[str, list[str], bytes] | None, token_id: str) -> Caller | None:
    """Return the caller if *secret* matches the stored *row* (None: no live token).

    The comparison takes the same time whether the id exists or not, and whatever the
    secret: an unknown id is compared against a dummy hash.
    """
    stored = row[2] if row is not None else _DUMMY_HASH
    ok = hmac.compare_digest(_hash(secret), stored)
    if row is None or not ok:
        return None
    return Caller(token_id=token_id, name=row[0], scopes=frozenset(row[1]))


def describe(caller: Any) -> str:
    """The caller as it may appear in a log line: the token's name and public id only."""
    if isinstance(caller, Caller):
        return f"token {caller.name} ({caller.token_id})"
    return "anonymous"


async def check_token(state: Any, token: str, scope: str) -> Caller:
    """The caller holding *token* (``kst_…``, from the API's bearer header or the UI's
    session) if it is live and has *scope*; *state* is the app's (``client``, ``q``).

    Raises:
        Refusal: 401 for a malformed, unknown or revoked token, 403 for a missing scope.
    """
    parts = split(f"Bearer {token}")
    if parts is None:
        raise Refusal(401, "malformed token (kst_…)")
    row = await state.client.read(statements.http.get_token(state.q, id=parts[0]))
    caller = verify(parts[1], row, parts[0])
    if caller is None:
        raise Refusal(401, "invalid or revoked token")
    if scope not in caller.scopes:
        raise Refusal(403, f"this token lacks the {scope!r} scope")
    return caller

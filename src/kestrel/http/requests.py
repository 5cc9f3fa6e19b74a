"""Request parts both doors read the same way: query strings (strict UTF-8, capped),
bodies under a cap (announced or streamed), exact JSON, the web UI's forms, the list's
opaque cursors, ISO times and the W3C trace context. Each refuses with a
:class:`~kestrel.http.refusals.Refusal` (400, 413 or 414) before anything is written.
"""

from __future__ import annotations

import base64
import binascii
import re
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qsl

from starlette.requests import Request

from kestrel import codec, tracing
from kestrel.http.refusals import Refusal

# ASCII digits, few enough for int(): str.isdigit() also takes "²" and "①", which int()
# refuses, and int() refuses more than 4300 digits (both were a 500).
DIGITS = re.compile(r"[0-9]{1,18}")
MAX_QUERY_BYTES = 4096


def check_query(request: Request) -> None:
    """Refuse a query string over :data:`MAX_QUERY_BYTES` (414), or one holding NUL or
    bytes that are not UTF-8 (400: :func:`check_query_text`)."""
    raw = request.scope.get("query_string", b"")
    if len(raw) > MAX_QUERY_BYTES:
        raise Refusal(414, f"query string over {MAX_QUERY_BYTES} bytes")
    check_query_text(request)


def check_query_text(request: Request) -> None:
    """Refuse a query string holding NUL or bytes that are not UTF-8 (400): Starlette
    decodes such bytes to U+FFFD, which would otherwise be read as a name."""
    for name, value in request.query_params.multi_items():
        for text in (name, value):
            if "\x00" in text or "\ufffd" in text:
                raise Refusal(400, "a query parameter holds NUL or bytes that are not UTF-8")


async def read_capped(request: Request, cap: int,
                      budget: BodyBudget | None = None) -> bytes | None:
    """The raw body, or None once it passes *cap* bytes, announced or streamed: a client
    that lies about Content-Length is cut off at the cap too, and nothing past it is read.
    With *budget*, each chunk is taken from it as it arrives (given back by the caller,
    :meth:`BodyBudget.holding`).

    Raises:
        Refusal: 503 with Retry-After when *budget* has no room left for a chunk.
    """
    announced = request.headers.get("content-length")
    if announced is not None and (not DIGITS.fullmatch(announced) or int(announced) > cap):
        return None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > cap:
            return None
        if budget is not None:
            budget.take(len(chunk))
        chunks.append(chunk)
    return b"".join(chunks)


class BodyBudget:
    """The bytes of request bodies one HTTP process holds before they are verified (webhook
    bodies: a signature covers the whole body, so it is read first), across connections.
    One event loop takes and gives: no lock. Use :meth:`holding` around a request's read and
    handling; :func:`read_capped` takes as chunks arrive."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._mine: ContextVar[list[int] | None] = ContextVar("kestrel_body_budget",
                                                              default=None)

    def take(self, n: int) -> None:
        """Hold *n* more bytes for the current request.

        Raises:
            Refusal: 503 with Retry-After when they do not fit (the door's whole budget,
                not this request's cap: try again shortly).
        """
        mine = self._mine.get()
        if self.held + n > self.limit:
            from kestrel import metrics

            metrics.get().http_refused.labels("hook_body_budget").inc()
            raise Refusal(503, "the server holds as many unverified webhook bodies as it may "
                               "(--http-hook-body-budget-bytes); try again",
                          {"Retry-After": "1"})
        self.held += n
        if mine is not None:
            mine[0] += n

    @asynccontextmanager
    async def holding(self) -> AsyncIterator[None]:
        """What the request takes inside the block is given back when it ends."""
        mine = [0]
        token = self._mine.set(mine)
        try:
            yield
        finally:
            self._mine.reset(token)
            self.held -= mine[0]


async def read_body(request: Request) -> bytes:
    """The raw body, refused with 413 once it passes ``http_max_body_bytes``."""
    cap: int = request.app.state.cfg.http_max_body_bytes
    body = await read_capped(request, cap)
    if body is None:
        raise Refusal(413, f"request body over the cap of {cap} bytes")
    return body


def parse_json(body: bytes) -> Any:
    """Parse a request body as JSON exactly (no silent rounding of huge integers).

    Raises:
        Refusal: 400 for text that is not UTF-8 or not JSON (lone surrogate escapes,
            nesting past 1024 levels and numbers beyond a double included).
    """
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise Refusal(400, "request body is not UTF-8") from None
    try:
        return codec.decode_exact(text)
    except (ValueError, RecursionError) as exc:
        raise Refusal(400, f"malformed JSON body: {exc}") from None


async def read_json(request: Request, *, default: Any = None) -> Any:
    """The body as JSON; *default* when it is empty."""
    body = await read_body(request)
    if not body.strip():
        return default
    return parse_json(body)


MAX_FORM_BYTES = 256 * 1024
"""The most bytes of a web UI form (:func:`read_form`)."""


async def read_form(request: Request, cap: int = MAX_FORM_BYTES) -> dict[str, str]:
    """The urlencoded form of a POST, each field once, as strictly checked UTF-8 text.

    Raises:
        Refusal: 413 over *cap*; 400 not a urlencoded form, not UTF-8, a field twice.
    """
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/x-www-form-urlencoded":
        raise Refusal(400, "expected a form (application/x-www-form-urlencoded)")
    body = await read_capped(request, cap)
    if body is None:
        raise Refusal(413, f"form over the cap of {cap} bytes")
    try:
        pairs = parse_qsl(body.decode("utf-8"), keep_blank_values=True,
                          strict_parsing=False, encoding="utf-8", errors="strict",
                          max_num_fields=50)
    except (UnicodeDecodeError, ValueError):
        raise Refusal(400, "the form is not UTF-8 text (or has too many fields)") from None
    form: dict[str, str] = {}
    for name, value in pairs:
        if name in form:
            raise Refusal(400, f"field {codec.printable(name, 40)!r} given twice")
        form[name] = value
    return form


_CURSOR = re.compile(r"[A-Za-z0-9_-]{1,200}")


def encode_cursor(created_at: datetime, eid: str) -> str:
    """The opaque cursor after a row: its exact creation time and id, base64url."""
    raw = f"{created_at.isoformat()}|{eid}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(text: str) -> tuple[datetime, uuid.UUID]:
    """Read a cursor made by :func:`encode_cursor` (400 for anything else)."""
    try:
        if not _CURSOR.fullmatch(text):
            raise ValueError
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)).decode()
        at, _, eid = raw.partition("|")
        when = datetime.fromisoformat(at)
        if when.tzinfo is None:
            raise ValueError
        return when, uuid.UUID(eid)
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise Refusal(400, "cursor is not one this API returned") from None


def time_param(params: Mapping[str, str], name: str) -> datetime | None:
    """The query parameter *name* as an ISO 8601 time (one without a zone is UTC), or None
    when it is absent.

    Raises:
        Refusal: 400, it is not an ISO 8601 time.
    """
    text = params.get(name)
    if text is None:
        return None
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise Refusal(400, f"{name} must be an ISO 8601 time like 2026-01-31T09:30") from None
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def trace_context(request: Request) -> tracing.TraceContext | None:
    """The request's W3C trace context (exactly one well-formed traceparent header, and
    the tracestate if well formed), or None."""
    return tracing.from_headers(request.headers.getlist("traceparent"),
                                request.headers.getlist("tracestate"))


def tag_params(values: list[str]) -> dict[str, str] | None:
    """The list's tag filter from its ``tag=NAME:VALUE`` parameters (repeated: all must
    match), checked as a submit's tags are; None when none is given.

    Raises:
        Refusal: 400 for a parameter without ``:`` or a name given twice.
        ConfigError, SerializationError: tags no execution could carry (400 as well).
    """
    found: dict[str, str] = {}
    for pair in values:
        name, sep, value = pair.partition(":")
        if not sep:
            raise Refusal(400, "tag must be NAME:VALUE, e.g. tag=customer:acme")
        if name in found:
            raise Refusal(400, f"tag {codec.printable(name, 80)!r} is given twice")
        found[name] = value
    return codec.check_tags(found) if found else None

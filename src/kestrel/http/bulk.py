"""``POST /api/v1/executions/bulk``: cancel, retry or signal every execution a filter
matches (issue 42, item 4), one page per request, as ``kestrel-runtime cancel --status …``
does in a loop (:meth:`kestrel.Client.bulk`).

The body names the action, the filter (``list``'s, as JSON), for a signal its name and
payload, and a ``key`` (made and returned when none is sent: send it with every later page); the
answer says what this page did and gives ``next_cursor`` for the next request (null when
every page was done). A request sent again with the same key and
cursor acts on nothing twice: the key is scoped to the caller's token as an Idempotency-Key
is (another token's run with the same key is another run). ``dry_run`` counts what matches
and returns a sample.
"""

from __future__ import annotations

import secrets
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from kestrel import codec
from kestrel.http.api import _object, ok, require
from kestrel.http.refusals import Refusal
from kestrel.http.requests import decode_cursor, encode_cursor, read_json, time_param
from kestrel.types import Match

FILTERS = ("status", "workflow", "queue", "since", "until", "app_version", "patch",
           "without_patch", "tags")
FIELDS = ("action", "filter", "signal", "key", "dry_run", "cursor", "page_size")
MAX_BULK_PAGE = 500
KEY_CHARS = 128

BODY: dict[str, Any] = {
    "type": "object", "required": ["action", "filter"], "additionalProperties": False,
    "properties": {
        "action": {"enum": ["cancel", "retry", "signal"]},
        "filter": {"type": "object", "additionalProperties": False,
                   "properties": {**{name: {"type": "string"} for name in FILTERS},
                                  # Every one of these tags (list's tag=NAME:VALUE).
                                  "tags": {"type": "object", "maxProperties": 32,
                                           "additionalProperties": {"type": "string"}}}},
        "signal": {"type": "object", "required": ["name"], "additionalProperties": False,
                   "properties": {"name": {"type": "string"}, "payload": {}}},
        "key": {"type": "string", "maxLength": KEY_CHARS},
        "dry_run": {"type": "boolean"},
        "cursor": {"type": "string"},
        "page_size": {"type": "integer", "minimum": 1, "maximum": MAX_BULK_PAGE}}}


async def bulk(request: Request) -> Response:
    """One page of a bulk action: what it did, and the cursor of the next page."""
    caller = await require(request, "operate")
    body = _object(await read_json(request), FIELDS)
    action = body.get("action")
    if action not in ("cancel", "retry", "signal"):
        raise Refusal(400, "action must be cancel, retry or signal")
    match = _match(body.get("filter"))
    name, payload = _signal(action, body.get("signal"))
    key = body.get("key")
    if key is None:
        # Made here, so that it is scoped like one sent: every later page must carry it.
        key = secrets.token_hex(8)
    elif not isinstance(key, str) or not 1 <= len(key) <= KEY_CHARS:
        raise Refusal(400, f"key must be a string of 1 to {KEY_CHARS} characters")
    else:
        codec.check_text(key, what="key")
    dry_run = body.get("dry_run", False)
    if not isinstance(dry_run, bool):
        raise Refusal(400, "dry_run must be true or false")
    size = body.get("page_size", 200)
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_BULK_PAGE:
        raise Refusal(400, f"page_size must be an integer in [1, {MAX_BULK_PAGE}]")
    cursor = body.get("cursor")
    if cursor is not None and not isinstance(cursor, str):
        raise Refusal(400, "cursor must be a string this API returned")
    after = decode_cursor(cursor) if cursor else None
    # The caller's key, scoped to its token (kestrel.http.api._header_key).
    done = await request.app.state.client.bulk(
        action, match, signal=name, payload=payload, key=f"http:{caller.token_id}:{key}",
        dry_run=dry_run, after=after, pages=1, page_size=size)
    return ok({"action": action, "key": key, "dry_run": dry_run,
               "matched": done.matched, "acted": done.acted, "skipped": done.skipped,
               "sample": [str(i) for i in done.sample],
               "next_cursor": None if done.cursor is None
               else encode_cursor(done.cursor[0], str(done.cursor[1]))})


def _match(value: Any) -> Match:
    if not isinstance(value, dict):
        raise Refusal(400, "filter must be a JSON object of list's filters: "
                           + ", ".join(FILTERS))
    given = _object(value, FILTERS)
    tags = given.pop("tags", None)
    if tags is not None and not isinstance(tags, dict):
        raise Refusal(400, "filter.tags must be a JSON object of names to text")
    for name, text in given.items():
        if not isinstance(text, str):
            raise Refusal(400, f"filter.{name} must be a string")
    if "patch" in given and "without_patch" in given:
        raise Refusal(400, "filter.patch and filter.without_patch exclude each other")
    return Match(status=given.get("status"), workflow=given.get("workflow"),
                 queue=given.get("queue"), since=time_param(given, "since"),
                 until=time_param(given, "until"), app_version=given.get("app_version"),
                 patch=given.get("patch") or given.get("without_patch"),
                 with_patch="without_patch" not in given, tags=tags)


def _signal(action: str, value: Any) -> tuple[str | None, Any]:
    if action != "signal":
        if value is not None:
            raise Refusal(400, f"signal is only for the signal action, not {action}")
        return None, None
    if not isinstance(value, dict):
        raise Refusal(400, "signal ({\"name\": …, \"payload\": …}) is required to signal")
    sig = _object(value, ("name", "payload"))
    name = sig.get("name")
    if not isinstance(name, str):
        raise Refusal(400, "signal.name (a string) is required")
    return name, sig.get("payload")

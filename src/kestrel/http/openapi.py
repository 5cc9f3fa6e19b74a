"""The OpenAPI 3.1 document, built from the route table so it always matches the routes."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

SCOPE_NOTE = {
    None: "No token.",
    "read": "Bearer token with the `read` scope.",
    "operate": "Bearer token with the `operate` scope.",
    "submit": "Bearer token with the `submit` scope.",
}

HEADER_NOTE = {
    "Idempotency-Key": ("Makes the request idempotent: sent again with the same key and the "
                        "same body, it answers with what the first request did (200) "
                        "instead of doing it again; the same key with another body is "
                        "refused (409). The key covers every field of the body."),
}

_ERROR_BODY = {"application/json": {"schema": {
    "type": "object", "properties": {"error": {"type": "string"}}, "required": ["error"]}}}

REFUSALS = {
    "400": "Bad input (a malformed id, body, query or header); nothing was written.",
    "401": "No valid bearer token (a hook: no valid signature).",
    "403": "The token lacks this route's scope.",
    "404": "No such execution, workflow or hook.",
    "409": "The execution's state or the Idempotency-Key's first use refuses it.",
    "413": "The body is over the size cap; it was not read.",
}
"""The refusals a route gives by what it takes (:func:`_codes`)."""

EVERY_ROUTE = {
    "405": "Not a method of this path (the Allow header lists those that are).",
    "408": "The request's headers or body did not arrive in time (--http-header-timeout, "
           "--http-body-timeout); the connection is closed.",
    "414": "The request line is too long.",
    "431": "The request's headers are over --http-max-header-bytes.",
    "500": "An error of the server's own (logged with its type, never the request's values); "
           "nothing was written.",
    "503": "Busy or unavailable: the door at --http-max-connections, or the database down or "
           "slower than --http-statement-timeout (with Retry-After). Try again.",
}
"""What the door itself may answer on any route, before or around its handler."""


def document(endpoints: Iterable[Any]) -> dict[str, Any]:
    """The OpenAPI document of *endpoints* (``kestrel.http.app.ENDPOINTS``)."""
    paths: dict[str, dict[str, Any]] = {}
    for e in endpoints:
        op: dict[str, Any] = {
            "summary": e.summary,
            "description": f"{(e.handler.__doc__ or '').strip()}\n\n{SCOPE_NOTE[e.scope]}",
            "tags": list(e.tags),
            "responses": {**{code: {"description": text, "content": {"application/json": {}}}
                             for code, text in e.answers},
                          **{code: {"description": REFUSALS[code], "content": _ERROR_BODY}
                             for code in _codes(e)},
                          **{code: {"description": text, "content": _ERROR_BODY}
                             for code, text in EVERY_ROUTE.items()}},
        }
        if e.scope is not None:
            op["security"] = [{"bearer": [e.scope]}]
        params = [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
                  for name in re.findall(r"{(\w+)}", e.path)]
        params += [{"name": name, "in": "query", "required": False,
                    "schema": {"type": "string"}} for name in e.query]
        params += [{"name": name, "in": "header", "required": False,
                    "description": HEADER_NOTE.get(name, ""),
                    "schema": {"type": "string"}} for name in e.headers]
        if params:
            op["parameters"] = params
        if e.body is not None:
            op["requestBody"] = {"required": False,
                                 "content": {"application/json": {"schema": e.body}}}
        paths.setdefault(e.path, {})[e.method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "kestrel-runtime HTTP API", "version": "1"},
        "components": {"securitySchemes": {"bearer": {
            "type": "http", "scheme": "bearer",
            "description": "A token from `kestrel-runtime token create` (kst_…)."}}},
        "paths": paths,
    }


def _codes(e: Any) -> list[str]:
    """The refusals of :data:`REFUSALS` that endpoint *e* can give, by what it takes: a
    body, a query or a path parameter can be bad (400) and a path parameter unknown (404);
    a scope needs a token (401, 403); a hook needs a signature (401); a body has a cap
    (413); a write can meet a state or a key that refuses it (409)."""
    hook = e.pool == "hooks"
    codes = ["400"] if e.method == "POST" or e.query or "{" in e.path else []
    if e.scope is not None or hook:
        codes += ["401"]
    if e.scope is not None:
        codes += ["403"]
    if "{" in e.path:
        codes += ["404"]
    if e.method == "POST" and (e.scope in ("operate", "submit") or hook):
        codes += ["409"]
    if e.method == "POST":
        codes += ["413"]
    return codes

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

_ERROR = {"description": "Refused; nothing was written.", "content": {"application/json": {
    "schema": {"type": "object", "properties": {"error": {"type": "string"}},
               "required": ["error"]}}}}


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
                          **{code: _ERROR for code in _codes(e)}},
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
    codes = ["400"] if e.method == "POST" or e.query else []
    if e.scope is not None:
        codes += ["401", "403"]
    if e.method == "POST":
        codes += ["413"]
    if "{" in e.path:
        codes += ["404"]
    if e.method == "POST" and e.scope in ("operate", "submit"):
        codes += ["409"]
    return codes

"""The HTTP door: a JSON API with scoped bearer tokens, signed webhooks and (later) a web UI.

:func:`create_app` builds the ASGI app; :func:`kestrel.http.server.serve` runs it with
uvicorn (``kestrel-runtime serve``, or the supervisor's ``--http-port``).
"""

from kestrel.http.app import ENDPOINTS, ApiError, create_app

__all__ = ["ENDPOINTS", "ApiError", "create_app"]

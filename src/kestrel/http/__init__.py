"""The HTTP door: a JSON API with scoped bearer tokens, signed webhooks and (later) a web UI.

:func:`create_app` builds the ASGI app; :func:`kestrel.http.server.serve` runs it with
uvicorn (``kestrel-runtime serve``, or the supervisor's ``--http-port``).
"""

from kestrel.http.app import ENDPOINTS, create_app
from kestrel.http.refusals import Refusal

ApiError = Refusal
"""The API's name for :class:`~kestrel.http.refusals.Refusal`, kept for callers of before the
two doors shared one refusal type."""

__all__ = ["ENDPOINTS", "ApiError", "Refusal", "create_app"]

"""Serving the HTTP door with uvicorn: standalone (``kestrel-runtime serve``) or as the
supervisor's HTTP child process (``--http-port``).

One process, one event loop, one small connection pool, created after any fork. Several
servers (processes or hosts) may serve one schema: tokens, idempotency keys and replays live
in the database, nothing in a server's memory.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Iterable, Mapping, Sequence

from starlette.routing import BaseRoute

from kestrel.config import Config
from kestrel.errors import ConfigError
from kestrel.http.app import create_app
from kestrel.http.hooks import Hook
from kestrel.http.protocol import DoorLimits, check_files, protocol_class
from kestrel.http.ui import routes as ui_routes

log = logging.getLogger("kestrel.http")

DEFAULT_PORT = 8080


def prepare(cfg: Config, hooks: Mapping[str, Hook] | None) -> None:
    """What the door needs of this process and its settings, checked before it starts (in
    the supervisor, before the fork, for ``--http-port``): the open files for its sockets
    (raised up to the hard limit where needed) and a webhook body budget that holds the
    largest hook's body.

    Raises:
        ConfigError: too few open files may be had, or the budget is below a hook's cap.
    """
    done = check_files(DoorLimits.of(cfg),
                       others=cfg.pool_size + cfg.http_hook_pool_size + FILES_MARGIN)
    if done:
        log.info("HTTP door: %s", done)
    for hook in (hooks or {}).values():
        cap = hook.max_body_bytes or cfg.http_max_body_bytes
        if cap > cfg.http_hook_body_budget_bytes:
            raise ConfigError(
                f"invalid setting --http-hook-body-budget-bytes="
                f"{cfg.http_hook_body_budget_bytes}: hook {hook.name!r} takes bodies of up to "
                f"{cap} bytes, which would never fit; raise the budget to {cap} or more")


FILES_MARGIN = 64
"""Open files the HTTP process needs besides its sockets and pools (logs, the metrics
directory, the listening socket, TLS files...)."""


def serve(cfg: Config, *, dsn: str, workflows: Iterable[str] | None,
          hooks: Mapping[str, Hook] | None = None, routes: Sequence[BaseRoute] = ()) -> None:
    """Serve the API (and *routes*, e.g. the web UI's) on ``cfg.http_host``:``cfg.http_port``
    (8080 when 0) until SIGTERM or SIGINT; TLS with ``cfg.http_certfile``/``http_keyfile``.

    The metrics port is not this function's: :func:`kestrel.boot.observe` serves it (for
    ``kestrel-runtime serve``, this process's own; for the supervisor's HTTP child, the
    supervisor's, which merges its children's)."""
    import uvicorn

    prepare(cfg, hooks)
    port = cfg.http_port or DEFAULT_PORT
    app = create_app(cfg, dsn=dsn, workflows=workflows, hooks=hooks,
                     routes=[*ui_routes(), *routes])  # the web UI under /ui
    config = uvicorn.Config(
        app, host=cfg.http_host, port=port, lifespan="on",
        ssl_certfile=cfg.http_certfile or None, ssl_keyfile=cfg.http_keyfile or None,
        # uvicorn's access log prints paths and query strings: values a caller chose, which
        # may be secret. The app logs route templates only.
        access_log=False, log_config=None, server_header=False,
        # Starlette reads bodies in chunks; the app caps them (413) as they stream in. The
        # protocol bounds each connection's headers (size, time) and body (time), and the
        # number of connections, refusing in JSON (kestrel.http.protocol); uvicorn's own
        # limit_concurrency would answer everyone 503 while stalled clients hold it.
        http=protocol_class(DoorLimits.of(cfg)), ws="none", limit_concurrency=None,
        timeout_keep_alive=15,
    )
    log.info("serving the HTTP API on %s://%s:%d (%d hooks; at most %d connections, headers "
             "in %gs, bodies in %gs)", "https" if cfg.http_certfile else "http", cfg.http_host,
             port, len(hooks or {}), cfg.http_max_connections, cfg.http_header_timeout,
             cfg.http_body_timeout)
    # uvicorn shuts down gracefully on SIGTERM/SIGINT, restores the handlers it found and
    # raises the signal again; found handlers that ignore it make that a clean exit 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _after_shutdown)
    uvicorn.Server(config).run()


def _after_shutdown(signum: int, frame: object) -> None:
    """The signal uvicorn re-raises once it has shut down gracefully: nothing left to do."""

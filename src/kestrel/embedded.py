"""The embedded PostgreSQL used when no DSN is configured (``pgserver``, from PyPI).

It keeps its data in ``--data-dir`` (default ``.kestrel/pgdata`` under the current
directory), listens on a Unix socket in that directory only, and stops when the last
process that started it exits. For development and the demo; point ``--dsn`` at a real
server in production.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kestrel.config import Config

log = logging.getLogger("kestrel.embedded")


def dsn_from_environment(environ: dict[str, str] | None = None) -> bool:
    """Whether libpq's own variables name a server (then no embedded one is started)."""
    env = os.environ if environ is None else environ
    return any(env.get(k) for k in ("PGHOST", "PGSERVICE", "PGDATABASE"))


def start(data_dir: str | os.PathLike[str]) -> tuple[str, Any]:
    """Start (or join) the embedded server in *data_dir*; return its DSN and handle.

    Keep the handle alive as long as the server is needed: the server stops when every
    process holding one has exited.
    """
    path = Path(data_dir).absolute()
    path.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("XDG_RUNTIME_DIR", str(path.parent))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from pgserver import get_server  # type: ignore[attr-defined]

        server = get_server(path, cleanup_mode="stop")
    dsn = str(server.get_uri())
    log.info("embedded PostgreSQL running in %s (%s)", path, dsn)
    return dsn, server


def resolve_dsn(cfg: Config) -> tuple[str, Any]:
    """Return the DSN to use and, when embedded, the server handle to keep alive."""
    if cfg.dsn:
        return cfg.dsn, None
    if dsn_from_environment():
        return "", None  # libpq reads PGHOST/PGDATABASE/… itself
    return start(cfg.data_dir)

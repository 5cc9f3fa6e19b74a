"""The embedded PostgreSQL used when no DSN is configured (``pgserver``, from PyPI).

An optional extra, ``pip install 'kestrel-runtime[embedded]'`` (``make venv`` and ``make
run`` install it): ``pgserver`` has wheels for CPython 3.11 and 3.12 only and no sdist, and a
production image has no use for it. Without it and without a DSN, the commands stop with one
line saying how to give one.

It keeps its data in ``--data-dir`` (default ``.kestrel/pgdata`` under the current
directory), listens on a Unix socket in that directory only, and stops when the last
process that started or joined it exits: a runtime, door or migrate given the server's own
DSN (``kestrel-runtime dsn``) joins it too. Every start logs a warning saying so and where
the data is. For development and the demo; point ``--dsn`` at a real server in production.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import logging
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kestrel.errors import ConfigError

if TYPE_CHECKING:
    from kestrel.config import Config

log = logging.getLogger("kestrel.embedded")

NO_DATABASE = ("no database given: pass --dsn postgresql://USER@HOST/DB (or set KESTREL_DSN "
               "or PGHOST), or pip install 'kestrel-runtime[embedded]' to run a private "
               "PostgreSQL in --data-dir")


def available() -> bool:
    """Whether the embedded server can be started (the ``embedded`` extra is installed)."""
    try:
        return importlib.util.find_spec("pgserver") is not None
    except ValueError:  # sys.modules["pgserver"] is None: blocked on purpose
        return False


def dsn_from_environment(environ: dict[str, str] | None = None) -> bool:
    """Whether libpq's own variables name a server (then no embedded one is started)."""
    env = os.environ if environ is None else environ
    return any(env.get(k) for k in ("PGHOST", "PGSERVICE", "PGDATABASE"))


def exists(data_dir: str | os.PathLike[str]) -> bool:
    """Whether *data_dir* holds an embedded database (a PostgreSQL data directory)."""
    return (Path(data_dir) / "PG_VERSION").is_file()


def start(data_dir: str | os.PathLike[str], *, create: bool = True) -> tuple[str, Any]:
    """Start (or join) the embedded server in *data_dir*; return its DSN and handle.

    Keep the handle alive as long as the server is needed: the server stops when every
    process holding one has exited. From Python (a script, a notebook)::

        from kestrel.embedded import start
        dsn, server = start(".kestrel/pgdata")  # the folder `kestrel-runtime run` uses

    *create*: make a new database when *data_dir* holds none (``run``, ``migrate``,
    ``serve``, ``demo``). The operator commands pass False: run from another folder they
    would otherwise make an empty database there and report an unmigrated schema.

    Raises:
        ConfigError: the ``embedded`` extra is not installed, or *data_dir* holds no
            database and *create* is False.
    """
    if not available():
        raise ConfigError(NO_DATABASE)
    path = Path(data_dir).absolute()
    if not create and not exists(path):
        raise ConfigError(
            f"no embedded database in {path}: `kestrel-runtime run` (or `migrate`) creates "
            "it there, in your project folder; run this command from that folder, point "
            "--data-dir / KESTREL_DATA_DIR at it, or pass --dsn for your own server")
    path.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("XDG_RUNTIME_DIR", str(path.parent))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from pgserver import get_server  # type: ignore[attr-defined]

        _forget_the_dead(path)
        server = get_server(path, cleanup_mode="stop")
        if path not in _pruned_at_exit:
            # Registered after pgserver's own exit handler, so it runs first (atexit is
            # last in, first out): the last live holder then sees itself alone, and stops it.
            _pruned_at_exit.add(path)
            atexit.register(_forget_the_dead, path)
    dsn = str(server.get_uri())
    log.debug("embedded PostgreSQL running in %s (%s)", path, dsn)
    return dsn, server


def embedded_home(dsn: str) -> Path | None:
    """The data directory of the running embedded server *dsn* reaches, or None: its host is
    a Unix socket directory that holds an embedded database (the server listens in its own
    data directory, nowhere else)."""
    from psycopg.conninfo import conninfo_to_dict

    try:
        host = str(conninfo_to_dict(dsn).get("host") or "")
    except Exception:  # psycopg.ProgrammingError: the command reports a bad DSN itself
        return None
    if not host.startswith("/") or "," in host:
        return None
    home = Path(host)
    # Running (its postmaster.pid is there): a server that is down is not started by a
    # command that was only given its DSN; the connection fails as it would anywhere.
    return home if exists(home) and (home / "postmaster.pid").is_file() else None


_pruned_at_exit: set[Path] = set()


def _forget_the_dead(path: Path) -> None:
    """Drop from the server's list of holders (pgserver's ``.handle_pids.json``, under its
    lock) the processes that died without letting go, SIGKILLed say: the server stops when
    its last holder exits, and a dead one left on the list would keep it running for ever."""
    from pgserver.postgres_server import PostgresServer

    holders = path / ".handle_pids.json"
    with PostgresServer._lock:
        try:
            pids = json.loads(holders.read_text())
        except (OSError, ValueError):
            return
        alive = [pid for pid in pids if isinstance(pid, int) and _alive(pid)]
        if alive != pids:
            holders.write_text(json.dumps(alive))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's: alive
        return True
    return True


def resolve_dsn(cfg: Config, *, create: bool = True) -> tuple[str, Any]:
    """Return the DSN to use and, when embedded, the server handle to keep alive.

    *create*: see :func:`start`.

    Raises:
        ConfigError: no DSN is given and the ``embedded`` extra is not installed, or (not
            *create*) there is no embedded database in ``--data-dir``.
    """
    if cfg.dsn:
        home = embedded_home(cfg.dsn) if create else None
        if home is not None and available():
            # A runtime, door or migrate given the DSN of a running embedded server
            # (`kestrel-runtime dsn`) joins it, so it stays up while this process uses it,
            # whoever started it (a v2 runtime of a rolling deploy outlives the v1 that
            # started the server). An operator command, a moment long, does not.
            _, server = start(home, create=False)
            return cfg.dsn, server
        return cfg.dsn, None
    if dsn_from_environment():
        return "", None  # libpq reads PGHOST/PGDATABASE/… itself
    dsn, server = start(cfg.data_dir, create=create)
    # Said once where the runtime starts (run, serve, demo, migrate); an operator command
    # would repeat it before every answer.
    log.log(logging.WARNING if create else logging.DEBUG,
            "no --dsn given: using the embedded PostgreSQL (development only) with its data "
            "in %s; pass --dsn for your own server", Path(cfg.data_dir).absolute())
    return dsn, server

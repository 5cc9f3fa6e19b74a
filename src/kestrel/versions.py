"""Application versions and the live fleet, for safe changes and rolling deploys.

Every execution records the application version of the worker that first claimed it
(``--app-version``; by default :func:`code_version`, a hash of the registered workflows'
source), so an operator can ask which code started what (``list --app-version``).

Every worker process keeps a row in ``workers`` with the workflows and queues it claims and
its version, upserted each heartbeat period by :class:`Registration` and deleted when it
stops cleanly. The union of the live rows is what the fleet can run: a live execution whose
workflow and queue no live worker registers is *unclaimable*. It waits, queued, and is never
failed by a worker that cannot run it (the claim only takes registered names, FAULTS P4);
``kestrel-runtime unclaimable`` lists it and the ``kestrel_unclaimable_executions`` gauge
counts it. So is one that every live worker serving it gave back (their code is older than
its history, CodeTooOld: a rollback); ``kestrel_given_back_executions`` counts the live
executions given back and not claimed since. Rows rather than session state, so this works
behind PgBouncer in transaction mode and with workers of several versions side by side.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

from psycopg_pool import AsyncConnectionPool

from kestrel import db, metrics, statements
from kestrel.config import APP_VERSION, Config
from kestrel.errors import ConfigError
from kestrel.loops import every
from kestrel.sql import Queries

log = logging.getLogger("kestrel.worker")

def check_app_version(value: object) -> str:
    """Return *value* if it is a valid application version.

    Raises:
        ConfigError: not 1-128 of ``A-Z a-z 0-9 _ . : + / @ -``.
    """
    if not isinstance(value, str) or not APP_VERSION.fullmatch(value):
        shown = value[:200] if isinstance(value, str) else type(value).__name__
        raise ConfigError(f"invalid app version {shown!r}: use 1-128 of "
                          "A-Z a-z 0-9 _ . : + / @ -")
    return value


def code_version(workflows: Mapping[str, Any]) -> str:
    """A stable hash of the code that decides what the registered workflows do: their names
    and source, and the source of every module loaded from the application's own files
    (:func:`app_modules`: helpers, step bodies, patches asked inside a helper).

    The same code gives the same version on every host, path and Python version (module
    names and source, not paths or bytecode); an edit anywhere in the application's files
    gives another. That matters beyond labels: a worker never claims again what its own
    version gave back (CodeTooOld), so two codes under one version would leave a give-back
    to code that cannot run it (FAULTS C5). A workflow whose source cannot be read (built
    in a REPL) contributes its bytecode instead.
    """
    digest = hashlib.sha256()
    for name in sorted(workflows):
        fn = inspect.unwrap(workflows[name])
        try:
            code = inspect.getsource(fn).encode()
        except (OSError, TypeError):
            code = getattr(getattr(fn, "__code__", None), "co_code", b"")
        digest.update(name.encode("utf-8", "surrogatepass") + b"\0" + code + b"\0")
    for module, path in app_modules(workflows):
        try:
            source = path.read_bytes()
        except OSError:
            continue
        digest.update(b"module\0" + module.encode() + b"\0" + source + b"\0")
    return "code-" + digest.hexdigest()[:12]


def app_modules(workflows: Mapping[str, Any]) -> list[tuple[str, Path]]:
    """The modules loaded now from the application's own files, by name: those under the
    directory of each registered workflow's top-level package (for a workflow in a plain
    module, ``app.py``, the modules beside it; never a whole ``site-packages``). Modules the
    application imports later (inside a function) are not seen."""
    roots: set[Path] = set()
    for fn in workflows.values():
        top = sys.modules.get(str(getattr(inspect.unwrap(fn), "__module__", "")).split(".")[0])
        if top is None:
            continue
        if getattr(top, "__path__", None):
            roots.update(Path(p).resolve() for p in top.__path__)
        elif getattr(top, "__file__", None):
            here = Path(top.__file__).resolve()  # type: ignore[arg-type]
            installed = here.parent.name in ("site-packages", "dist-packages")
            roots.add(here if installed else here.parent)
    found: dict[str, Path] = {}
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if not file or not file.endswith(".py"):
            continue
        path = Path(file).resolve()
        if any(path == root or root in path.parents for root in roots):
            found[name] = path
    return sorted(found.items())


def resolve_app_version(cfg: Config, workflows: Mapping[str, Any]) -> Config:
    """Return *cfg* with its app version set: the configured one, or :func:`code_version`."""
    if cfg.app_version:
        return cfg
    return cfg.replace(app_version=code_version(workflows))


class Registration:
    """Keeps this worker's row in ``workers`` fresh; in the stats process, also the
    unclaimable gauges."""

    name = "registration"

    def __init__(self, pool: AsyncConnectionPool[Any], q: Queries, cfg: Config, *,
                 worker_id: str, workflows: list[str], collect: bool) -> None:
        self._pool, self._q, self._cfg = pool, q, cfg
        self._id = worker_id
        self._workflows = workflows
        self._collect = collect
        # A worker not seen for its lease plus two periods is presumed dead.
        self.interval = cfg.heartbeat
        self._stale_after = cfg.lease + 2 * cfg.heartbeat

    async def run(self) -> NoReturn:
        """Call :meth:`run_once` every heartbeat period forever (the worker called it once
        before starting its services); a failed round is retried at the next (the row only
        goes stale, which can only hide unclaimable work, never make a worker claim or fail
        anything)."""
        await every(lambda: self.interval, self.run_once, "worker registration")

    async def run_once(self) -> None:
        """Upsert this worker's row; in the collecting process, set the gauges."""
        await self.register()
        if self._collect:
            async with self._pool.connection() as conn:
                executions, names, given_back = await db.run(
                    conn, statements.versions.unclaimable_total(self._q))
            m = metrics.get()
            m.unclaimable.set(executions)
            m.unclaimable_workflows.set(names)
            m.given_back.set(given_back)

    async def register(self) -> None:
        """Upsert this worker's row: what it claims, and that it is alive. The worker's
        start sends it before claiming; the gauges (a pass over the live rows, 0.35 s with a
        million queued) wait for the first round."""
        async with self._pool.connection() as conn:
            await db.run(conn, statements.versions.register_worker(
                self._q, worker_id=self._id, app_version=self._cfg.app_version,
                workflows=self._workflows, queues=list(self._cfg.queues),
                stale_after_s=self._stale_after))

    async def unregister(self) -> None:
        """Delete this worker's row (a clean stop); best effort: a row left behind goes
        stale on its own."""
        try:
            async with self._pool.connection(timeout=5) as conn:
                await db.run(conn, statements.versions.unregister_worker(
                    self._q, worker_id=self._id))
        except Exception as exc:  # stopping anyway; the row goes stale by itself
            log.info("could not remove worker row %s (%s)", self._id, type(exc).__name__)

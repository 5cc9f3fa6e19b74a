"""The runtime's boot sequence, written once: ``kestrel-runtime run`` and ``serve`` start here.

Read top to bottom, :func:`run` is what a process does before it serves: the metrics
directory (before the app is imported: ``prometheus_client`` reads it at import), the app's
workflows, the queues they declare, the database (an embedded one when no DSN is given),
the TLS warning, the schema (migrated, or checked current where this role may not run DDL),
the first partition upkeep, the observability endpoint (:func:`observe`), then the
supervisor with its workers and the HTTP child. :func:`serve` is the same sequence for the
HTTP door alone.

This is the only module besides the CLI that imports both :mod:`kestrel.supervisor` and
:mod:`kestrel.migrate` (``tests/unit/test_layering.py``); the CLI's handlers only call it.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import sys
from typing import Any

from kestrel import connections
from kestrel.config import Config, mask_dsn, tls_warning
from kestrel.embedded import resolve_dsn
from kestrel.errors import ConfigError
from kestrel.workflow import WorkflowFn, registry

log = logging.getLogger("kestrel.cli")  # the runtime's start logs as it always has


def import_app(modules: str) -> dict[str, WorkflowFn]:
    """Import the comma-separated *modules*; return the workflows they registered.

    The current folder is searched first, as ``python -m`` would: ``kestrel-runtime --app
    myapp.workflows`` run from the project folder finds ``myapp/`` there (a console script
    puts only its own folder on ``sys.path``).

    Raises:
        ConfigError: a module cannot be imported (the message says where it was looked for).
    """
    here = os.getcwd()
    if here not in sys.path:
        sys.path.insert(0, here)
    for name in (m.strip() for m in modules.split(",") if m.strip()):
        try:
            importlib.import_module(name)
        except (ImportError, TypeError, ValueError) as exc:  # TypeError: a relative name
            top = name.partition(".")[0]
            hint = ""
            if name.endswith(".py") or os.sep in name or "/" in name:
                module = name.removesuffix(".py").replace(os.sep, ".").replace("/", ".")
                hint = (f"; --app takes a module name, as `python -m` does, not a file: "
                        f"--app {module.strip('.')} (run from the folder that holds it)")
            elif isinstance(exc, ModuleNotFoundError) and exc.name in (top, name):
                hint = (f"; run kestrel-runtime from the folder that holds {top!r} (now "
                        f"{here}), or add that folder to PYTHONPATH")
            raise ConfigError(f"invalid setting --app / KESTREL_APP={name!r}: cannot import "
                              f"it ({exc}){hint}") from None
    return registry()


def check_schema_current(dsn: str, schema: str) -> None:
    """Raise MigrationError unless *schema* is at the migration this code needs and its
    functions are at least the version this code calls (:func:`kestrel.migrate.behind`)."""
    from kestrel.errors import MigrationError
    from kestrel.migrate import behind

    with connections.connect(dsn) as conn:
        why = behind(conn, schema)
    if why is not None:
        raise MigrationError(f"{why}; run `kestrel-runtime migrate` as the schema owner")


def upkeep(dsn: str, cfg: Config, *, detach: bool = False) -> tuple[bool, int, int]:
    """One synchronous partition upkeep round (before forking, and for `partitions`)."""
    from kestrel import db, statements
    from kestrel.sql import queries

    with connections.connect(dsn) as conn:
        return db.run_script_sync(conn, statements.history.run_maintenance(
            queries(cfg.schema), interval=cfg.history_interval, ahead=cfg.history_ahead,
            retention_days=cfg.history_retention_days, detach=detach))


def migrate(cfg: Config, *, create: bool = True,
            ) -> tuple[str, Any, dict[str, list[int]]]:
    """Resolve the database and bring *cfg.schema* up to date, every bucket of it
    (``kestrel-runtime migrate``).

    Returns the DSN, the embedded server's handle (None for a DSN) to keep alive, and the
    migration versions applied, by schema.
    """
    from kestrel.migrate import migrate_namespace

    dsn, server = resolve_dsn(cfg, create=create)
    applied = migrate_namespace(dsn, cfg.schema, buckets=cfg.buckets,
                                history_interval=cfg.history_interval,
                                history_ahead=cfg.history_ahead)
    return dsn, server, applied


def _database(cfg: Config) -> tuple[str, Any]:
    """The DSN the runtime uses (starting the embedded server when none is given), with a
    warning when it reaches a remote server unverified."""
    dsn, server = resolve_dsn(cfg)
    if (warning := tls_warning(dsn)) is not None:
        log.warning("%s", warning)
    return dsn, server


def _migrate_or_check(dsn: str, cfg: Config) -> None:
    """Migrate the schema; where this role may not run DDL, check that it is current."""
    from psycopg.errors import InsufficientPrivilege

    from kestrel.migrate import may_migrate, migrate_namespace

    try:
        # Asked first: DDL this role may not run would leave an ERROR in the server's log
        # (on Citus, in every worker node's) at each start.
        if not may_migrate(dsn, cfg.schema):
            raise InsufficientPrivilege("not the schema's owner")
        migrate_namespace(dsn, cfg.schema, buckets=cfg.buckets,
                          history_interval=cfg.history_interval,
                          history_ahead=cfg.history_ahead)
    except InsufficientPrivilege:
        # A least-privilege runtime role: fine if the owner has migrated already.
        for schema in namespace_schemas(dsn, cfg.schema):
            check_schema_current(dsn, schema)
        log.info("schema %s is current; not migrating (this role may not run DDL)",
                 cfg.schema)


def namespace_schemas(dsn: str, namespace: str) -> list[str]:
    """The schemas of *namespace*: its buckets' (kestrel.buckets), bucket 0 first, or
    *namespace* alone for an ordinary schema."""
    from kestrel.buckets import schemas
    from kestrel.migrate import namespace_buckets

    count = namespace_buckets(dsn, namespace)
    return [namespace] if count == 1 else schemas(namespace, count)


def refuse_one_bucket(dsn: str, cfg: Config) -> None:
    """A runtime or HTTP door serves a namespace through its name (bucket 0's schema), never
    one other bucket alone: that bucket's processes would start cron ticks of their own, and
    its door would make ids that name no bucket.

    Raises:
        ConfigError: *cfg.schema* is bucket k > 0 of a namespace.
    """
    from kestrel.migrate import bucket_of_schema

    made = bucket_of_schema(dsn, cfg.schema)
    if made is not None and made[0] != 0:
        base = cfg.schema.removesuffix(f"_b{made[0]}")
        raise ConfigError(
            f"invalid setting --schema={cfg.schema}: it is bucket {made[0]} of namespace "
            f"{base} ({made[1]} buckets); run the runtime and the HTTP door with --schema "
            f"{base}, which serves every bucket (the client and the CLI may read one bucket "
            "by its own schema)")


def _check_node_lock_timeout(dsn: str, cfg: Config) -> None:
    """On a Citus coordinator, warn when this role has no lock_timeout on the worker nodes:
    --lock-timeout is a session setting, which stays on the coordinator, so a statement
    waiting on a node for a lock a client's transaction holds would wait for as long as it
    is held (docs/citus.md)."""
    from kestrel import db, statements
    from kestrel.sql import queries

    with connections.connect(dsn) as conn:
        on_nodes = db.run_sync(conn, statements.migrate.node_lock_timeout(queries(cfg.schema)))
    if on_nodes is None:
        return
    want = f"{connections.lock_timeout_ms(cfg.statement_lock_timeout)}ms"
    if on_nodes in ("0", ""):
        log.warning("Citus coordinator: --lock-timeout (%s) does not reach the worker nodes, "
                    "where statements wait for their locks; give this role the same there: "
                    "ALTER ROLE CURRENT_USER SET lock_timeout = '%s' (Citus propagates it; "
                    "docs/citus.md)", want, want)
    else:
        log.info("Citus coordinator: lock_timeout on the worker nodes is %s (this role's "
                 "setting); --lock-timeout is %s", on_nodes, want)


def _first_upkeep(dsn: str, cfg: Config) -> None:
    """Partitions exist before the first completion lands in history; a busy or unprivileged
    round is only a warning (the workers retry every --maintenance-interval)."""
    from psycopg.errors import InsufficientPrivilege, LockNotAvailable

    from kestrel.migrate import may_migrate

    try:
        if not may_migrate(dsn, cfg.schema):  # asked, not tried: no ERROR in the server log
            raise InsufficientPrivilege("not the schema's owner")
        upkeep(dsn, cfg)
    except LockNotAvailable:
        log.warning("history partition upkeep skipped: the history tables are busy; the "
                    "workers retry every %.0fs", cfg.maintenance_interval)
    except InsufficientPrivilege:
        log.warning("history partition upkeep needs the schema owner's rights; run "
                    "`kestrel-runtime partitions` as the owner")


def observe(cfg: Config, dsn: str) -> None:
    """Serve ``/metrics``, ``/healthz`` and ``/readyz`` on ``cfg.metrics_port`` (if set), in
    a thread of this process: the supervisor's for ``run`` (the merged metrics of its
    children), the HTTP door's own for ``serve``. Ready means the database answers and the
    schema is at this code's version (:func:`kestrel.migrate.readiness`)."""
    if not cfg.metrics_port:
        return
    from kestrel import metrics
    from kestrel.migrate import readiness

    metrics.serve(cfg.metrics_host, cfg.metrics_port,
                  ready=functools.partial(readiness, dsn, cfg.schema),
                  certfile=cfg.metrics_certfile or None, keyfile=cfg.metrics_keyfile or None)
    log.info("serving /metrics, /healthz and /readyz on %s://%s:%d",
             "https" if cfg.metrics_certfile else "http", cfg.metrics_host, cfg.metrics_port)


def _hooks(config_file: str | None) -> Any:
    from kestrel.http.hooks import load_hooks

    return load_hooks(config_file or os.environ.get("KESTREL_CONFIG"))


def run(cfg: Config, *, config_file: str | None = None) -> int:
    """Boot the runtime: migrate, then run the supervisor and its workers until they stop.

    Imports the app, migrates the schema (or, where this role may not, checks that it is
    current), does one partition upkeep round, serves the observability endpoint
    (:func:`observe`) and runs the supervisor (with the HTTP door in a child of its own when
    ``cfg.http_port`` is set); returns its exit status.
    *config_file*: the ``--config`` given, for the webhooks' ``[hooks.NAME]`` tables.

    Raises:
        ConfigError: --app is unset or registers no workflows, or --queues names a queue that
            is not declared.
        MigrationError: this role may not migrate and the schema is not at this code's version.
    """
    # Importing failpoints reads KESTREL_FAILPOINTS: a malformed value stops the start here
    # (ValueError) rather than in every forked worker, restart after restart.
    import kestrel.failpoints  # noqa: F401
    from kestrel.supervisor import Supervisor

    if not cfg.app:
        raise ConfigError("invalid setting --app / KESTREL_APP: name the module(s) that "
                          "define your workflows, e.g. --app myapp.workflows")
    metrics_dir = None
    if cfg.metrics_port:
        from kestrel import metrics

        # Before the app is imported: prometheus_client must see the directory at import.
        metrics_dir = metrics.prepare_multiprocess()
    workflows = import_app(cfg.app)
    if not workflows:
        raise ConfigError(f"invalid setting --app={cfg.app!r}: it registers no workflows")
    cfg.check_queues()  # after the app declared its queues
    # The default version, once for every worker of this runtime: a hash of the modules the
    # app's import loaded, before any process imports more of them later.
    from kestrel.versions import resolve_app_version

    cfg = resolve_app_version(cfg, workflows)
    dsn, server = _database(cfg)
    log.info("database %s, schema %s, %s mode, at most %d connections (%d processes x "
             "(pool %d + heartbeat + LISTEN)); LISTEN %s",
             mask_dsn(dsn) or "(from PG* environment)",
             cfg.schema, cfg.connection_mode, cfg.max_connections, cfg.procs, cfg.pool_size,
             f"on {mask_dsn(listen)}" if (listen := cfg.notify_dsn(dsn)) else
             "off: polling every --poll-interval")
    _migrate_or_check(dsn, cfg)
    refuse_one_bucket(dsn, cfg)
    schemas = namespace_schemas(dsn, cfg.schema)
    _check_node_lock_timeout(dsn, cfg)
    _first_upkeep(dsn, cfg)
    http = None
    if cfg.http_port:  # the HTTP door, in a child process of its own (kestrel.http)
        from kestrel.http.server import prepare
        from kestrel.http.server import serve as serve_http

        hooks = _hooks(config_file)
        prepare(cfg, hooks)  # here, where a refusal stops the start in one line
        http = functools.partial(serve_http, cfg, dsn=dsn, workflows=list(workflows),
                                 hooks=hooks)
    try:
        observe(cfg, dsn)
        code = Supervisor(cfg, workflows, dsn=dsn, http=http, schemas=schemas).run()
    finally:
        if metrics_dir:
            import shutil

            shutil.rmtree(metrics_dir, ignore_errors=True)
    del server
    return code


def serve(cfg: Config, *, config_file: str | None = None) -> int:
    """Boot the HTTP door alone (``kestrel-runtime serve``) and serve until SIGTERM.

    The same sequence as :func:`run` without workers: the app, the webhooks of
    *config_file*, the database, the schema, the observability endpoint (:func:`observe`:
    this process's own ``/metrics``); then :func:`kestrel.http.server.serve`.

    Raises:
        ConfigError: --app is unset, or a [hooks.NAME] table is invalid.
        MigrationError: the schema is not at this code's version and this role may not
            migrate it.
    """
    from kestrel.http.server import serve as serve_http

    if not cfg.app:
        raise ConfigError("invalid setting --app / KESTREL_APP: serve accepts the workflows "
                          "that module registers, e.g. --app myapp.workflows")
    from kestrel.http.server import prepare

    workflows = import_app(cfg.app)
    hooks = _hooks(config_file)
    prepare(cfg, hooks)
    dsn, server = _database(cfg)
    _migrate_or_check(dsn, cfg)
    refuse_one_bucket(dsn, cfg)
    observe(cfg, dsn)
    serve_http(cfg, dsn=dsn, workflows=list(workflows), hooks=hooks)
    del server
    return 0

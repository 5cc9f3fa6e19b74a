"""The commands that start or keep the runtime: ``run``, ``serve``, ``migrate``,
``partitions``, ``demo`` and ``dsn``, each its options beside its handler.

``run`` and ``serve`` only call :mod:`kestrel.boot`, where the boot sequence is written once.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from kestrel import boot
from kestrel import log as kestrel_log
from kestrel.cli.common import CONNECTION, HISTORY, NAMESPACE, Command, emit, json_flag
from kestrel.config import Config
from kestrel.embedded import resolve_dsn

SERVE = ("app", "pool_size", "max_payload_bytes", "max_history_bytes", "metrics_host",
         "metrics_port", "metrics_certfile", "metrics_keyfile", "http_host", "http_port",
         "http_certfile", "http_keyfile", "http_max_body_bytes", "http_max_header_bytes",
         "http_header_timeout", "http_body_timeout", "http_statement_timeout",
         "http_max_connections", "http_max_connections_per_client",
         "http_hook_body_budget_bytes", "http_hook_pool_size")
"""What ``serve`` takes besides the connection settings and the history ones its migrate
uses: the app, its pool, the payload cap (and the history cap it must not exceed), its
metrics endpoint and the HTTP door's own settings (what kestrel.http reads from Config)."""


def cmd_run(cfg: Config, ns: argparse.Namespace) -> int:
    """``kestrel-runtime run``: migrate, then run the supervisor and its workers
    (:func:`kestrel.boot.run`); return its exit status."""
    return boot.run(cfg, config_file=getattr(ns, "config", None))


def cmd_serve(cfg: Config, ns: argparse.Namespace) -> int:
    """``kestrel-runtime serve``: serve the HTTP API (see :mod:`kestrel.http`) until SIGTERM
    (:func:`kestrel.boot.serve`)."""
    return boot.serve(cfg, config_file=getattr(ns, "config", None))


def cmd_migrate(cfg: Config, ns: argparse.Namespace) -> int:
    """``kestrel-runtime migrate``: bring the schema (each bucket's, for a namespace of
    several) up to date; print the versions applied to each."""
    _dsn, server, applied = boot.migrate(cfg)
    for schema, versions in applied.items():
        print(f"schema {schema}: " + (f"applied {', '.join(map(str, versions))}" if versions
                                      else "up to date"))
    del server
    return 0


def cmd_partitions(cfg: Config, ns: argparse.Namespace) -> int:
    """``kestrel-runtime partitions``: run one upkeep round, then list the history partitions.

    With ``--detach`` expired partitions are detached instead of dropped.
    """
    from kestrel import connections, db, statements
    from kestrel.sql import queries

    dsn, _server = resolve_dsn(cfg, create=False)
    ran, created, dropped = True, 0, 0
    parts: list[tuple[str, Any]] = []
    # Each schema of the namespace: its buckets' (kestrel.buckets), or the schema alone.
    for schema in boot.namespace_schemas(dsn, cfg.schema):
        one = replace(cfg, schema=schema)
        done, made, gone = upkeep_patiently(dsn, one, detach=ns.detach)
        ran, created, dropped = ran and done, created + made, dropped + gone
        with connections.connect(dsn) as conn:
            parts += [(schema, p) for p in db.run_sync(
                conn, statements.history.list_partitions(queries(schema)))]
    data = {"ran": ran, "created": created, "dropped" if not ns.detach else "detached": dropped,
            "partitions": [{"schema": s, "table": p[0], "partition": p[1], "bounds": p[2],
                            "estimated_rows": p[3], "bytes": p[4]} for s, p in parts]}

    def table() -> None:
        if not ran:
            print("another process is doing partition upkeep right now; nothing done")
        else:
            verb = "detached" if ns.detach else "dropped"
            print(f"created {created} partitions, {verb} {dropped} "
                  f"(interval {cfg.history_interval}, {cfg.history_ahead} ahead, retention "
                  f"{cfg.history_retention_days:g} days)")
        several = len({s for s, _ in parts}) > 1
        print(f"\n{'schema  ' if several else ''}{'table':<18} {'partition':<30} {'rows':>10} "
              f"{'size':>10}  bounds")
        for s, p in parts:
            print(f"{s + '  ' if several else ''}{p[0]:<18} {p[1]:<30} {p[3]:>10} "
                  f"{p[4] / 1024:>8.0f}kB  {p[2]}")

    return emit(ns, data, table)


UPKEEP_PATIENCE_S = 15.0
"""How long ``partitions`` keeps trying a round the history tables are too busy for."""


def upkeep_patiently(dsn: str, cfg: Config, *, detach: bool) -> tuple[bool, int, int]:
    """One upkeep round for an operator. Its DDL gives up after ``lock_timeout`` (200 ms),
    so the hot path never queues behind it; under traffic (or while a reader holds an old
    partition) a round can give up, and the command tries it again, with backoff, for up to
    :data:`UPKEEP_PATIENCE_S` seconds before it fails (a failed round changed nothing).

    Raises:
        KestrelError: the tables stayed busy that long.
    """
    from psycopg.errors import LockNotAvailable

    from kestrel.errors import KestrelError
    from kestrel.loops import Backoff

    backoff = Backoff(base=0.1, cap=1.0)
    deadline = time.monotonic() + UPKEEP_PATIENCE_S
    while True:
        try:
            return boot.upkeep(dsn, cfg, detach=detach)
        except LockNotAvailable:
            if time.monotonic() >= deadline:
                raise KestrelError(
                    f"the history tables stayed busy for {UPKEEP_PATIENCE_S:g}s (a long "
                    "transaction holds a partition); nothing was changed: run it again, or "
                    "let the runtime's upkeep retry every --maintenance-interval") from None
            time.sleep(backoff.next_delay())


def partitions_options(parts: argparse.ArgumentParser) -> None:
    """``partitions``' options."""
    parts.add_argument("--detach", action="store_true",
                       help="Detach expired partitions instead of dropping them.")
    json_flag(parts)


def cmd_dsn(cfg: Config, ns: argparse.Namespace) -> int:
    """``kestrel-runtime dsn``: print the DSN the other commands use.

    With no ``--dsn``, that of the embedded database in ``--data-dir`` (which must exist); it
    stays up while a process holds it (``kestrel-runtime run``). Python code can start it
    itself: ``kestrel.embedded.start(".kestrel/pgdata")`` returns the DSN and the handle
    that keeps it up.
    """
    dsn, _server = resolve_dsn(cfg, create=False)
    if not dsn:
        dsn = "(libpq's PG* environment variables)"
    return emit(ns, {"dsn": dsn}, lambda: print(dsn))


def dsn_options(dsn: argparse.ArgumentParser) -> None:
    """``dsn``'s options."""
    dsn.add_argument("--json", action="store_true", help="Print JSON instead of a line.")


def dashboard_file() -> Path:
    """The Grafana dashboard: in the wheel (``kestrel/grafana/kestrel.json``), or in the
    checkout (``grafana/dashboards/kestrel.json``)."""
    packaged = Path(__file__).resolve().parents[1] / "grafana" / "kestrel.json"
    if packaged.is_file():
        return packaged
    return Path(__file__).resolve().parents[3] / "grafana" / "dashboards" / "kestrel.json"


def cmd_dashboard(cfg: Config, ns: argparse.Namespace) -> int:
    """``kestrel-runtime dashboard``: print the Grafana dashboard (JSON) for an import."""
    sys.stdout.write(dashboard_file().read_text(encoding="utf-8"))
    return 0


def cmd_demo(cfg: Config, ns: argparse.Namespace) -> int:
    """``kestrel-runtime demo``: run the incident-response demo; return its exit status.

    See :func:`kestrel.demo.run`. At the default log level the runtime's info logs are quieted.
    """
    from kestrel import demo

    if cfg.log_level == "info":  # the demo narrates; keep the runtime's own logs quiet
        kestrel_log.setup("warning", cfg.log_format)
    return demo.run(cfg, incidents=ns.incidents)


def demo_options(demo: argparse.ArgumentParser) -> None:
    """``demo``'s options."""
    demo.add_argument("--incidents", type=int, default=12,
                      help="How many incidents the demo submits (default: 12).")


RUN = Command(
    "run", "Run the supervisor and its workers (the default command).", cmd_run,
    settings=None,
    examples=("kestrel-runtime run --app myapp.workflows --procs 4 --dsn postgresql://app@db/app",
              "KESTREL_APP=myapp.workflows kestrel-runtime --http-port 8080"))
MIGRATE = Command(
    "migrate", "Create or upgrade the schema (as its owner), then exit.", cmd_migrate,
    settings=CONNECTION + HISTORY + NAMESPACE,
    examples=("kestrel-runtime migrate --dsn postgresql://owner@db/app",
              "kestrel-runtime migrate --schema acme --buckets 16 --dsn "
              "'postgresql://owner@coordinator/app?options=-c%20citus.enable_schema_based_"
              "sharding%3Don'"))
DSN = Command(
    "dsn", "Print the DSN the commands use (with no --dsn: the embedded database in "
           "--data-dir, while `kestrel-runtime run` keeps it up), for psql or Python.",
    cmd_dsn, dsn_options, examples=("psql \"$(kestrel-runtime dsn)\"",))
PARTITIONS = Command(
    "partitions", "Create history partitions ahead and drop those past the retention now (as "
                  "the schema owner; the runtime also does this every --maintenance-interval).",
    cmd_partitions, partitions_options, CONNECTION + HISTORY + ("history_retention_days",))
SERVE_COMMAND = Command(
    "serve", "Serve the HTTP API and webhooks on --http-host:--http-port (default "
             "127.0.0.1:8080); needs --app, hooks come from [hooks.NAME] in --config; with "
             "--metrics-port, its HTTP metrics on /metrics there.", cmd_serve,
    settings=CONNECTION + HISTORY + SERVE)
DASHBOARD = Command(
    "dashboard", "Print the Grafana dashboard of kestrel's metrics (JSON).", cmd_dashboard,
    settings=(), examples=("kestrel-runtime dashboard > kestrel.json",))
DEMO = Command(
    "demo", "Run the incident-response demo end to end on the embedded database.", cmd_demo,
    demo_options, settings=None)

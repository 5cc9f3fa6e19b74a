"""``kestrel-runtime``: the runtime (no subcommand) and the operator commands.

Every operator command prints a readable table, or JSON with ``--json``; bad input (an id
that is not a UUID, JSON that does not parse, an unknown id) prints one line on stderr and
exits 1; an invalid setting exits 2.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import re
import sys
import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from kestrel import log as kestrel_log
from kestrel.config import KNOBS, Config, load, mask_dsn, tls_warning
from kestrel.embedded import resolve_dsn
from kestrel.errors import ConfigError, KestrelError
from kestrel.workflow import WorkflowFn, registry

log = logging.getLogger("kestrel.cli")

PRECEDENCE = ("Settings come from, highest first: a flag, the KESTREL_<NAME> environment "
              "variable (e.g. KESTREL_BATCH_SIZE), a key in the TOML file named by --config "
              "or KESTREL_CONFIG (top level or a [kestrel] table), the default. With no DSN "
              "and no PG* variables, an embedded PostgreSQL runs in --data-dir.")


def _common() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("settings")
    g.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS,
                   help="TOML file with settings (keys are the flag names with _).")
    defaults = Config()
    for knob in KNOBS:
        default = getattr(defaults, knob.name)
        if isinstance(default, tuple):
            default = ",".join(default)
        shown = f" (default: {default})" if default not in (None, "") else ""
        g.add_argument(knob.flag, dest=knob.name, metavar=knob.metavar, type=knob.parse,
                       default=argparse.SUPPRESS,
                       help=f"{knob.help}{shown} [env {knob.env}]")
    return p


def _json_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="Print JSON instead of a table.")


def build_parser() -> argparse.ArgumentParser:
    """Return the ``kestrel-runtime`` argument parser, with every setting and subcommand."""
    common = _common()
    parser = argparse.ArgumentParser(
        prog="kestrel-runtime",
        # Options of a subcommand (submit --queue) are seen by this parser too: a prefix
        # match against its own (--queues, --queue-limits) would refuse them as ambiguous.
        allow_abbrev=False,
        parents=[common],
        description="Durable workflows on PostgreSQL. Without a subcommand, run the "
                    "supervisor and --procs worker processes (e.g. kestrel-runtime --procs 16 "
                    "--app myapp.workflows).",
        epilog=PRECEDENCE,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def add(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[common], help=help, description=help,
                              epilog=PRECEDENCE)

    add("run", "Run the supervisor and its workers (the default command).")
    add("migrate", "Create or upgrade the schema, then exit.")
    s = add("submit", "Submit an execution; print its id.")
    s.add_argument("workflow", help="Registered workflow name.")
    s.add_argument("--args", default="[]", help="JSON array of arguments (default: []).")
    s.add_argument("--queue", default="default")
    s.add_argument("--priority", type=int, default=0, help="Higher runs first.")
    s.add_argument("--idempotency-key", default=None,
                   help="Same key and arguments → the same execution.")
    s.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="Deadline after which the execution ends failed.")
    s.add_argument("--wait", type=float, default=None, metavar="SECONDS",
                   help="Wait this long for the result and print it.")
    _json_flag(s)
    ls = add("list", "List executions, newest first.")
    ls.add_argument("--status", help="queued, running, waiting, completed, failed, "
                                     "cancelled or quarantined.")
    ls.add_argument("--workflow", help="Only this workflow.")
    ls.add_argument("--since", help="Created since: an ISO time or an age like 30m, 6h, 7d.")
    ls.add_argument("--limit", type=int, default=50)
    # --app-version (a setting every command takes) filters here: given as a flag, not
    # inherited from KESTREL_APP_VERSION.
    ls.add_argument("--patch", metavar="ID", help="Only executions that recorded this patch.")
    ls.add_argument("--without-patch", metavar="ID", help="Only executions of the workflows "
                    "using this patch that did not record it (may need the old code path).")
    _json_flag(ls)
    _add_version_commands(add)
    show = add("show", "Show an execution with its steps as a timeline.")
    show.add_argument("id")
    _json_flag(show)
    cancel = add("cancel", "Cancel an execution (and its children).")
    cancel.add_argument("id")
    _json_flag(cancel)
    retry = add("retry", "Re-run a failed, cancelled or quarantined execution from its last "
                         "checkpoint.")
    retry.add_argument("id")
    _json_flag(retry)
    sig = add("signal", "Send a signal to an execution (e.g. an approval).")
    sig.add_argument("id")
    sig.add_argument("name")
    sig.add_argument("--payload", default="null", help="JSON payload (default: null).")
    sig.add_argument("--idempotency-key", default=None, help="Send at most once per key.")
    _json_flag(sig)
    stats = add("stats", "Queue depth by queue and status, oldest queued age, running by "
                         "worker, totals.")
    _json_flag(stats)
    parts = add("partitions", "Create history partitions ahead and drop those past the "
                              "retention now (the runtime also does this every "
                              "--maintenance-interval).")
    parts.add_argument("--detach", action="store_true",
                       help="Detach expired partitions instead of dropping them.")
    _json_flag(parts)
    demo = add("demo", "Run the incident-response demo end to end on the embedded database.")
    demo.add_argument("--incidents", type=int, default=12)
    return parser


def config_from_args(ns: argparse.Namespace, environ: dict[str, str] | None = None) -> Config:
    """Return the validated settings from flags, environment and config file.

    *ns* holds the parsed flags and *environ* the environment (default ``os.environ``); the
    config file is ``--config`` or ``KESTREL_CONFIG``.

    Raises:
        ConfigError: a setting does not parse or is out of range.
    """
    flags = {k.name: getattr(ns, k.name, None) for k in KNOBS}
    return load(flags, environ=environ, config_file=getattr(ns, "config", None))


def import_app(modules: str) -> dict[str, WorkflowFn]:
    """Import the comma-separated *modules*; return the workflows they registered.

    The current folder is searched first, as ``python -m`` would: ``kestrel-runtime --app
    myapp.workflows`` run from the project folder finds ``myapp/`` there (a console script
    puts only its own folder on ``sys.path``).

    Raises:
        ConfigError: a module cannot be imported (the message says where it was looked for).
    """
    import os

    here = os.getcwd()
    if here not in sys.path:
        sys.path.insert(0, here)
    for name in (m.strip() for m in modules.split(",") if m.strip()):
        try:
            importlib.import_module(name)
        except (ImportError, TypeError, ValueError) as exc:  # TypeError: a relative name
            top = name.partition(".")[0]
            hint = ""
            if isinstance(exc, ModuleNotFoundError) and exc.name in (top, name):
                hint = (f"; run kestrel-runtime from the folder that holds {top!r} (now "
                        f"{here}), or add that folder to PYTHONPATH")
            raise ConfigError(f"invalid setting --app / KESTREL_APP={name!r}: cannot import "
                              f"it ({exc}){hint}") from None
    return registry()


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kestrel-runtime`` with *argv* (default ``sys.argv[1:]``); return the exit status.

    An invalid setting returns 2 (1 when an operator command finds it: bad input there); a
    kestrel error, a ValueError or an operational database error (unreachable, refused)
    returns 1. Each prints one line on stderr.
    """
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        cfg = config_from_args(ns)
    except ConfigError as exc:
        print(f"kestrel-runtime: {exc}", file=sys.stderr)
        return 2
    kestrel_log.setup(cfg.log_level, cfg.log_format)
    command = ns.command or "run"
    try:
        return COMMANDS[command](cfg, ns)
    except ConfigError as exc:
        print(f"kestrel-runtime {command}: {exc}", file=sys.stderr)
        return 2 if command == "run" else 1
    except (KestrelError, ValueError) as exc:
        print(f"kestrel-runtime {command}: {exc}", file=sys.stderr)
        return 1
    except psycopg.OperationalError as exc:
        # libpq's and the server's own words, which never carry the password. No SQLSTATE
        # (or class 08, 28): unreachable, refused, or not the server the DSN verifies.
        state = exc.sqlstate or ""
        what = ("cannot connect to the database" if state[:2] in ("", "08", "28")
                else "database error")
        print(f"kestrel-runtime {command}: {what}: {exc}", file=sys.stderr)
        return 1


def cmd_run(cfg: Config, ns: argparse.Namespace) -> int:
    """``kestrel-runtime run``: migrate, then run the supervisor and its workers.

    Imports the app, migrates the schema (or, where this role may not, checks that it is
    current), does one partition upkeep round and runs the supervisor until it stops; returns
    its exit status.

    Raises:
        ConfigError: --app is unset or registers no workflows, or --queues names a queue that
            is not declared.
        MigrationError: this role may not migrate and the schema is not at this code's version.
    """
    from psycopg.errors import InsufficientPrivilege, LockNotAvailable

    # Importing failpoints reads KESTREL_FAILPOINTS: a malformed value stops the start here
    # (ValueError) rather than in every forked worker, restart after restart.
    import kestrel.failpoints  # noqa: F401
    from kestrel.migrate import migrate
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
    dsn, server = resolve_dsn(cfg)
    if (warning := tls_warning(dsn)) is not None:
        log.warning("%s", warning)
    log.info("database %s, schema %s, %s mode, at most %d connections (%d processes x "
             "(pool %d + heartbeat + LISTEN)); LISTEN %s",
             mask_dsn(dsn) or "(from PG* environment)",
             cfg.schema, cfg.connection_mode, cfg.max_connections, cfg.procs, cfg.pool_size,
             f"on {mask_dsn(listen)}" if (listen := cfg.notify_dsn(dsn)) else
             "off: polling every --poll-interval")
    try:
        migrate(dsn, cfg.schema, history_interval=cfg.history_interval,
                history_ahead=cfg.history_ahead)
    except InsufficientPrivilege:
        # A least-privilege runtime role: fine if the owner has migrated already.
        check_schema_current(dsn, cfg.schema)
        log.info("schema %s is current; not migrating (this role may not run DDL)",
                 cfg.schema)
    try:
        upkeep(dsn, cfg)  # partitions exist before the first completion lands in history
    except LockNotAvailable:
        log.warning("history partition upkeep skipped: the history tables are busy; the "
                    "workers retry every %.0fs", cfg.maintenance_interval)
    except InsufficientPrivilege:
        log.warning("history partition upkeep needs the schema owner's rights; run "
                    "`kestrel-runtime partitions` as the owner")
    try:
        code = Supervisor(cfg, workflows, dsn=dsn).run()
    finally:
        if metrics_dir:
            import shutil

            shutil.rmtree(metrics_dir, ignore_errors=True)
    del server
    return code


def check_schema_current(dsn: str, schema: str) -> None:
    """Raise MigrationError unless *schema* is at the migration this code needs."""

    from kestrel.errors import MigrationError
    from kestrel.migrate import current_version
    from kestrel.sql import migrations

    with psycopg.connect(dsn, autocommit=True) as conn:
        have = current_version(conn, schema)
    want = len(migrations(schema))
    if have != want:
        raise MigrationError(f"schema {schema} is at migration {have}, this code needs {want};"
                             " run `kestrel-runtime migrate` as the schema owner")


def upkeep(dsn: str, cfg: Config, *, detach: bool = False) -> tuple[bool, int, int]:
    """One synchronous partition upkeep round (before forking, and for `partitions`)."""

    from kestrel import db
    from kestrel.sql import queries

    with psycopg.connect(dsn, autocommit=True) as conn:
        return db.run_script_sync(conn, db.run_maintenance(
            queries(cfg.schema), interval=cfg.history_interval, ahead=cfg.history_ahead,
            retention_days=cfg.history_retention_days, detach=detach))


def cmd_partitions(cfg: Config, ns: argparse.Namespace) -> int:
    """``kestrel-runtime partitions``: run one upkeep round, then list the history partitions.

    With ``--detach`` expired partitions are detached instead of dropped.
    """

    from kestrel import db
    from kestrel.sql import queries

    dsn, _server = resolve_dsn(cfg)
    ran, created, dropped = upkeep(dsn, cfg, detach=ns.detach)
    with psycopg.connect(dsn, autocommit=True) as conn:
        parts = db.run_sync(conn, db.list_partitions(queries(cfg.schema)))
    data = {"ran": ran, "created": created, "dropped" if not ns.detach else "detached": dropped,
            "partitions": [{"table": p[0], "partition": p[1], "bounds": p[2],
                            "estimated_rows": p[3], "bytes": p[4]} for p in parts]}

    def table() -> None:
        if not ran:
            print("another process is doing partition upkeep right now; nothing done")
        else:
            verb = "detached" if ns.detach else "dropped"
            print(f"created {created} partitions, {verb} {dropped} "
                  f"(interval {cfg.history_interval}, {cfg.history_ahead} ahead, retention "
                  f"{cfg.history_retention_days:g} days)")
        print(f"\n{'table':<18} {'partition':<30} {'rows':>10} {'size':>10}  bounds")
        for p in parts:
            print(f"{p[0]:<18} {p[1]:<30} {p[3]:>10} {p[4] / 1024:>8.0f}kB  {p[2]}")

    return _emit(ns, data, table)


def cmd_migrate(cfg: Config, ns: argparse.Namespace) -> int:
    """``kestrel-runtime migrate``: bring the schema up to date; print the versions applied."""
    from kestrel.migrate import migrate

    dsn, server = resolve_dsn(cfg)
    applied = migrate(dsn, cfg.schema, history_interval=cfg.history_interval,
                      history_ahead=cfg.history_ahead)
    print(f"schema {cfg.schema}: " + (f"applied {', '.join(map(str, applied))}" if applied
                                      else "up to date"))
    del server
    return 0


def _client(cfg: Config) -> tuple[Any, Any]:
    from kestrel.client import SyncClient

    dsn, server = resolve_dsn(cfg)
    # One command, one or two statements: no pool to keep open.
    client = SyncClient(dsn, schema=cfg.schema, max_payload_bytes=cfg.max_payload_bytes,
                        pool_size=0)
    return client, server


def _json_arg(text: str, flag: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{flag} is not valid JSON: {exc}") from None


def _parse_id(text: str) -> uuid.UUID:
    try:
        return uuid.UUID(text)
    except ValueError:
        raise ConfigError(f"{text!r} is not an execution id (a UUID)") from None


def _emit(ns: argparse.Namespace, data: Any, table: Callable[[], None]) -> int:
    if getattr(ns, "json", False):
        print(json.dumps(data, indent=2, default=_jsonable))
    else:
        table()
    return 0


def _jsonable(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    raise TypeError(f"cannot encode {type(value).__name__}")


def cmd_submit(cfg: Config, ns: argparse.Namespace) -> int:
    """``kestrel-runtime submit``: submit an execution; print its id (with ``--wait``, its result).

    Raises:
        ConfigError: ``--args`` is not a JSON array.
    """
    args = _json_arg(ns.args, "--args")
    if not isinstance(args, list):
        raise ConfigError("--args must be a JSON array, e.g. '[1, \"two\"]'")
    client, _server = _client(cfg)
    handle = client.submit(ns.workflow, *args, queue=ns.queue, priority=ns.priority,
                           idempotency_key=ns.idempotency_key, timeout=ns.timeout)
    result = handle.result(timeout=ns.wait) if ns.wait is not None else None
    data: dict[str, Any] = {"id": str(handle.id)}
    if ns.wait is not None:
        data["result"] = result

    def table() -> None:
        print(handle.id)
        if ns.wait is not None:
            print(json.dumps(result))

    return _emit(ns, data, table)


def _since(text: str | None) -> datetime | None:
    if text is None:
        return None
    m = re.fullmatch(r"(\d+)([smhd])", text.strip())
    if m:
        unit = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}[m.group(2)]
        return datetime.now(UTC) - timedelta(**{unit: int(m.group(1))})
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise ConfigError(f"--since {text!r}: use an ISO time (2026-11-30T08:00) or an age "
                          "like 30m, 6h, 7d") from None
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def cmd_list(cfg: Config, ns: argparse.Namespace) -> int:
    """``kestrel-runtime list``: print executions newest first, optionally filtered.

    The filters are ``--status``, ``--workflow`` and ``--since``; ``--limit`` caps the rows.
    """
    client, _server = _client(cfg)
    if ns.patch and ns.without_patch:
        raise ConfigError("--patch and --without-patch exclude each other")
    rows = client.list(status=ns.status, workflow=ns.workflow, since=_since(ns.since),
                       limit=ns.limit, app_version=getattr(ns, "app_version", None),
                       patch=ns.patch or ns.without_patch, with_patch=not ns.without_patch)
    data = [{"id": r.id, "workflow": r.workflow, "queue": r.queue, "status": r.status.value,
             "claims": r.attempts, "created_at": r.created_at, "finished_at": r.finished_at,
             "app_version": r.app_version}
            for r in rows]

    def table() -> None:
        print(f"{'id':<36}  {'workflow':<22} {'queue':<10} {'status':<11} {'created':<19} "
              f"{'took':>9}")
        for r in rows:
            took = (f"{_ms(r.finished_at - r.created_at) / 1000:8.2f}s" if r.finished_at
                    else "")
            print(f"{r.id!s:<36}  {r.workflow[:22]:<22} {r.queue[:10]:<10} "
                  f"{r.status.value:<11} {r.created_at:%Y-%m-%d %H:%M:%S} {took:>9}")
        print(f"({len(rows)} shown)")

    return _emit(ns, data, table)


def cmd_show(cfg: Config, ns: argparse.Namespace) -> int:
    """``kestrel-runtime show``: print one execution and its steps as a timeline."""
    client, _server = _client(cfg)
    ex = client.get(_parse_id(ns.id))
    steps = client.steps(ex.id)
    data = {
        "id": ex.id, "workflow": ex.workflow, "status": ex.status.value, "queue": ex.queue,
        "claims": ex.attempts, "args": ex.args, "result": ex.result, "error": ex.error,
        "created_at": ex.created_at, "started_at": ex.started_at,
        "finished_at": ex.finished_at,
        "steps": [{"step_id": s.step_id, "name": s.name, "attempt": s.attempt,
                   "duration_ms": _ms(s.finished_at - s.started_at), "output": s.output,
                   "error": s.error} for s in steps],
    }

    def table() -> None:
        print(f"execution {ex.id}")
        print(f"  workflow  {ex.workflow}   queue {ex.queue}   status {ex.status.value}")
        print(f"  args      {_short(ex.args)}")
        if ex.status.value == "completed":
            print(f"  result    {_short(ex.result)}")
        if ex.error:
            print(f"  error     {ex.error.get('type')}: {ex.error.get('message')}")
        print(f"  steps ({len(steps)}):")
        for s in steps:
            outcome = (f"error {s.error.get('type')}: {s.error.get('message')}" if s.error
                       else _short(s.output, 60))
            at = s.started_at - ex.created_at
            print(f"    #{s.step_id:<3} +{_ms(at) / 1000:7.2f}s  {s.name[:34]:<34} "
                  f"try {s.attempt}  {_ms(s.finished_at - s.started_at):>8.1f} ms  {outcome}")

    return _emit(ns, data, table)


def cmd_cancel(cfg: Config, ns: argparse.Namespace) -> int:
    """``kestrel-runtime cancel``: cancel an execution and print what that did.

    It was cancelled now, stops at its next step boundary (it is running), or had already
    finished.
    """
    client, _server = _client(cfg)
    eid = _parse_id(ns.id)
    status = client.cancel(eid)
    note = {"cancelled": "cancelled", "cancelling": "running: it stops at its next step "
            "boundary"}.get(status, f"already {status}; nothing to cancel")
    return _emit(ns, {"id": eid, "status": status}, lambda: print(f"{eid}: {note}"))


def cmd_retry(cfg: Config, ns: argparse.Namespace) -> int:
    """``kestrel-runtime retry``: queue a failed, cancelled or quarantined execution again.

    It resumes from its last checkpoint.
    """
    client, _server = _client(cfg)
    eid = _parse_id(ns.id)
    client.retry(eid)
    return _emit(ns, {"id": eid, "status": "queued"},
                 lambda: print(f"{eid}: queued again; it resumes from its last checkpoint"))


def cmd_signal(cfg: Config, ns: argparse.Namespace) -> int:
    """``kestrel-runtime signal``: send a signal; print whether it was delivered.

    The payload is JSON (``--payload``); a signal sent before under the same
    ``--idempotency-key`` is not delivered again.
    """
    payload = _json_arg(ns.payload, "--payload")
    client, _server = _client(cfg)
    eid = _parse_id(ns.id)
    sent = client.signal(eid, ns.name, payload, idempotency_key=ns.idempotency_key)
    msg = (f"{eid}: signal {ns.name!r} delivered" if sent else
           f"{eid}: signal {ns.name!r} with key {ns.idempotency_key!r} was already delivered")
    return _emit(ns, {"id": eid, "signal": ns.name, "delivered": sent}, lambda: print(msg))


def cmd_stats(cfg: Config, ns: argparse.Namespace) -> int:
    """``kestrel-runtime stats``: print queue depth, running executions by worker, totals."""
    client, _server = _client(cfg)
    st = client.stats()
    data = {"queues": [{"queue": q.queue, "status": q.status, "count": q.count,
                        "oldest_queued_age_s": q.oldest_age_s} for q in st.queues],
            "running_by_worker": st.running_by_worker, "totals": st.totals}

    def table() -> None:
        print(f"{'queue':<16} {'status':<9} {'count':>8} {'oldest queued':>14}")
        for q in st.queues:
            age = f"{q.oldest_age_s:13.1f}s" if q.oldest_age_s is not None else ""
            print(f"{q.queue[:16]:<16} {q.status:<9} {q.count:>8} {age:>14}")
        if not st.queues:
            print("(no live executions)")
        if st.running_by_worker:
            print(f"\n{'worker':<30} {'running':>8}")
            for worker, n in st.running_by_worker.items():
                print(f"{worker[:30]:<30} {n:>8}")
        print("\ntotals: " + "  ".join(f"{k} {st.totals.get(k, 0)}" for k in
                                      ("queued", "running", "waiting", "completed", "failed",
                                       "cancelled", "quarantined")))

    return _emit(ns, data, table)


def _ms(delta: timedelta) -> float:
    return round(delta.total_seconds() * 1000, 1)


def _short(value: Any, width: int = 90) -> str:
    text = json.dumps(value)
    return text if len(text) <= width else text[: width - 1] + "…"


# -- versions and rolling deploys (issue 18) ---------------------------------------------------

def _add_version_commands(add: Callable[[str, str], argparse.ArgumentParser]) -> None:
    uc = add("unclaimable", "Live executions no live worker can claim (no worker registers "
                            "their workflow and queue): they wait, unfailed; and the live "
                            "workers with their app versions.")
    uc.add_argument("--limit", type=int, default=100, help="Most lines (default: 100).")
    _json_flag(uc)
    pt = add("patches", "Patches recorded by executions (ctx.patched), by workflow: how many "
                        "took the new path, and how many live ones may still need the old.")
    pt.add_argument("patch", nargs="?", help="Only this patch id.")
    _json_flag(pt)


def cmd_unclaimable(cfg: Config, ns: argparse.Namespace) -> int:
    """``kestrel-runtime unclaimable``: what waits for a worker that knows it, and who runs."""
    client, _server = _client(cfg)
    if not 1 <= ns.limit <= 10_000:
        raise ConfigError(f"--limit {ns.limit}: must be 1-10000")
    groups = client.unclaimable(limit=ns.limit)
    workers = client.workers()
    data = {"unclaimable": [{"workflow": g.workflow, "queue": g.queue, "count": g.count,
                             "oldest_created_at": g.oldest_created_at} for g in groups],
            "workers": [{"worker_id": w.worker_id, "app_version": w.app_version,
                         "workflows": w.workflows, "queues": w.queues,
                         "seen_at": w.seen_at} for w in workers]}

    def table() -> None:
        print(f"{'workflow':<32} {'queue':<16} {'count':>8}  oldest")
        for g in groups:
            print(f"{g.workflow[:32]!s:<32} {g.queue[:16]:<16} {g.count:>8}  "
                  f"{g.oldest_created_at:%Y-%m-%d %H:%M:%S}")
        if not groups:
            print("(nothing unclaimable)")
        print(f"\n{'worker':<30} {'app version':<20} workflows")
        for w in workers:
            print(f"{w.worker_id[:30]:<30} {w.app_version[:20]:<20} "
                  f"{_short(w.workflows, 60)}")
        if not workers:
            print("(no live workers)")

    return _emit(ns, data, table)


def cmd_patches(cfg: Config, ns: argparse.Namespace) -> int:
    """``kestrel-runtime patches``: per workflow and patch, who took the new path and how
    many live executions may still need the old one (remove the old branch at 0)."""
    client, _server = _client(cfg)
    uses = client.patches(ns.patch)
    data = [{"workflow": u.workflow, "patch": u.patch, "at_step": u.at_step,
             "executions_with": u.total_with, "live_with": u.live_with,
             "live_without": u.live_without} for u in uses]

    def table() -> None:
        print(f"{'workflow':<28} {'patch':<28} {'with':>8} {'live with':>10} "
              f"{'live without':>13}")
        for u in uses:
            print(f"{u.workflow[:28]!s:<28} {u.patch[:28]!s:<28} {u.total_with:>8} "
                  f"{u.live_with:>10} {u.live_without:>13}")
        if not uses:
            print("(no patch markers recorded)")

    return _emit(ns, data, table)


def cmd_demo(cfg: Config, ns: argparse.Namespace) -> int:
    """``kestrel-runtime demo``: run the incident-response demo; return its exit status.

    See :func:`kestrel.demo.run`. At the default log level the runtime's info logs are quieted.
    """
    from kestrel import demo

    if cfg.log_level == "info":  # the demo narrates; keep the runtime's own logs quiet
        kestrel_log.setup("warning", cfg.log_format)
    return demo.run(cfg, incidents=ns.incidents)


COMMANDS: dict[str, Callable[[Config, argparse.Namespace], int]] = {
    "run": cmd_run,
    "migrate": cmd_migrate,
    "submit": cmd_submit,
    "list": cmd_list,
    "show": cmd_show,
    "cancel": cmd_cancel,
    "retry": cmd_retry,
    "signal": cmd_signal,
    "stats": cmd_stats,
    "partitions": cmd_partitions,
    "demo": cmd_demo,
    "unclaimable": cmd_unclaimable,
    "patches": cmd_patches,
}

if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())

"""``kestrel-runtime``: the runtime (no subcommand) and the operator commands."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
import uuid
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from kestrel import log as kestrel_log
from kestrel.config import KNOBS, Config, load, mask_dsn
from kestrel.errors import ConfigError, KestrelError
from kestrel.workflow import WorkflowFn, registry

log = logging.getLogger("kestrel.cli")

PRECEDENCE = ("Settings come from, highest first: a flag, the KESTREL_<NAME> environment "
              "variable (e.g. KESTREL_BATCH_SIZE), a key in the TOML file named by --config "
              "or KESTREL_CONFIG (top level or a [kestrel] table), the default.")


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


def build_parser() -> argparse.ArgumentParser:
    common = _common()
    parser = argparse.ArgumentParser(
        prog="kestrel-runtime",
        parents=[common],
        description="Durable workflows on PostgreSQL. Without a subcommand, run the "
                    "supervisor and --procs worker processes.",
        epilog=PRECEDENCE,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("run", parents=[common], help="Run the supervisor (the default).")
    sub.add_parser("migrate", parents=[common], help="Create or upgrade the schema, then exit.")
    s = sub.add_parser("submit", parents=[common], help="Submit an execution; print its id.")
    s.add_argument("workflow", help="Registered workflow name.")
    s.add_argument("--args", default="[]", help="JSON array of arguments (default: []).")
    s.add_argument("--queue", default="default")
    s.add_argument("--priority", type=int, default=0)
    s.add_argument("--idempotency-key", default=None)
    s.add_argument("--wait", type=float, default=None, metavar="SECONDS",
                   help="Wait this long for the result and print it.")
    show = sub.add_parser("show", parents=[common], help="Show an execution and its steps.")
    show.add_argument("id")
    show.add_argument("--json", action="store_true", help="Print JSON.")
    stats = sub.add_parser("stats", parents=[common], help="Executions by status.")
    stats.add_argument("--json", action="store_true", help="Print JSON.")
    demo = sub.add_parser("demo", parents=[common],
                          help="Run the incident-response demo end to end and show it.")
    demo.add_argument("--incidents", type=int, default=20)
    return parser


def config_from_args(ns: argparse.Namespace, environ: dict[str, str] | None = None) -> Config:
    flags = {k.name: getattr(ns, k.name, None) for k in KNOBS}
    return load(flags, environ=environ, config_file=getattr(ns, "config", None))


def import_app(modules: str) -> dict[str, WorkflowFn]:
    """Import the comma-separated *modules*; return the workflows they registered.

    Raises:
        ConfigError: a module cannot be imported.
    """
    for name in (m.strip() for m in modules.split(",") if m.strip()):
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ConfigError(f"invalid setting --app / KESTREL_APP={name!r}: cannot import "
                              f"it ({exc})") from None
    return registry()


def resolve_dsn(cfg: Config) -> tuple[str, Any]:
    """Return the DSN to use and, when embedded, the server handle to keep alive."""
    from kestrel import embedded

    if cfg.dsn:
        return cfg.dsn, None
    if embedded.dsn_from_environment():
        return "", None  # libpq reads PGHOST/PGDATABASE/… itself
    return embedded.start(cfg.data_dir)


def main(argv: Sequence[str] | None = None) -> int:
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
    except (KestrelError, ValueError) as exc:
        print(f"kestrel-runtime {command}: {exc}", file=sys.stderr)
        return 1


def cmd_run(cfg: Config, ns: argparse.Namespace) -> int:
    from kestrel.migrate import migrate
    from kestrel.supervisor import Supervisor

    if not cfg.app:
        raise ConfigError("invalid setting --app / KESTREL_APP: name the module(s) that "
                          "define your workflows, e.g. --app myapp.workflows")
    workflows = import_app(cfg.app)
    if not workflows:
        raise ConfigError(f"invalid setting --app={cfg.app!r}: it registers no workflows")
    dsn, server = resolve_dsn(cfg)
    log.info("database %s, schema %s", mask_dsn(dsn) or "(from PG* environment)", cfg.schema)
    migrate(dsn, cfg.schema)
    code = Supervisor(cfg, workflows, dsn=dsn).run()
    del server
    return code


def cmd_migrate(cfg: Config, ns: argparse.Namespace) -> int:
    from kestrel.migrate import migrate

    dsn, server = resolve_dsn(cfg)
    applied = migrate(dsn, cfg.schema)
    print(f"schema {cfg.schema}: " + (f"applied {', '.join(map(str, applied))}" if applied
                                      else "up to date"))
    del server
    return 0


def _client(cfg: Config) -> tuple[Any, Any]:
    from kestrel.client import SyncClient

    dsn, server = resolve_dsn(cfg)
    return SyncClient(dsn, schema=cfg.schema, max_payload_bytes=cfg.max_payload_bytes), server


def cmd_submit(cfg: Config, ns: argparse.Namespace) -> int:
    try:
        args = json.loads(ns.args)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--args is not valid JSON: {exc}") from None
    if not isinstance(args, list):
        raise ConfigError("--args must be a JSON array, e.g. '[1, \"two\"]'")
    client, _server = _client(cfg)
    handle = client.submit(ns.workflow, *args, queue=ns.queue, priority=ns.priority,
                           idempotency_key=ns.idempotency_key)
    print(handle.id)
    if ns.wait is not None:
        print(json.dumps(handle.result(timeout=ns.wait)))
    return 0


def _parse_id(text: str) -> uuid.UUID:
    try:
        return uuid.UUID(text)
    except ValueError:
        raise ConfigError(f"{text!r} is not an execution id (a UUID)") from None


def cmd_show(cfg: Config, ns: argparse.Namespace) -> int:
    client, _server = _client(cfg)
    ex = client.get(_parse_id(ns.id))
    steps = client.steps(ex.id)
    if ns.json:
        data = {
            "id": str(ex.id), "workflow": ex.workflow, "status": ex.status.value,
            "queue": ex.queue, "attempts": ex.attempts, "args": ex.args, "result": ex.result,
            "error": ex.error, "created_at": ex.created_at.isoformat(),
            "finished_at": ex.finished_at.isoformat() if ex.finished_at else None,
            "steps": [{"step_id": s.step_id, "name": s.name, "attempt": s.attempt,
                       "duration_ms": _ms(s.finished_at - s.started_at), "output": s.output,
                       "error": s.error} for s in steps],
        }
        print(json.dumps(data, indent=2))
        return 0
    print(f"execution {ex.id}")
    print(f"  workflow  {ex.workflow}   queue {ex.queue}   status {ex.status.value}   "
          f"claims {ex.attempts}")
    print(f"  args      {json.dumps(ex.args)}")
    if ex.status.value == "completed":
        print(f"  result    {_short(ex.result)}")
    if ex.error:
        print(f"  error     {ex.error.get('type')}: {ex.error.get('message')}")
    print(f"  steps ({len(steps)}):")
    for s in steps:
        outcome = (f"error {s.error.get('type')}: {s.error.get('message')}" if s.error
                   else _short(s.output))
        print(f"    #{s.step_id:<3} {s.name:<32} attempt {s.attempt}  "
              f"{_ms(s.finished_at - s.started_at):>8.1f} ms  {outcome}")
    return 0


def _ms(delta: timedelta) -> float:
    return round(delta.total_seconds() * 1000, 1)


def _short(value: Any, width: int = 90) -> str:
    text = json.dumps(value)
    return text if len(text) <= width else text[: width - 1] + "…"


def cmd_stats(cfg: Config, ns: argparse.Namespace) -> int:
    client, _server = _client(cfg)
    counts = client.counts()
    if ns.json:
        print(json.dumps(counts))
        return 0
    print(f"{'status':<12} {'executions':>10}")
    for status in ("queued", "running", "waiting", "completed", "failed", "cancelled",
                   "quarantined"):
        print(f"{status:<12} {counts.get(status, 0):>10}")
    return 0


def cmd_demo(cfg: Config, ns: argparse.Namespace) -> int:
    from kestrel import demo

    return demo.run(cfg, incidents=ns.incidents)


COMMANDS = {
    "run": cmd_run,
    "migrate": cmd_migrate,
    "submit": cmd_submit,
    "show": cmd_show,
    "stats": cmd_stats,
    "demo": cmd_demo,
}

if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())

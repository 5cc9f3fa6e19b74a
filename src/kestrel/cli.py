"""``kestrel-runtime``: the runtime (no subcommand) and the operator commands.

Every operator command prints a readable table, or JSON with ``--json``; bad input (an id
that is not a UUID, JSON that does not parse, an unknown id) prints one line on stderr and
exits 1; an invalid setting exits 2.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import json
import logging
import os
import re
import sys
import textwrap
import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from kestrel import log as kestrel_log
from kestrel.config import KNOBS, Config, load, mask_dsn, tls_warning
from kestrel.embedded import resolve_dsn
from kestrel.errors import ConfigError, KestrelError
from kestrel.types import Execution
from kestrel.workflow import WorkflowFn, registry

log = logging.getLogger("kestrel.cli")

PRECEDENCE = ("Settings come from, highest first: a flag, the KESTREL_<NAME> environment "
              "variable (e.g. KESTREL_BATCH_SIZE), a key in the TOML file named by --config "
              "or KESTREL_CONFIG (top level or a [kestrel] table), the default. With no DSN "
              "and no PG* variables, an embedded PostgreSQL runs in --data-dir.")


CONNECTION = ("dsn", "schema", "connection_mode", "listen_dsn", "data_dir", "log_level",
              "log_format")
"""The settings every operator command uses: where the database is and how to log."""

HISTORY = ("history_interval", "history_ahead")
"""What ``migrate`` also needs: the history partitions it creates ahead."""

PAYLOAD = ("max_payload_bytes",)
"""What the commands that write a value (submit, signal) also need: the cap they check it
against before anything is written."""


def _settings(p: argparse.ArgumentParser, names: Sequence[str] | None = None,
              title: str = "settings") -> list[argparse.Action]:
    """Add the settings *names* (None: every knob) to *p*, after its own options.

    Each default is SUPPRESSed so that an unset flag leaves the environment and the config
    file to decide (see :func:`kestrel.config.load`).
    """
    g = p.add_argument_group(title, "Each is also a KESTREL_<NAME> environment variable and "
                                    "a key in the --config file.")
    added = [g.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS,
                            help="TOML file with settings (keys are the flag names with _).")]
    defaults = Config()
    for knob in KNOBS:
        if names is not None and knob.name not in names:
            continue
        default = getattr(defaults, knob.name)
        if isinstance(default, tuple):
            default = ",".join(default)
        shown = f" (default: {default})" if default not in (None, "") else ""
        added.append(g.add_argument(knob.flag, dest=knob.name, metavar=knob.metavar,
                                    type=knob.parse, default=argparse.SUPPRESS,
                                    help=f"{knob.help}{shown} [env {knob.env}]"))
    return added


def _json_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="Print JSON instead of a table.")


def _id_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("id", help="The execution's id (a UUID, as submit and list print it).")


def version() -> str:
    """This installation's version of kestrel-runtime."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("kestrel-runtime")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


class _Parser(argparse.ArgumentParser):
    """An unknown option is reported by the command it was typed for, with that command's
    usage and the closest options it has (argparse reports it at the top level, whose usage
    lists every runtime setting)."""

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        """Parse *args*; an unknown option exits 2 with its command's usage and a hint."""
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            parser: argparse.ArgumentParser = self
            for dest in ("command", "token_command"):
                found = _subcommand(parser, getattr(ns, dest, None))
                if found is None:
                    break
                parser = found
            options = [o for a in parser._actions for o in a.option_strings]
            close = [m for x in extras if x.startswith("-")
                     for m in difflib.get_close_matches(x.partition("=")[0], options, n=2)]
            hint = f" (did you mean {' or '.join(dict.fromkeys(close))}?)" if close else ""
            parser.error(f"unrecognized arguments: {' '.join(extras)}{hint}")
        return ns


def _subcommand(parser: argparse.ArgumentParser, name: str | None,
                ) -> argparse.ArgumentParser | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            found: argparse.ArgumentParser = action.choices[name]
            return found
    return None


def _epilog(*examples: str) -> str:
    """Examples, then where settings come from, for a command's --help (pre-wrapped)."""
    text = ""
    if examples:
        text = "examples:\n" + "\n".join(f"  {e}" for e in examples) + "\n\n"
    return text + textwrap.fill(PRECEDENCE, width=88)


def build_parser() -> argparse.ArgumentParser:
    """Return the ``kestrel-runtime`` argument parser.

    The runtime (no subcommand, or ``run``) takes every setting; each operator command takes
    only its own options and the connection settings (:data:`CONNECTION`), so its ``--help``
    shows what applies to it.
    """
    parser = _Parser(
        prog="kestrel-runtime",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        # A subcommand's option (submit --queue) must never be read as an abbreviation of
        # a setting (--queues, --queue-limits).
        allow_abbrev=False,
        description=textwrap.fill(
            "Durable workflows on PostgreSQL. Without a COMMAND, run the supervisor and "
            "--procs worker processes with the runtime settings (all of them: "
            "`kestrel-runtime run --help`).", width=88),
        epilog=_epilog("kestrel-runtime --app myapp.workflows --procs 4",
                       "kestrel-runtime submit greet --args '[\"Ada\"]' --wait 30",
                       "kestrel-runtime show EXECUTION_ID",
                       "kestrel-runtime COMMAND --help"),
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}",
                        help="Print the version and exit.")
    # The runtime's settings parse here too (no COMMAND means run), listed by `run --help`.
    for action in _settings(parser, title="runtime settings (when no COMMAND is given)"):
        action.help = argparse.SUPPRESS
    parser._action_groups[-1].description = "Every one is listed by `kestrel-runtime run " \
                                            "--help`."
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    later: list[tuple[argparse.ArgumentParser, list[argparse.Action]]] = []

    def add(name: str, help: str, settings: Sequence[str] | None = CONNECTION,
            examples: Sequence[str] = ()) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=textwrap.fill(help, width=88),
                           epilog=_epilog(*examples), allow_abbrev=False,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        later.append((p, _settings(p, settings)))
        return p

    add("run", "Run the supervisor and its workers (the default command).", None,
        ("kestrel-runtime run --app myapp.workflows --procs 4 --dsn postgresql://app@db/app",
         "KESTREL_APP=myapp.workflows kestrel-runtime --http-port 8080"))
    add("migrate", "Create or upgrade the schema (as its owner), then exit.",
        CONNECTION + HISTORY, ("kestrel-runtime migrate --dsn postgresql://owner@db/app",))

    s = add("submit", "Submit an execution; print its id.", CONNECTION + PAYLOAD,
            ("kestrel-runtime submit greet --args '[\"Ada\"]'",
             "kestrel-runtime submit deploy --args '[\"api\", 42]' --idempotency-key "
             "deploy-api-42 --wait 60"))
    s.add_argument("workflow", help="Registered workflow name (refused when live workers "
                                    "run and none runs it; see --allow-unknown).")
    s.add_argument("--allow-unknown", action="store_true",
                   help="Submit even if no live worker runs this workflow (one deployed "
                        "later will).")
    s.add_argument("--args", default="[]", help="JSON array of arguments (default: []).")
    s.add_argument("--queue", default="default", help="Queue to run it on (default: default).")
    s.add_argument("--priority", type=int, default=0, help="Higher runs first (default: 0).")
    s.add_argument("--idempotency-key", default=None, metavar="KEY",
                   help="Same key and arguments → the same execution, for ever.")
    s.add_argument("--dedup-key", default=None, metavar="KEY",
                   help="At most one live execution per key in the queue: a duplicate "
                        "returns the live one (or fails with --reject-duplicate).")
    s.add_argument("--reject-duplicate", action="store_true",
                   help="With --dedup-key: fail instead of returning the live execution.")
    when = s.add_mutually_exclusive_group()
    when.add_argument("--delay", type=float, default=None, metavar="SECONDS",
                      help="Do not start it before this many seconds from now.")
    when.add_argument("--start-at", default=None, metavar="ISO",
                      help="Do not start it before this time (ISO 8601, e.g. "
                           "2026-12-01T08:00:00Z; without a zone: UTC).")
    s.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="Deadline after which the execution ends failed.")
    s.add_argument("--wait", type=float, default=None, metavar="SECONDS",
                   help="Wait this long for the result and print it (exit 3 if it has not "
                        "finished by then).")
    _json_flag(s)

    ls = add("list", "List executions, newest first.", examples=(
        "kestrel-runtime list --status waiting", "kestrel-runtime list --workflow deploy "
        "--since 6h --json"))
    ls.add_argument("--status", help="queued, running, waiting, completed, failed, "
                                     "cancelled or quarantined.")
    ls.add_argument("--workflow", help="Only this workflow.")
    ls.add_argument("--since", help="Created since: an ISO time or an age like 30m, 6h, 7d.")
    ls.add_argument("--limit", type=int, default=50, help="Most rows shown (default: 50).")
    ls.add_argument("--app-version", metavar="V", default=argparse.SUPPRESS,
                    help="Only executions started by this application version.")
    ls.add_argument("--patch", metavar="ID", help="Only executions that recorded this patch.")
    ls.add_argument("--without-patch", metavar="ID", help="Only executions of the workflows "
                    "using this patch that did not record it (may need the old code path).")
    _json_flag(ls)
    _add_version_commands(add)

    show = add("show", "Show an execution: what it waits for, its deadline, its steps as a "
                       "timeline.", examples=("kestrel-runtime show EXECUTION_ID",
                                              "kestrel-runtime show EXECUTION_ID --wait 30"))
    _id_arg(show)
    show.add_argument("--wait", type=float, default=None, metavar="SECONDS",
                      help="First wait up to this long for it to finish (exit 3 if it has "
                           "not).")
    _json_flag(show)

    cancel = add("cancel", "Cancel a live execution and its children (exit 1 if it already "
                           "finished otherwise).", examples=("kestrel-runtime cancel "
                                                             "EXECUTION_ID",))
    _id_arg(cancel)
    _json_flag(cancel)

    retry = add("retry", "Re-run a failed, cancelled or quarantined execution from its last "
                         "checkpoint (exit 1 otherwise).",
                examples=("kestrel-runtime retry EXECUTION_ID --idempotency-key fix-1",))
    _id_arg(retry)
    retry.add_argument("--idempotency-key", default=None, metavar="KEY",
                       help="Run again with the same key after a connection error: a retry "
                            "that already happened is not an error.")
    _json_flag(retry)

    fork = add("fork", "Start a new execution of the same workflow and arguments that reuses "
                       "the first N checkpoints of another; print its id.",
               examples=("kestrel-runtime fork EXECUTION_ID --from-step 2",))
    _id_arg(fork)
    fork.add_argument("--from-step", type=int, required=True, metavar="N",
                      help="How many of its checkpoints (steps 0..N-1) to reuse; the new "
                           "execution runs from step N.")
    fork.add_argument("--idempotency-key", default=None, metavar="KEY",
                      help="Same key → the same fork: run again after a connection error "
                           "without making a second one.")
    _json_flag(fork)

    sig = add("signal", "Send a signal to an execution (e.g. an approval).",
              CONNECTION + PAYLOAD, ("kestrel-runtime signal EXECUTION_ID approval --payload "
                                     "'{\"approved\": true, \"by\": \"ada\"}'",))
    _id_arg(sig)
    sig.add_argument("name", help="The signal's name, as the workflow waits for it.")
    sig.add_argument("--payload", default="null", help="JSON payload (default: null).")
    sig.add_argument("--idempotency-key", default=None, metavar="KEY",
                     help="Send at most once per key.")
    _json_flag(sig)

    stats = add("stats", "Queue depth by queue and status, oldest queued age, running by "
                         "worker, totals.", examples=("kestrel-runtime stats --json",))
    dsn = add("dsn", "Print the DSN the commands use (with no --dsn: the embedded database in "
                     "--data-dir, while `kestrel-runtime run` keeps it up), for psql or Python.",
              examples=("psql \"$(kestrel-runtime dsn)\"",))
    dsn.add_argument("--json", action="store_true", help="Print JSON instead of a line.")
    _json_flag(stats)

    parts = add("partitions", "Create history partitions ahead and drop those past the "
                              "retention now (as the schema owner; the runtime also does this "
                              "every --maintenance-interval).",
                CONNECTION + HISTORY + ("history_retention_days",))
    parts.add_argument("--detach", action="store_true",
                       help="Detach expired partitions instead of dropping them.")
    _json_flag(parts)
    # -- the HTTP door (kestrel.http) --
    add("serve", "Serve the HTTP API and webhooks on --http-host:--http-port (default "
                 "127.0.0.1:8080); needs --app, hooks come from [hooks.NAME] in --config; "
                 "with --metrics-port, its HTTP metrics on /metrics there.",
        None)
    tok = add("token", "Manage HTTP API tokens: create (printed once), list, revoke.",
              examples=("kestrel-runtime token create --name ci --scopes submit,read",
                        "kestrel-runtime token revoke ci"))
    tsub = tok.add_subparsers(dest="token_command", metavar="ACTION", required=True)

    def add_token(name: str, help: str) -> argparse.ArgumentParser:
        p = tsub.add_parser(name, help=help, description=help, allow_abbrev=False)
        later.append((p, _settings(p, CONNECTION)))
        return p

    tc = add_token("create", "Create a token; print it once (only its hash is stored).")
    tc.add_argument("--name", required=True, help="A name to know it by (unique while live).")
    tc.add_argument("--scopes", required=True, help="Comma-separated: read, operate, submit.")
    _json_flag(tc)
    _json_flag(add_token("list", "List tokens: ids, names, scopes (never secrets)."))
    tr = add_token("revoke", "Revoke a token by name or id; it is refused at once.")
    tr.add_argument("token", help="The token's name or public id.")
    _json_flag(tr)

    _add_replay_commands(add)

    demo = add("demo", "Run the incident-response demo end to end on the embedded database.",
               None)
    demo.add_argument("--incidents", type=int, default=12,
                      help="How many incidents the demo submits (default: 12).")
    for p, settings in later:  # the usage line too: a command's own options first
        p._actions = [a for a in p._actions if a not in settings] + settings
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


class NotFinished(KestrelError):
    """``submit --wait`` or ``show --wait`` ran out of time; the execution goes on."""


EXIT_NOT_FINISHED = 3
"""Exit status of ``submit --wait``/``show --wait`` when the execution has not finished."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kestrel-runtime`` with *argv* (default ``sys.argv[1:]``); return the exit status.

    An invalid setting returns 2 (1 when an operator command finds it: bad input there); a
    kestrel error, a ValueError or a database error returns 1; a ``--wait`` that ran out
    returns 3. Each prints one line on stderr that names the problem and the fix
    (:func:`describe_db_error` for the database's).
    """
    parser = build_parser()
    ns = parser.parse_args(argv)
    command = ns.command or "run"
    try:
        cfg = config_from_args(ns)
    except ConfigError as exc:
        print(f"kestrel-runtime {command}: {exc}", file=sys.stderr)
        return 2
    kestrel_log.setup(cfg.log_level, cfg.log_format)
    try:
        return COMMANDS[command](cfg, ns)
    except ConfigError as exc:
        print(f"kestrel-runtime {command}: {_line(exc)}", file=sys.stderr)
        return 2 if command == "run" else 1
    except NotFinished as exc:
        print(f"kestrel-runtime {command}: {_line(exc)}", file=sys.stderr)
        return EXIT_NOT_FINISHED
    except (KestrelError, ValueError) as exc:
        print(f"kestrel-runtime {command}: {_line(exc)}", file=sys.stderr)
        return 1
    except psycopg.Error as exc:
        print(f"kestrel-runtime {command}: {describe_db_error(exc, command, cfg)}",
              file=sys.stderr)
        return 1
    except BrokenPipeError:
        # `kestrel-runtime list | head`: the reader left. Python's documented remedy: point
        # stdout at /dev/null so that flushing it at exit raises no second error.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _line(exc: BaseException) -> str:
    """*exc*'s message as one line: libpq and PostgreSQL add hints and context on lines of
    their own (``\tIs the server running…``, ``LINE 1: …``)."""
    return "; ".join(part.strip() for part in str(exc).strip().splitlines() if part.strip()
                     and not part.lstrip().startswith(("LINE ", "^")))


_OWNER_COMMANDS = ("run", "migrate", "partitions", "demo")


def describe_db_error(exc: psycopg.Error, command: str, cfg: Config) -> str:
    """One line for a database error: what went wrong, in the server's or libpq's words
    (which never carry the password), and what to do about it."""
    from psycopg import errors as e

    what = _line(exc)
    schema = cfg.schema
    if isinstance(exc, e.UndefinedTable | e.InvalidSchemaName | e.UndefinedFunction
                  | e.UndefinedColumn):
        what = str(exc).strip().splitlines()[0]  # not the HINT about casts
        older = "" if isinstance(exc, e.UndefinedTable | e.InvalidSchemaName) else (
            " or an older version of them")  # tables there, this code's functions not
        return (f"schema {schema} has no kestrel tables{older} ({what}): run `kestrel-runtime "
                f"migrate --schema {schema}` as the schema owner, or name the right schema "
                "with --schema / KESTREL_SCHEMA")
    if isinstance(exc, e.InsufficientPrivilege):
        if command in _OWNER_COMMANDS:
            return (f"permission denied ({what}): `{command}` creates tables and partitions; "
                    "run it as the owner of the schema (or a role that may CREATE in the "
                    "database), and the runtime under a role with the grants in the README")
        return (f"permission denied ({what}): grant this role the runtime's rights on schema "
                f"{schema} (README, \"Least privilege\")")
    if isinstance(exc, psycopg.OperationalError):
        state = exc.sqlstate or ""
        if state[:2] in ("", "08", "28") or state in ("57P01", "57P02", "57P03"):
            # Unreachable, refused, shut down, or not the server the DSN verifies.
            return (f"cannot connect to the database: {what} (check --dsn / KESTREL_DSN and "
                    "that the server is running)")
        return f"database error: {what}"
    if isinstance(exc, psycopg.ProgrammingError) and exc.sqlstate is None:
        # psycopg's own, before any server was reached: a conninfo that does not parse.
        return (f"invalid --dsn / KESTREL_DSN: {what} (use a URL like "
                "postgresql://user@host:5432/dbname or key=value pairs like "
                "'host=… dbname=…')")
    state = f" [SQLSTATE {exc.sqlstate}]" if exc.sqlstate else ""
    return f"database error: {what}{state}"


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
    http = None
    if cfg.http_port:  # the HTTP door, in a child process of its own (kestrel.http)
        import functools

        from kestrel.http.hooks import load_hooks
        from kestrel.http.server import serve

        hooks = load_hooks(getattr(ns, "config", None) or os.environ.get("KESTREL_CONFIG"))
        http = functools.partial(serve, cfg, dsn=dsn, workflows=list(workflows), hooks=hooks)
    try:
        code = Supervisor(cfg, workflows, dsn=dsn, http=http).run()
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

    dsn, _server = resolve_dsn(cfg, create=False)
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

    dsn, server = resolve_dsn(cfg, create=False)
    # One command, one or two statements: no pool to keep open.
    client = SyncClient(dsn, schema=cfg.schema, max_payload_bytes=cfg.max_payload_bytes,
                        pool_size=0, connection_mode=cfg.connection_mode,
                        listen_dsn=cfg.listen_dsn or None)
    return client, server


def _json_arg(text: str, flag: str) -> Any:
    """*text* read by the decoder of every door (:func:`kestrel.codec.decode_exact`): a
    number that would not reach the workflow unchanged is refused, never rounded."""
    from kestrel import codec

    try:
        return codec.decode_exact(text)
    except ValueError as exc:
        raise ConfigError(f"{flag} is not valid JSON: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{flag} is not valid JSON: nested too deeply") from None


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

    With ``--wait`` the id is printed (and flushed) before the wait, so it is never lost; a
    wait that runs out says how to wait again and exits :data:`EXIT_NOT_FINISHED`.

    Raises:
        ConfigError: ``--args`` is not a JSON array, ``--start-at`` not an ISO time.
        NotFinished: ``--wait`` ran out.
    """
    args = _json_arg(ns.args, "--args")
    if not isinstance(args, list):
        raise ConfigError("--args must be a JSON array, e.g. '[1, \"two\"]'")
    start_at = _iso(ns.start_at, "--start-at") if ns.start_at is not None else None
    client, _server = _client(cfg)
    note = None if ns.allow_unknown else _check_workflow(client, ns.workflow)
    handle = client.submit(ns.workflow, *args, queue=ns.queue, priority=ns.priority,
                           idempotency_key=ns.idempotency_key, timeout=ns.timeout,
                           delay=ns.delay, start_at=start_at, dedup_key=ns.dedup_key,
                           on_duplicate="reject" if ns.reject_duplicate else "return")
    if note is not None and _interactive():
        print(f"kestrel-runtime submit: note: {note}", file=sys.stderr)
    if ns.wait is None:
        return _emit(ns, {"id": str(handle.id)}, lambda: print(handle.id))
    if not ns.json:
        print(handle.id, flush=True)
    result = _wait_for(client, handle.id, ns.wait, json_id=ns.json)

    def table() -> None:
        print(json.dumps(result))

    return _emit(ns, {"id": str(handle.id), "result": result}, table)


def _check_workflow(client: Any, name: str) -> str | None:
    """Refuse *name* when workers are live and none runs it: a typo would queue for ever
    (the HTTP door answers 404). With no live worker at all, return a note saying what it
    will wait for (workers may be deployed after the submit).

    Raises:
        ConfigError: live workers run other workflows only.
    """
    live = client.workers()
    known = sorted({w for worker in live for w in worker.workflows})
    if name in known:
        return None
    if not live:
        return f"no worker is running; the execution waits until one that runs {name!r} " \
               "claims it"
    close = difflib.get_close_matches(name, known, n=3)
    hint = (f"did you mean {' or '.join(map(repr, close))}?" if close else
            f"they run {', '.join(map(repr, known[:12]))}{' …' if len(known) > 12 else ''}")
    raise ConfigError(f"no live worker runs workflow {name!r}, so it would wait for ever: "
                      f"{hint} (--allow-unknown submits it anyway, for workers deployed "
                      "later)")


def _interactive() -> bool:
    """Whether a person reads stderr (notes are for them; scripts get one line or none)."""
    return sys.stderr.isatty()


def _wait_for(client: Any, eid: uuid.UUID, seconds: float, *, json_id: bool) -> Any:
    """The result of *eid* within *seconds*.

    Raises:
        NotFinished: it has not finished by then (with ``--json``, ``{"id": …}`` is printed
            first, so the id is never lost).
        WorkflowFailed: it ended failed, cancelled or quarantined.
    """
    try:
        return client.result(eid, timeout=seconds)
    except TimeoutError:
        if json_id:
            print(json.dumps({"id": str(eid), "finished": False}), flush=True)
        raise NotFinished(f"execution {eid} has not finished after {seconds:g}s; it goes "
                          f"on: wait again with `kestrel-runtime show {eid} --wait SECONDS`"
                          ) from None


def _iso(text: str, flag: str) -> datetime:
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: use an ISO 8601 time such as "
                          "2026-12-01T08:00:00Z") from None
    return when if when.tzinfo else when.replace(tzinfo=UTC)


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
    """``kestrel-runtime show``: print one execution and its steps as a timeline.

    A live execution also says what it waits for (a signal, a child, the end of a sleep, its
    delayed start, a worker or a slot in its limited queue) and when the wait times out; any
    execution with a deadline shows it. ``--wait`` first waits for it to finish.

    Raises:
        NotFinished: ``--wait`` ran out (the execution is shown first).
    """
    client, _server = _client(cfg)
    eid = _parse_id(ns.id)
    late: NotFinished | None = None
    if ns.wait is not None:
        try:
            client.result(eid, timeout=ns.wait)
        except TimeoutError:
            late = NotFinished(f"execution {eid} has not finished after {ns.wait:g}s; it "
                               f"goes on: wait again with `kestrel-runtime show {eid} --wait "
                               "SECONDS`")
        except KestrelError:
            pass  # it ended failed, cancelled or quarantined: shown below
    ex = client.get(eid)
    # Patch markers (negative ids) in the place they mark: before the position in "at".
    steps = sorted(client.steps(ex.id), key=lambda s: (
        _marked_at(s) if s.step_id < 0 else s.step_id, 0 if s.step_id < 0 else 1))
    waits = waits_for(ex)
    forked = client.forked_from(ex.id)
    data = {
        "id": ex.id, "workflow": ex.workflow, "status": ex.status.value, "queue": ex.queue,
        "claims": ex.attempts, "args": ex.args, "result": ex.result, "error": ex.error,
        "created_at": ex.created_at, "started_at": ex.started_at,
        "finished_at": ex.finished_at, "deadline": ex.deadline, "waits_for": waits,
        "give_backs": ex.give_backs, "given_back_by": ex.given_back_by,
        "given_back_at": ex.given_back_at,
        "forked_from": ({"id": forked[0], "from_step": forked[1]} if forked else None),
        "steps": [{"step_id": s.step_id, "name": s.name, "attempt": s.attempt,
                   "duration_ms": _ms(s.finished_at - s.started_at), "output": s.output,
                   "error": s.error} for s in steps],
    }

    def table() -> None:
        print(f"execution {ex.id}")
        print(f"  workflow  {ex.workflow}   queue {ex.queue}   status {ex.status.value}")
        print(f"  args      {_short(ex.args)}")
        if forked is not None:
            print(f"  forked from {forked[0]} (its steps 0..{forked[1] - 1} reused)"
                  if forked[1] else f"  forked from {forked[0]} (from the start)")
        if waits is not None:
            print(f"  waits for {waits['what']}"
                  + (f"   until {_when(waits['until'])}" if waits.get("until") else ""))
        if ex.give_backs:
            print(f"  given back {ex.give_backs} time(s) by app version(s) "
                  f"{', '.join(ex.given_back_by or [])} (their code is older than its history;"
                  " they never claim it again)")
        if ex.deadline is not None:
            print(f"  deadline  {_when(ex.deadline)}"
                  + ("   (fails then unless finished)" if not ex.status.terminal else ""))
        if ex.status.value == "completed":
            print(f"  result    {_short(ex.result)}")
        if ex.error:
            print(f"  error     {ex.error.get('type')}: {ex.error.get('message')}")
        print(f"  steps ({len(steps)}):")
        for s in steps:
            # A fork's copied checkpoints ran before the fork existed: "reused", not a
            # negative offset.
            at = _ms(s.started_at - ex.created_at) / 1000
            when = f"+{at:7.2f}s" if at >= 0 else f"{'reused':>9}"
            if s.step_id < 0:  # a patch marker: where new code took its new path
                print(f"    patch {when}  {s.name[:34]:<34} new code's path from step "
                      f"{_marked_at(s)} on")
                continue
            outcome = (f"error {s.error.get('type')}: {s.error.get('message')}" if s.error
                       else _short(s.output, 60))
            print(f"    #{s.step_id:<3} {when}  {s.name[:34]:<34} "
                  f"try {s.attempt}  {_ms(s.finished_at - s.started_at):>8.1f} ms  {outcome}")

    _emit(ns, data, table)
    if late is not None:
        raise late
    return 0


def _marked_at(step: Any) -> int:
    """The position a patch marker (a step with a negative id) was recorded at."""
    at = step.output.get("at") if isinstance(step.output, dict) else None
    return at if isinstance(at, int) else 0


def waits_for(ex: Execution) -> dict[str, Any] | None:
    """What a live execution waits for: ``{"kind", "what", "until"}``, or None.

    *kind* is ``signal``, ``child``, ``sleep``, ``start`` (a delayed start), ``worker`` (queued),
    ``slot`` (queued in a limited queue) or ``version`` (given back by workers whose code is
    older than its history, it waits for a worker of another app version); a wait's
    ``waiting_for`` is the signal's name, or ``kestrel.sleep`` / ``kestrel.child:<id>`` (see
    :mod:`kestrel.workflow`). *until* is when the wait ends by itself (a sleep's end, a
    delayed start, a give-back's backoff) or times out (a signal wait's timeout), if ever.
    """
    status = ex.status.value
    if status == "queued":
        if ex.queue_limit:
            return {"kind": "slot", "what": f"a slot in queue {ex.queue!r} "
                                            f"({ex.queue_limit})", "until": None}
        return {"kind": "worker", "what": f"a worker claiming queue {ex.queue!r}",
                "until": None}
    if status != "waiting":
        return None
    if ex.given_back_at is not None:
        versions = ", ".join(ex.given_back_by or [])
        return {"kind": "version", "what": f"a worker of an app version other than {versions} "
                                           f"(given back {ex.give_backs} time(s))",
                "until": ex.wake_at}
    on = ex.waiting_for
    if on is None:
        return {"kind": "start", "what": "its delayed start", "until": ex.wake_at}
    if on == "kestrel.sleep":
        return {"kind": "sleep", "what": "the end of a durable sleep", "until": ex.wake_at}
    if on.startswith("kestrel.child:"):  # a child's outcome arrives as this signal
        return {"kind": "child", "what": f"child execution {on.removeprefix('kestrel.child:')}",
                "until": ex.wait_deadline}
    return {"kind": "signal", "what": f"signal {on!r} (kestrel-runtime signal {ex.id} "
                                      f"{_shell_word(on)} --payload 'JSON')",
            "until": ex.wait_deadline}


def _shell_word(text: str) -> str:
    import shlex

    return shlex.quote(text)


def _when(value: datetime) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def cmd_cancel(cfg: Config, ns: argparse.Namespace) -> int:
    """``kestrel-runtime cancel``: cancel an execution and print what that did.

    It was cancelled now, stops at its next step boundary (it is running), or had been
    cancelled already (exit 0: cancelling is idempotent).

    Raises:
        InvalidState: it had already completed, failed or been quarantined: nothing to
            cancel (as ``retry`` of an execution it cannot re-run).
    """
    from kestrel.errors import InvalidState

    client, _server = _client(cfg)
    eid = _parse_id(ns.id)
    status = client.cancel(eid)
    if status not in ("cancelled", "cancelling"):
        raise InvalidState(f"execution {eid} already {status}; only a queued, running or "
                           "waiting execution can be cancelled")
    note = ("cancelled" if status == "cancelled" else
            "running: it stops at its next step boundary")
    return _emit(ns, {"id": eid, "status": status}, lambda: print(f"{eid}: {note}"))


def cmd_retry(cfg: Config, ns: argparse.Namespace) -> int:
    """``kestrel-runtime retry``: queue a failed, cancelled or quarantined execution again.

    It resumes from its last checkpoint.

    Raises:
        InvalidState: it is live or completed.
    """
    client, _server = _client(cfg)
    eid = _parse_id(ns.id)
    client.retry(eid, idempotency_key=ns.idempotency_key)
    return _emit(ns, {"id": eid, "status": "queued"},
                 lambda: print(f"{eid}: queued again; it resumes from its last checkpoint"))


def cmd_fork(cfg: Config, ns: argparse.Namespace) -> int:
    """``kestrel-runtime fork``: start a new execution from the first ``--from-step``
    checkpoints of another; print the new id."""
    client, _server = _client(cfg)
    eid = _parse_id(ns.id)
    if ns.from_step < 0:
        raise ConfigError(f"--from-step must be 0 or more, got {ns.from_step}")
    handle = client.fork(eid, ns.from_step, idempotency_key=ns.idempotency_key)
    return _emit(ns, {"id": handle.id, "forked_from": eid, "from_step": ns.from_step},
                 lambda: print(handle.id))


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
    ex = client.get(eid)
    waiting = (ex.waiting_for if ex.status.value == "waiting" and ex.waiting_for
               and not ex.waiting_for.startswith("kestrel.") else None)
    if ex.status.terminal:
        print(f"kestrel-runtime signal: note: execution {eid} has {ex.status.value}; "
              "nothing will take this signal", file=sys.stderr)
    elif waiting is not None and waiting != ns.name:
        print(f"kestrel-runtime signal: note: execution {eid} waits for signal "
              f"{waiting!r}, not {ns.name!r}; this one is kept for a later "
              f"wait_for_signal({ns.name!r}), if the workflow has one", file=sys.stderr)
    return _emit(ns, {"id": eid, "signal": ns.name, "delivered": sent,
                      "status": ex.status.value, "waiting_for": waiting}, lambda: print(msg))


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
                            "their workflow and queue, or every one that does runs an app "
                            "version that gave them back): they wait, unfailed; and the live "
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
                             "oldest_created_at": g.oldest_created_at,
                             "given_back_by": g.given_back_by} for g in groups],
            "workers": [{"worker_id": w.worker_id, "app_version": w.app_version,
                         "workflows": w.workflows, "queues": w.queues,
                         "seen_at": w.seen_at} for w in workers]}

    def table() -> None:
        print(f"{'workflow':<32} {'queue':<16} {'count':>8}  {'oldest':<19}  given back by")
        for g in groups:
            print(f"{g.workflow[:32]!s:<32} {g.queue[:16]:<16} {g.count:>8}  "
                  f"{g.oldest_created_at:%Y-%m-%d %H:%M:%S}  "
                  f"{', '.join(g.given_back_by) if g.given_back_by else '-'}")
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
    return _emit(ns, {"dsn": dsn}, lambda: print(dsn))


# -- replay before deploy (issue 27) ----------------------------------------------------------

EXIT_DIVERGED = 4
"""Exit status of ``replay`` when the new code would break a recorded execution."""

_REPLAY_EPILOG = """\
Each selected execution's recorded history is run through the workflows of --app with a
read-only writer: nothing is written to the database, no step body runs. A position the
history holds returns its recorded output, through the same checks a worker makes when it
claims the execution (NonDeterminismError, CodeTooOld); the replay of that execution ends
at the first position the history does not hold. One line per execution says:

  same path                       the code takes the recorded path
  takes the new path after patch  a ctx.patched(ID) the recording never reached answers True
  diverges at step N              recorded `a` at N, the code calls `b` there
  needs newer code                the history holds a patch marker this code does not know
  the workflow raises             workflow code fails where the execution did not
  not in the app                  no workflow of that name in --app (fails if live)

exit status: 0 nothing breaks; 4 the new code would break at least one live or completed
execution (a FAIL line); 1 bad input (a --from file that is not histories, an unknown
--id) or the database cannot be read; 2 an invalid setting.

examples:
  kestrel-runtime replay --app myapp.workflows --dsn postgresql://ro@prod/app --limit 500
  kestrel-runtime replay --app myapp.workflows --id 0b9f6c1e-… --id 7d2a…
  kestrel-runtime export-histories --dsn … --workflow incident_response --out h.jsonl
  kestrel-runtime replay --app myapp.workflows --from h.jsonl      # CI: no database
"""

_EXPORT_EPILOG = """\
Writes one JSON object per line (format kestrel-history/1): id, workflow, status,
app_version, created_at, args, the checkpoints as [step_id, name, output, error] (patch
markers at negative ids, waits as kestrel.sleep / kestrel.signal:NAME), and for a parked
execution wait_step and waiting_for. `kestrel-runtime replay --from FILE` and
kestrel.testing.replay(FILE) read it without a database. The file holds arguments and
step outputs: keep it where a database dump may be kept. Reads in one read-only snapshot.

example:
  kestrel-runtime export-histories --dsn postgresql://ro@prod/app --limit 1000 \\
      --out tests/histories/prod.jsonl
"""


def _add_selection(p: argparse.ArgumentParser, default_limit: str) -> None:
    p.add_argument("--id", action="append", default=[], metavar="ID", dest="ids",
                   help="Only this execution (repeatable).")
    p.add_argument("--workflow", help="Only executions of this workflow.")
    p.add_argument("--status", help="Only executions in this status (queued, running, "
                                    "waiting, completed, failed, cancelled, quarantined).")
    p.add_argument("--since", help="Created since: an ISO time or an age like 30m, 6h, 7d.")
    p.add_argument("--limit", type=int, default=None,
                   help=f"Newest executions read, live and finished ({default_limit}).")


def _add_replay_commands(add: Callable[..., argparse.ArgumentParser]) -> None:
    rp = add("replay", "Replay recorded executions through new workflow code before a "
                       "deploy, writing nothing; exit 4 if the new code would break one.",
             (*CONNECTION, "app", "max_history_bytes", "max_payload_bytes"))
    rp.description = ("Replay recorded executions through new workflow code before a deploy,\n"
                      "writing nothing; exit 4 if the new code would break one.")
    rp.epilog = _REPLAY_EPILOG
    rp.formatter_class = argparse.RawDescriptionHelpFormatter
    rp.add_argument("--from", dest="source", metavar="FILE", default=None,
                    help="Read histories from this file (export-histories; - for stdin) "
                         "instead of the database.")
    _add_selection(rp, "default: 100 from the database, all of a --from file")
    rp.add_argument("--timeout", type=float, default=30.0, metavar="SECONDS",
                    help="Most seconds one execution's replay may take (default: 30).")
    _json_flag(rp)
    ex = add("export-histories", "Write recorded histories to a JSON-lines file that "
                                 "`replay --from` and kestrel.testing.replay read.",
             (*CONNECTION, "max_history_bytes"))
    ex.description = ("Write recorded histories to a JSON-lines file that `replay --from` and\n"
                      "kestrel.testing.replay read.")
    ex.epilog = _EXPORT_EPILOG
    ex.formatter_class = argparse.RawDescriptionHelpFormatter
    ex.add_argument("--out", required=True, metavar="FILE",
                    help="The file to write (replaced once complete); - for stdout.")
    _add_selection(ex, "default: 100")


def _selection(ns: argparse.Namespace) -> Any:
    from kestrel.replay import Selection, check_selection

    sel = Selection(ids=tuple(dict.fromkeys(_parse_id(i) for i in ns.ids)),
                    workflow=ns.workflow,
                    status=ns.status, since=_since(ns.since), limit=ns.limit)
    check_selection(sel)
    return sel


def cmd_replay(cfg: Config, ns: argparse.Namespace) -> int:
    """``kestrel-runtime replay``: replay recorded histories through the code of ``--app``;
    print one line per execution and a summary; return :data:`EXIT_DIVERGED` if any would
    break (see ``--help``).

    Raises:
        ConfigError: --app is unset, a selection option is invalid, the file cannot be read.
        HistoryFileError: a line of the --from file is not a history.
        ExecutionNotFound: an --id names no execution.
    """
    import asyncio
    from itertools import islice

    from kestrel import replay
    from kestrel.errors import ExecutionNotFound

    if not cfg.app:
        raise ConfigError("invalid setting --app / KESTREL_APP: name the module(s) with the "
                          "new workflow code, e.g. --app myapp.workflows")
    if not (0 < ns.timeout <= 3600):
        raise ConfigError(f"--timeout {ns.timeout:g}: must be over 0 and at most 3600")
    sel = _selection(ns)
    workflows = import_app(cfg.app)
    if not workflows:
        raise ConfigError(f"invalid setting --app={cfg.app!r}: it registers no workflows")

    def histories() -> Any:
        if ns.source is None:
            dsn, server = resolve_dsn(cfg, create=False)
            try:
                yield from replay.histories_from_db(dsn, cfg.schema, sel,
                                                    max_history_bytes=cfg.max_history_bytes)
            finally:
                del server
            return
        limit = replay.line_limit(cfg.max_history_bytes, cfg.max_payload_bytes)
        with _open_source(ns.source) as f:
            found = (h for h in replay.read_histories(f, name=ns.source, max_line_bytes=limit)
                     if sel.matches(h))
            yield from islice(found, sel.limit)

    results: list[Any] = []

    async def run_all() -> None:
        for h in histories():
            r = await replay.replay_one(h, workflows, timeout=ns.timeout)
            results.append(r)
            if not ns.json:
                print(r.line, flush=True)

    asyncio.run(run_all())
    missing = set(sel.ids) - {r.id for r in results}
    if missing:  # from a file: an --id it does not hold (the database says so itself)
        raise ExecutionNotFound(f"no execution {min(missing)} in {ns.source}")
    if ns.json:
        print(json.dumps({"results": [r.as_dict() for r in results],
                          "failed": sum(1 for r in results if r.failed)}, indent=2))
    else:
        print(replay.summary(results))
    return EXIT_DIVERGED if any(r.failed for r in results) else 0


def _open_source(path: str) -> Any:
    import contextlib

    if path == "-":
        return contextlib.nullcontext(sys.stdin.buffer)
    try:
        return open(path, "rb")  # returned to a with
    except OSError as exc:
        raise ConfigError(f"--from {path}: cannot read it ({exc.strerror})") from None


def cmd_export_histories(cfg: Config, ns: argparse.Namespace) -> int:
    """``kestrel-runtime export-histories``: write the selected histories as JSON lines.

    The file is written beside its final name and renamed when complete, so a failed export
    never leaves half a file where CI reads one.
    """
    from kestrel import replay

    sel = _selection(ns)
    dsn, server = resolve_dsn(cfg, create=False)
    found = replay.histories_from_db(dsn, cfg.schema, sel,
                                     max_history_bytes=cfg.max_history_bytes)
    count = 0
    if ns.out == "-":
        for h in found:
            replay.write_history(sys.stdout.buffer, h)
            count += 1
        sys.stdout.buffer.flush()
    else:
        tmp = f"{ns.out}.tmp-{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                for h in found:
                    replay.write_history(f, h)
                    count += 1
            os.replace(tmp, ns.out)
        except OSError as exc:
            raise ConfigError(f"--out {ns.out}: cannot write it ({exc.strerror})") from None
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    print(f"wrote {count} histor{'y' if count == 1 else 'ies'} to {ns.out}", file=sys.stderr)
    del server
    return 0


def cmd_demo(cfg: Config, ns: argparse.Namespace) -> int:
    """``kestrel-runtime demo``: run the incident-response demo; return its exit status.

    See :func:`kestrel.demo.run`. At the default log level the runtime's info logs are quieted.
    """
    from kestrel import demo

    if cfg.log_level == "info":  # the demo narrates; keep the runtime's own logs quiet
        kestrel_log.setup("warning", cfg.log_format)
    return demo.run(cfg, incidents=ns.incidents)


def cmd_serve(cfg: Config, ns: argparse.Namespace) -> int:
    """``kestrel-runtime serve``: serve the HTTP API (see :mod:`kestrel.http`) until SIGTERM.

    Raises:
        ConfigError: --app is unset, or a [hooks.NAME] table is invalid.
        MigrationError: the schema is not at this code's version and this role may not
            migrate it.
    """
    from psycopg.errors import InsufficientPrivilege

    from kestrel.http.hooks import load_hooks
    from kestrel.http.server import serve
    from kestrel.migrate import migrate

    if not cfg.app:
        raise ConfigError("invalid setting --app / KESTREL_APP: serve accepts the workflows "
                          "that module registers, e.g. --app myapp.workflows")
    workflows = import_app(cfg.app)
    hooks = load_hooks(getattr(ns, "config", None) or os.environ.get("KESTREL_CONFIG"))
    dsn, server = resolve_dsn(cfg)
    if (warning := tls_warning(dsn)) is not None:
        log.warning("%s", warning)
    try:
        migrate(dsn, cfg.schema, history_interval=cfg.history_interval,
                history_ahead=cfg.history_ahead)
    except InsufficientPrivilege:
        check_schema_current(dsn, cfg.schema)
    serve(cfg, dsn=dsn, workflows=list(workflows), hooks=hooks, own_metrics=True)
    del server
    return 0


def cmd_token(cfg: Config, ns: argparse.Namespace) -> int:
    """``kestrel-runtime token create|list|revoke``: manage HTTP API tokens."""
    from kestrel.http.commands import token_command

    dsn, _server = resolve_dsn(cfg, create=False)
    data, text = token_command(cfg, dsn, ns.token_command, vars(ns))
    return _emit(ns, data, lambda: print(text))


COMMANDS: dict[str, Callable[[Config, argparse.Namespace], int]] = {
    "run": cmd_run,
    "migrate": cmd_migrate,
    "submit": cmd_submit,
    "list": cmd_list,
    "show": cmd_show,
    "cancel": cmd_cancel,
    "retry": cmd_retry,
    "fork": cmd_fork,
    "signal": cmd_signal,
    "stats": cmd_stats,
    "dsn": cmd_dsn,
    "partitions": cmd_partitions,
    "demo": cmd_demo,
    "unclaimable": cmd_unclaimable,
    "patches": cmd_patches,
    "serve": cmd_serve,
    "token": cmd_token,
    "replay": cmd_replay,
    "export-histories": cmd_export_histories,
}

if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())

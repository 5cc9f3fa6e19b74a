"""``kestrel-runtime``: the runtime (no subcommand) and the operator commands.

Every operator command prints a readable table, or JSON with ``--json``; bad input (an id
that is not a UUID, JSON that does not parse, an unknown id) prints one line on stderr and
exits 1; an invalid setting exits 2.

Each command lives in a module of this package with its options beside its handler, declared
as a :class:`~kestrel.cli.common.Command`: ``runtime`` (run, serve, migrate, partitions, dsn,
demo; the boot sequence itself is :mod:`kestrel.boot`), ``executions`` (submit, list, show,
cancel, retry, fork, signal, stats), ``versions`` (unclaimable, patches), ``replay`` (replay,
export-histories) and ``tokens`` (token). :data:`TABLE` registers them; this module parses,
loads the settings and maps errors to exit statuses.
"""

from __future__ import annotations

import argparse
import difflib
import sys
import textwrap
from collections.abc import Callable, Sequence

import psycopg

from kestrel import log as kestrel_log
from kestrel.boot import check_schema_current, import_app, upkeep
from kestrel.cli import executions, replay, runtime, tokens, versions
from kestrel.cli.common import (
    CONNECTION,
    EXIT_NOT_FINISHED,
    HISTORY,
    NAMESPACE,
    PAYLOAD,
    PRECEDENCE,
    Command,
    NotFinished,
    add_settings,
    epilog,
)
from kestrel.cli.executions import waits_for
from kestrel.cli.replay import EXIT_DIVERGED
from kestrel.config import KNOBS, Config, load
from kestrel.embedded import resolve_dsn
from kestrel.errors import ConfigError, KestrelError

__all__ = ["COMMANDS", "CONNECTION", "EXIT_DIVERGED", "EXIT_NOT_FINISHED", "HISTORY",
           "NAMESPACE", "PAYLOAD", "PRECEDENCE", "TABLE", "NotFinished", "build_parser",
           "check_schema_current", "config_from_args", "describe_db_error", "import_app",
           "kestrel_log", "main", "resolve_dsn", "upkeep", "version", "waits_for"]

TABLE: tuple[Command, ...] = (
    runtime.RUN, runtime.MIGRATE,
    executions.SUBMIT, executions.LIST,
    versions.UNCLAIMABLE, versions.PATCHES, versions.REMOVE_LIMITS,
    executions.SHOW, executions.CANCEL, executions.RETRY, executions.FORK, executions.SIGNAL,
    executions.STATS,
    runtime.DSN, runtime.PARTITIONS,
    runtime.SERVE_COMMAND,  # the HTTP door (kestrel.http)
    tokens.TOKEN,
    replay.REPLAY, replay.EXPORT_HISTORIES,
    runtime.DASHBOARD, runtime.DEMO,
)
"""Every command, in the order ``kestrel-runtime --help`` lists them. A new command is a
:class:`~kestrel.cli.common.Command` in its module, added here."""

COMMANDS: dict[str, Callable[[Config, argparse.Namespace], int]] = {
    c.name: c.run for c in TABLE if c.run is not None}
"""Each command's handler by name (``main`` runs ``COMMANDS[command](cfg, ns)``)."""


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
                     for m in _closest(x.partition("=")[0], options)]
            hint = f" (did you mean {' or '.join(dict.fromkeys(close))}?)" if close else ""
            parser.error(f"unrecognized arguments: {' '.join(extras)}{hint}")
        return ns


def _closest(typed: str, options: Sequence[str]) -> list[str]:
    """The options *typed* most likely meant: the closest, and a second only when it is
    nearly as close (``--jsn``: ``--json`` or ``--dsn``; ``--qeue``: ``--queue``, not also
    ``--debounce``)."""
    scored = sorted(((difflib.SequenceMatcher(None, typed, o).ratio(), o) for o in options),
                    reverse=True)
    best = scored[0][0] if scored else 0.0
    return [o for ratio, o in scored[:2] if ratio >= 0.6 and ratio >= best - 0.15]


def _subcommand(parser: argparse.ArgumentParser, name: str | None,
                ) -> argparse.ArgumentParser | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            found: argparse.ArgumentParser = action.choices[name]
            return found
    return None


def build_parser() -> argparse.ArgumentParser:
    """Return the ``kestrel-runtime`` argument parser.

    The runtime (no subcommand, or ``run``) takes every setting; each other command takes
    only its own options and the settings it declares (:data:`CONNECTION` and what it
    uses), so its ``--help`` shows what applies to it.
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
        epilog=epilog("kestrel-runtime --app myapp.workflows --procs 4",
                      "kestrel-runtime submit greet --args '[\"Ada\"]' --wait 30",
                      "kestrel-runtime show EXECUTION_ID",
                      "kestrel-runtime COMMAND --help"),
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}",
                        help="Print the version and exit.")
    # The runtime's settings parse here too (no COMMAND means run), listed by `run --help`.
    for action in add_settings(parser, title="runtime settings (when no COMMAND is given)"):
        action.help = argparse.SUPPRESS
    parser._action_groups[-1].description = "Every one is listed by `kestrel-runtime run " \
                                            "--help`."
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in TABLE:
        _add(sub, command, top=True)
    return parser


def _add(sub: argparse._SubParsersAction[_Parser], command: Command, *,
         top: bool) -> None:
    """Add *command* (and its actions) to *sub*: its own options first, then its settings,
    in the usage line too."""
    if top:
        p = sub.add_parser(command.name, help=command.help,
                           description=command.description or textwrap.fill(command.help,
                                                                            width=88),
                           epilog=command.epilog or epilog(*command.examples),
                           allow_abbrev=False,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    else:  # a sub-action (token create): its help, no examples
        p = sub.add_parser(command.name, help=command.help, description=command.help,
                           allow_abbrev=False)
    settings = add_settings(p, command.settings)
    command.options(p)
    if command.actions:
        actions = p.add_subparsers(dest=command.action_dest, metavar="ACTION", required=True)
        for action in command.actions:
            _add(actions, action, top=False)
    p._actions = [a for a in p._actions if a not in settings] + settings


def config_from_args(ns: argparse.Namespace, environ: dict[str, str] | None = None) -> Config:
    """Return the validated settings from flags, environment and config file.

    *ns* holds the parsed flags and *environ* the environment (default ``os.environ``); the
    config file is ``--config`` or ``KESTREL_CONFIG``.

    Raises:
        ConfigError: a setting does not parse or is out of range.
    """
    flags = {k.name: getattr(ns, k.name, None) for k in KNOBS}
    return load(flags, environ=environ, config_file=getattr(ns, "config", None))



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
    if command == "migrate" and isinstance(exc, e.UndefinedTable | e.InvalidSchemaName
                                           | e.UndefinedFunction | e.UndefinedColumn):
        # Not "run migrate": this is migrate. Where it failed matters (on Citus, CONTEXT
        # names the worker node: issue 44 row 2).
        first = str(exc).strip().splitlines()[0]
        where = f" ({' '.join(exc.diag.context.split())})" if exc.diag.context else ""
        return (f"migrate of schema {schema} failed: {first}{where} [SQLSTATE "
                f"{exc.sqlstate}]; no migration of this run was kept (one transaction)")
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

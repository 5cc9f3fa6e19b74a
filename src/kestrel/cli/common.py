"""What every command module of :mod:`kestrel.cli` shares: the :class:`Command` a module
declares, the setting groups a command takes, and the small helpers of its output (a table
or ``--json``) and input (ids, JSON, times).

A command module imports this one and nothing else of the CLI (``test_layering.py``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from kestrel.config import KNOBS, Config
from kestrel.embedded import resolve_dsn
from kestrel.errors import ConfigError, KestrelError

PRECEDENCE = ("Settings come from, highest first: a flag, the KESTREL_<NAME> environment "
              "variable (e.g. KESTREL_BATCH_SIZE), a key in the TOML file named by --config "
              "or KESTREL_CONFIG (top level or a [kestrel] table), the default. With no DSN "
              "and no PG* variables, an embedded PostgreSQL runs in --data-dir.")

CONNECTION = ("dsn", "schema", "connection_mode", "listen_dsn", "data_dir", "log_level",
              "log_format")
"""The settings every operator command uses: where the database is and how to log."""

HISTORY = ("history_interval", "history_ahead")
"""What ``migrate`` also needs: the history partitions it creates ahead."""

NAMESPACE = ("buckets",)
"""What ``migrate`` also takes: how many buckets a namespace it makes has (kestrel.buckets)."""

PAYLOAD = ("max_payload_bytes",)
"""What the commands that write a value (submit, signal) also need: the cap they check it
against before anything is written."""

Handler = Callable[[Config, argparse.Namespace], int]


def _no_options(p: argparse.ArgumentParser) -> None:
    """A command with no options of its own."""


@dataclass(frozen=True)
class Command:
    """One ``kestrel-runtime`` command, declared beside its handler in its own module.

    *settings* are the knobs it takes (None: every one, as ``run``); *options* adds its own
    arguments to its parser; *examples* go first in its ``--help`` epilog (or *epilog*
    replaces that epilog, pre-wrapped, with *description*); *actions* are sub-commands
    (``token create|list|revoke``), each a Command of its own.
    """

    name: str
    help: str
    run: Handler | None
    options: Callable[[argparse.ArgumentParser], None] = _no_options
    settings: Sequence[str] | None = CONNECTION
    examples: Sequence[str] = ()
    description: str | None = None
    epilog: str | None = None
    actions: Sequence[Command] = ()
    action_dest: str = ""


def add_settings(p: argparse.ArgumentParser, names: Sequence[str] | None = None,
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


def epilog(*examples: str) -> str:
    """Examples, then where settings come from, for a command's --help (pre-wrapped)."""
    text = ""
    if examples:
        text = "examples:\n" + "\n".join(f"  {e}" for e in examples) + "\n\n"
    return text + textwrap.fill(PRECEDENCE, width=88)


def json_flag(p: argparse.ArgumentParser) -> None:
    """Add ``--json`` to *p*."""
    p.add_argument("--json", action="store_true", help="Print JSON instead of a table.")


def id_arg(p: argparse.ArgumentParser) -> None:
    """Add the positional execution id to *p*."""
    p.add_argument("id", help="The execution's id (a UUID, as submit and list print it).")


class NotFinished(KestrelError):
    """``submit --wait`` or ``show --wait`` ran out of time; the execution goes on."""


EXIT_NOT_FINISHED = 3
"""Exit status of ``submit --wait``/``show --wait`` when the execution has not finished."""

EXIT_NOT_TAKEN = 5
"""Exit status of ``signal --strict`` when no wait can take the signal (4 is ``replay``'s)."""


def client(cfg: Config) -> tuple[Any, Any]:
    """A :class:`~kestrel.client.SyncClient` without a pool for one command, and the
    embedded server's handle (None for a DSN) to keep alive while it is used."""
    from kestrel.client import SyncClient

    dsn, server = resolve_dsn(cfg, create=False)
    # One command, one or two statements: no pool to keep open.
    c = SyncClient(dsn, schema=cfg.schema, max_payload_bytes=cfg.max_payload_bytes,
                   pool_size=0, connection_mode=cfg.connection_mode,
                   listen_dsn=cfg.listen_dsn or None)
    return c, server


def json_arg(text: str, flag: str) -> Any:
    """*text* read by the decoder of every door (:func:`kestrel.codec.decode_exact`): a
    number that would not reach the workflow unchanged is refused, never rounded."""
    from kestrel import codec

    try:
        return codec.decode_exact(text)
    except ValueError as exc:
        raise ConfigError(f"{flag} is not valid JSON: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{flag} is not valid JSON: nested too deeply") from None


def tags(pairs: Sequence[str] | None, flag: str = "--tag") -> dict[str, str] | None:
    """Repeated ``--tag NAME=VALUE`` as a dict (None when none is given); the rules are
    :func:`kestrel.codec.check_tags`'.

    Raises:
        ConfigError: a pair without ``=``, or a name given twice.
    """
    if not pairs:
        return None
    found: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep:
            raise ConfigError(f"{flag} {pair!r}: use NAME=VALUE, e.g. {flag} customer=acme")
        if name in found:
            raise ConfigError(f"{flag}: tag {name!r} given twice")
        found[name] = value
    return found


def parse_id(text: str) -> uuid.UUID:
    """*text* as an execution id.

    Raises:
        ConfigError: it is not a UUID.
    """
    try:
        return uuid.UUID(text)
    except ValueError:
        raise ConfigError(f"{text!r} is not an execution id (a UUID)") from None


def emit(ns: argparse.Namespace, data: Any, table: Callable[[], None]) -> int:
    """Print *data* as JSON with ``--json``, else call *table*; return 0."""
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


def interactive() -> bool:
    """Whether a person reads stderr (notes are for them; scripts get one line or none)."""
    return sys.stderr.isatty()


def iso(text: str, flag: str) -> datetime:
    """*text* (the value of *flag*) as an ISO 8601 time, UTC when it names no zone."""
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: use an ISO 8601 time such as "
                          "2026-12-01T08:00:00Z") from None
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def since(text: str | None) -> datetime | None:
    """``--since``: an ISO time or an age like 30m, 6h, 7d."""
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


def ms(delta: timedelta) -> float:
    """*delta* in milliseconds, to 0.1."""
    return round(delta.total_seconds() * 1000, 1)


def short(value: Any, width: int = 90) -> str:
    """*value* as JSON, cut to *width* characters."""
    text = json.dumps(value)
    return text if len(text) <= width else text[: width - 1] + "…"


def one_line(text: str, width: int = 120) -> str:
    """*text* on one terminal line: control characters (a newline, an escape sequence a
    message may carry) shown as escapes, cut to *width* characters."""
    shown = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                    for c in text)
    return shown if len(shown) <= width else shown[: width - 1] + "…"

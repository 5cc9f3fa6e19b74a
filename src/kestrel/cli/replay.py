"""Replay before deploy (issue 27): ``replay`` and ``export-histories``, each its options
beside its handler."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import Any

from kestrel.boot import import_app
from kestrel.cli.common import CONNECTION, Command, json_flag, parse_id, since
from kestrel.config import Config
from kestrel.embedded import resolve_dsn
from kestrel.errors import ConfigError

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


def replay_options(rp: argparse.ArgumentParser) -> None:
    """``replay``'s options."""
    rp.add_argument("--from", dest="source", metavar="FILE", default=None,
                    help="Read histories from this file (export-histories; - for stdin) "
                         "instead of the database.")
    _add_selection(rp, "default: 100 from the database, all of a --from file")
    rp.add_argument("--timeout", type=float, default=30.0, metavar="SECONDS",
                    help="Most seconds one execution's replay may take (default: 30).")
    json_flag(rp)


def export_options(ex: argparse.ArgumentParser) -> None:
    """``export-histories``' options."""
    ex.add_argument("--out", required=True, metavar="FILE",
                    help="The file to write (replaced once complete); - for stdout.")
    _add_selection(ex, "default: 100")


def _selection(ns: argparse.Namespace) -> Any:
    from kestrel.replay import Selection, check_selection

    sel = Selection(ids=tuple(dict.fromkeys(parse_id(i) for i in ns.ids)),
                    workflow=ns.workflow,
                    status=ns.status, since=since(ns.since), limit=ns.limit)
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


REPLAY = Command(
    "replay", "Replay recorded executions through new workflow code before a deploy, writing "
              "nothing; exit 4 if the new code would break one.", cmd_replay, replay_options,
    (*CONNECTION, "app", "max_history_bytes", "max_payload_bytes"),
    description=("Replay recorded executions through new workflow code before a deploy,\n"
                 "writing nothing; exit 4 if the new code would break one."),
    epilog=_REPLAY_EPILOG)
EXPORT_HISTORIES = Command(
    "export-histories", "Write recorded histories to a JSON-lines file that `replay --from` "
                        "and kestrel.testing.replay read.", cmd_export_histories,
    export_options, (*CONNECTION, "max_history_bytes"),
    description=("Write recorded histories to a JSON-lines file that `replay --from` and\n"
                 "kestrel.testing.replay read."),
    epilog=_EXPORT_EPILOG)

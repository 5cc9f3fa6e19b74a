"""Bulk actions: ``cancel``, ``retry`` and ``signal`` given ``list``'s filters instead of an
id (issue 42, item 4).

``--dry-run`` counts what matches and prints a sample; otherwise the action runs a page at a
time (:meth:`kestrel.Client.bulk`), says after each page how far it got, and prints what it
did. Every run has a key (``--key``, or one made and printed): run again with it, after a
Ctrl-C or a lost connection, and nothing is acted on twice (a retry or signal goes under a
key made of it and the execution's id; a cancel is idempotent).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kestrel._client_common import check_bulk
from kestrel.cli.common import emit, json_arg, since, tags
from kestrel.config import Config
from kestrel.errors import ConfigError
from kestrel.types import BulkResult, Match

DONE = {"cancel": "cancelled", "retry": "queued again", "signal": "signalled"}


def bulk_options(p: argparse.ArgumentParser) -> None:
    """The filters of ``list`` and the options of a bulk run, for a command that otherwise
    takes one execution id."""
    g = p.add_argument_group(
        "bulk (instead of an id: every execution the filters match, in every bucket)")
    g.add_argument("--status", help="queued, running, waiting, completed, failed, cancelled "
                                    "or quarantined.")
    g.add_argument("--workflow", help="Only this workflow.")
    g.add_argument("--queue", help="Only this queue.")
    g.add_argument("--since", help="Created since: an ISO time or an age like 30m, 6h, 7d.")
    g.add_argument("--until", help="Created before: an ISO time or an age like 30m, 6h, 7d.")
    # SUPPRESS: absent, it is not the runtime's own --app-version setting (as in list).
    g.add_argument("--app-version", metavar="V", default=argparse.SUPPRESS,
                   help="Only executions started by this application version.")
    g.add_argument("--patch", metavar="ID", help="Only executions that recorded this patch.")
    g.add_argument("--without-patch", metavar="ID", help="Only executions of the workflows "
                   "using this patch that did not record it.")
    g.add_argument("--tag", action="append", default=None, metavar="NAME=VALUE",
                   help="Only executions with this tag; repeat: all must match.")
    g.add_argument("--dry-run", action="store_true",
                   help="Count what matches and print a sample; act on nothing.")
    g.add_argument("--key", metavar="KEY", help="Name this run (default: a new key, printed): "
                   "run again with the same key after a stop and nothing is acted on twice.")
    g.add_argument("--page-size", type=int, default=200, metavar="N",
                   help="Executions per page (1-1000, default 200); progress is printed "
                        "after each.")


def wants_bulk(ns: argparse.Namespace) -> bool:
    """Whether the command line names filters (or bulk options) rather than one id."""
    return any(getattr(ns, name, None) not in (None, False) for name in (
        "status", "workflow", "queue", "since", "until", "app_version", "patch",
        "without_patch", "tag", "dry_run", "key"))


def run(cfg: Config, ns: argparse.Namespace, action: str) -> int:
    """Run the bulk *action* the command line describes; print progress (stderr) and what it
    did. Exit 0; 130 when stopped by Ctrl-C, after saying how to go on."""
    from kestrel.client import SyncClient
    from kestrel.embedded import resolve_dsn

    if ns.patch and ns.without_patch:
        raise ConfigError("--patch and --without-patch exclude each other")
    if not 1 <= ns.page_size <= 1000:
        raise ConfigError(f"--page-size must be 1 to 1000, not {ns.page_size}")
    match = Match(status=ns.status, workflow=ns.workflow, queue=ns.queue,
                  since=since(ns.since), until=_until(ns.until),
                  app_version=getattr(ns, "app_version", None),
                  patch=ns.patch or ns.without_patch, with_patch=not ns.without_patch,
                  tags=tags(ns.tag))
    if getattr(ns, "idempotency_key", None) is not None:
        raise ConfigError("--idempotency-key is for one execution; a bulk run has --key")
    payload = json_arg(ns.payload, "--payload") if action == "signal" else None
    # The key is said before anything is done: a stop during the first page can go on too.
    key = check_bulk(action, match, ns.key)
    dsn, _server = resolve_dsn(cfg, create=False)
    # A connection kept for the run's many short calls (a pool of one, closed at the end).
    with SyncClient(dsn, schema=cfg.schema, max_payload_bytes=cfg.max_payload_bytes,
                    pool_size=1, connection_mode=cfg.connection_mode,
                    listen_dsn=cfg.listen_dsn or None) as client:
        if ns.dry_run:
            done = client.bulk(action, match, signal=getattr(ns, "name", None),
                               payload=payload, key=key, dry_run=True)
            return emit(ns, _data(done), lambda: _print_dry_run(done))
        print(f"{action}: key {key} (run again with --key {key} to go on after a stop; "
              "nothing is acted on twice)", file=sys.stderr)

        def progress(done: BulkResult) -> None:
            print(f"{action}: {done.matched} matched so far, {done.acted} "
                  f"{DONE[action]}, {sum(done.skipped.values())} skipped", file=sys.stderr)

        try:
            done = client.bulk(action, match, signal=getattr(ns, "name", None),
                               payload=payload, key=key, page_size=ns.page_size,
                               progress=progress)
        except KeyboardInterrupt:
            print(f"{action}: stopped; run again with --key {key} to go on (nothing is "
                  "acted on twice)", file=sys.stderr)
            return 130
    return emit(ns, _data(done), lambda: _print_done(done))


def _until(text: str | None) -> Any:
    try:
        return since(text)
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("--since", "--until")) from None


def _data(done: BulkResult) -> dict[str, Any]:
    return {"action": done.action, "key": done.key, "dry_run": done.dry_run,
            "matched": done.matched, "acted": done.acted, "skipped": done.skipped,
            "sample": done.sample}


def _print_dry_run(done: BulkResult) -> None:
    print(f"{done.action} would act on up to {done.matched} execution(s) that match now "
          "(each is checked again when its turn comes)")
    for eid in done.sample:
        print(f"  {eid}")
    if done.matched > len(done.sample):
        print(f"  … and {done.matched - len(done.sample)} more")


def _print_done(done: BulkResult) -> None:
    print(f"{done.action}: {done.matched} matched, {done.acted} {DONE[done.action]} "
          f"(key {done.key})")
    for why, n in sorted(done.skipped.items()):
        print(f"  skipped {n}: {why}")

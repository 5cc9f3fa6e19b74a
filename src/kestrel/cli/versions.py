"""The commands of versions and rolling deploys (issue 18): ``unclaimable``, ``patches`` and
``remove-limits`` (a queue's limits outlive the code that declared them), each its options
beside its handler."""

from __future__ import annotations

import argparse
import textwrap

from kestrel.cli import common
from kestrel.cli.common import Command, emit, json_flag, short
from kestrel.config import Config
from kestrel.errors import ConfigError


def unclaimable_options(uc: argparse.ArgumentParser) -> None:
    """``unclaimable``'s options."""
    uc.add_argument("--limit", type=int, default=100, help="Most lines (default: 100).")
    json_flag(uc)


def patches_options(pt: argparse.ArgumentParser) -> None:
    """``patches``'s arguments."""
    pt.add_argument("patch", nargs="?", help="Only this patch id.")
    json_flag(pt)


def remove_limits_options(rl: argparse.ArgumentParser) -> None:
    """``remove-limits``'s arguments."""
    rl.add_argument("queue", help="The queue whose limits go.")
    json_flag(rl)


def cmd_unclaimable(cfg: Config, ns: argparse.Namespace) -> int:
    """``kestrel-runtime unclaimable``: what waits for a worker that knows it, and who runs."""
    client, _server = common.client(cfg)
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
                  f"{short(w.workflows, 60)}")
        if not workers:
            print("(no live workers)")

    return emit(ns, data, table)


def cmd_patches(cfg: Config, ns: argparse.Namespace) -> int:
    """``kestrel-runtime patches``: per workflow and patch, who took the new path and how
    many live executions may still need the old one (remove the old branch at 0)."""
    client, _server = common.client(cfg)
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

    return emit(ns, data, table)


def cmd_remove_limits(cfg: Config, ns: argparse.Namespace) -> int:
    """``kestrel-runtime remove-limits QUEUE``: the queue's row in ``queue_limits`` goes (in
    every bucket); the workers claim it unlimited from their next look at the limits."""
    client, _server = common.client(cfg)
    had = client.remove_queue_limits(ns.queue)

    def table() -> None:
        print(f"queue {ns.queue}: " + ("limits removed; workers claim it unlimited within a "
                                       "heartbeat interval" if had else "had no limits"))

    return emit(ns, {"queue": ns.queue, "removed": had}, table)


UNCLAIMABLE = Command(
    "unclaimable", "Live executions no live worker can claim; the live workers and their app "
                   "versions.", cmd_unclaimable, unclaimable_options,
    description=textwrap.fill(
        "Live executions no live worker can claim (no worker registers their workflow and "
        "queue, or every one that does runs an app version that gave them back): they wait, "
        "unfailed; and the live workers with their app versions.", width=88))
PATCHES = Command(
    "patches", "Patches recorded by executions (ctx.patched), by workflow: how many took the "
               "new path, and how many live ones may still need the old.", cmd_patches,
    patches_options)
REMOVE_LIMITS = Command(
    "remove-limits", "Remove a queue's limits, wherever they were declared.",
    cmd_remove_limits, remove_limits_options,
    examples=("kestrel-runtime remove-limits deploys",),
    description=textwrap.fill(
        "Remove a queue's limits, wherever they were declared: every worker claims it "
        "unlimited (per_process included) from its next look at the limits (a heartbeat "
        "interval). A worker whose code or --queue-limits still declares them declares them "
        "again when it starts: remove them there first.", width=88))

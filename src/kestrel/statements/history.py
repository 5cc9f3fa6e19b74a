"""History upkeep and the finishes no worker counted (``sql/queries/history.sql``)."""

from __future__ import annotations

from typing import Any

from kestrel.sql import Queries
from kestrel.statements.stmt import Script, Stmt, first


def run_maintenance(q: Queries, *, interval: str, ahead: int, retention_days: float,
                    detach: bool = False) -> Script[tuple[bool, int, int]]:
    """One upkeep round in one transaction, if no other process holds the upkeep lock:
    (ran, partitions created, partitions dropped)."""
    got = yield Stmt(q.maintenance_lock, None, first)
    if not got:
        return False, 0, 0
    created = yield Stmt(q.ensure_partitions, {"interval": interval, "ahead": ahead}, first)
    dropped = 0
    if retention_days > 0:
        dropped = yield Stmt(q.drop_partitions, {"retention_days": retention_days,
                                                 "detach": detach}, first)
    return True, int(created or 0), int(dropped or 0)


def list_partitions(q: Queries) -> Stmt[list[tuple[Any, ...]]]:
    """History partitions with their bounds and sizes."""
    return Stmt(q.list_partitions, None, list)


def take_uncounted_finishes(q: Queries, *, workflows: list[str], collector: str,
                            acked: list[int]) -> Stmt[list[tuple[int, str, str, bool]]]:
    """Take the finishes of *workflows* no worker saw (what cancel() finished while queued or
    waiting, what the sweeper failed past its deadline) that no other collector took, and
    delete the ones this *collector* counted (*acked*): ``(finish_id, workflow, status,
    deadline)``, one per finish. Rows it took before and never acknowledged come back (a
    lost reply): see ``sql/queries/history.sql``."""
    return Stmt(q.take_uncounted_finishes,
                {"workflows": workflows, "collector": collector, "acked": acked},
                lambda rows: [(int(r[0]), r[1], r[2], bool(r[3])) for r in rows])

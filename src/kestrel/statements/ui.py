"""The web UI's own reads (``sql/queries/ui.sql``); the rest it shares with the API
(:mod:`kestrel.statements.http`)."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from typing import Any

from kestrel.sql import Queries
from kestrel.statements.stmt import Stmt, first

Row = dict[str, Any]


def ui_counts(q: Queries, *, finished_window: timedelta
              ) -> Stmt[list[tuple[str, int, bool]]]:
    """Executions by status: (status, count, live), the finished ones of *finished_window*."""
    return Stmt(q.ui_counts, {"finished_window": finished_window},
                lambda rows: [(r[0], int(r[1]), bool(r[2])) for r in rows])


def ui_waits(q: Queries, *, ids: list[uuid.UUID]) -> Stmt[dict[str, tuple[Any, ...]]]:
    """What each waiting execution of *ids* waits for and since when: its row by id (see
    :func:`kestrel.http.ui.render.wait_view`)."""
    return Stmt(q.ui_waits, {"ids": ids}, lambda rows: {str(r[0]): tuple(r) for r in rows})


def ui_sent_signal(q: Queries, *, id: uuid.UUID, key: str) -> Stmt[Row | None]:
    """The signal the UI sent to *id* under idempotency key *key*, as it arrived."""
    return Stmt(q.ui_sent_signal, {"id": id, "key": key},
                lambda rows: {"name": rows[0][0], "payload": rows[0][1], "at": rows[0][2]}
                if rows else None)


def ui_retried(q: Queries, *, id: uuid.UUID, key: str) -> Stmt[bool]:
    """Whether the UI retried *id* under idempotency key *key*."""
    return Stmt(q.ui_retried, {"id": id, "key": key}, lambda rows: bool(first(rows)))


def search_history(q: Queries, *, since: datetime, until: datetime, status: str | None,
                   pattern: str, limit: int) -> Stmt[list[Row]]:
    """Finished executions that finished in [*since*, *until*) whose workflow, error,
    arguments or idempotency key match the escaped ILIKE *pattern*, newest first."""
    return Stmt(q.search_history, {"since": since, "until": until, "status": status,
                                   "pattern": pattern, "limit": limit}, lambda rows: [
        {"id": str(r[0]), "workflow": r[1], "queue": r[2], "status": r[3],
         "claims": r[10], "attempts": r[4], "created_at": r[5], "finished_at": r[6],
         "parent_id": str(r[7]) if r[7] else None,
         "error": f"{r[8]}: {r[9]}" if r[8] else None} for r in rows])

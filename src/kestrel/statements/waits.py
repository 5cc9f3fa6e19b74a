"""What waiting executions wait for (``sql/queries/waits.sql``), for the metrics."""

from __future__ import annotations

from collections.abc import Sequence

from kestrel.sql import Queries
from kestrel.statements.stmt import Stmt


def waiting_stats(q: Queries, *, workflows: Sequence[str],
                  limit: int) -> Stmt[list[tuple[str, str, int]]]:
    """Waiting executions of *workflows* by (workflow, what they wait for), largest first."""
    return Stmt(q.waiting_stats, {"workflows": list(workflows), "limit": limit},
                lambda rows: [(r[0], r[1], int(r[2])) for r in rows])

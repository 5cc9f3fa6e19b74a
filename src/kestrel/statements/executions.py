"""The worker's statements on execution rows (``sql/queries/executions.sql``): the claim,
the heartbeat, parking at a wait, giving back, releasing, completing, and reading back a
completion whose reply was lost.

Writes carry the lease epoch; they match zero rows for a superseded epoch and the caller
learns it from what comes back.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

import orjson

from kestrel import codec
from kestrel.codec import MAX_HISTORY_BYTES
from kestrel.errors import HistoryTooLarge, UndecodableInput
from kestrel.sql import Queries
from kestrel.statements.stmt import Script, Stmt, checkpoint_fields, json_rows, wrapped
from kestrel.types import Claimed, Finish, RecordedStep

SUSPECT_AFTER = 2
"""Claims without finishing after which an execution is a suspect (see claim_batch, where
it is written as a constant so that the planner can use the suspects' partial index)."""


_CLAIMED = ("id", "workflow", "epoch", "attempt", "wait_step", "wait_deadline", "signal_seq",
            "deadline", "cancel_requested", "db_now", "created_at", "waiting_for",
            "traceparent", "tracestate")
"""The columns of a claim's result (sql/fragments/claim.sql: claim_result) passed to
:class:`Claimed` as they are; ``args`` and ``steps`` are decoded first."""


def _recorded(steps: list[list[Any]] | None) -> dict[int, RecordedStep]:
    if not steps:
        return {}
    return {s[0]: RecordedStep(s[1], s[2], s[3]) for s in steps}


def claimed(row: Mapping[str, Any]) -> Claimed:
    """A row of claim_batch or claim_limited by column name (both end with the same
    claim_result, named as Claimed's fields). Arguments and checkpoints arrive as JSON text
    and are decoded here, one execution at a time, so a value that cannot be decoded fails
    that execution only (FAULTS P2)."""
    broken: Exception | None = None
    args: list[Any] = []
    steps: dict[int, RecordedStep] = {}
    try:
        args = codec.decode_exact(row["args"])
        history = orjson.loads(row["steps"]) if row["steps"] is not None else None
    except ValueError as exc:
        broken = UndecodableInput(
            f"the stored arguments or checkpoints of execution {row['id']} cannot be decoded "
            f"unchanged ({exc}); submit them within JSON's double range and 64-bit integers")
    else:
        if isinstance(history, dict):
            broken = HistoryTooLarge(
                f"execution {row['id']} has {history.get('too_large')} bytes of recorded "
                "checkpoints, over --max-history-bytes: it cannot be loaded to replay")
        else:
            steps = _recorded(history)
    return Claimed(args=args, steps=steps, broken=broken,
                   **{k: row[k] for k in _CLAIMED if k in row})


def claims(rows: list[Mapping[str, Any]]) -> list[Claimed]:
    """The rows of a claim (by column name), each as :func:`claimed` decodes it."""
    return [claimed(r) for r in rows]


def claimed_from_texts(*, id: uuid.UUID, workflow: str, args: str, steps: str | None,
                       wait_step: int | None, waiting_for: str | None,
                       created_at: datetime | None) -> Claimed:
    """An execution as a claim would hand it to the runner, from its arguments and
    checkpoints as the database returns them (JSON text, ``history_of``'s shape), decoded as
    a claim's row is: what cannot be decoded, or a history over the bound, is ``broken``. A
    replay before deploy (kestrel.replay) loads histories through this, so it sees exactly
    what a worker would (no lease, no trace context)."""
    return claimed({"id": id, "workflow": workflow, "args": args, "epoch": 0, "attempt": 1,
                    "steps": steps, "wait_step": wait_step, "waiting_for": waiting_for,
                    "created_at": created_at})


def claim_params(*, owner: str, limit: int, lease_s: float, workflows: Sequence[str] | None,
                 max_history_bytes: int, app_version: str | None) -> dict[str, Any]:
    """The parameters both claims (this one and ``queues.claim_limited``) share."""
    return {"owner": owner, "limit": limit, "lease_s": lease_s,
            "workflows": list(workflows or ()), "any_workflow": workflows is None,
            "max_history_bytes": max_history_bytes, "app_version": app_version}


def claim_batch(
    q: Queries, *, owner: str, queues: Sequence[str], limit: int, lease_s: float,
    workflows: Sequence[str] | None = None, max_history_bytes: int = MAX_HISTORY_BYTES,
    take_suspect: bool = True, app_version: str | None = None,
) -> Stmt[list[Claimed]]:
    """Claim up to *limit* queued executions of *workflows* (None: any) with their recorded
    checkpoints.

    At most one of them is a suspect (claimed :data:`SUSPECT_AFTER` times before), and none
    when *take_suspect* is false. A first claim records *app_version* on the row.
    """
    params = claim_params(owner=owner, limit=limit, lease_s=lease_s, workflows=workflows,
                          max_history_bytes=max_history_bytes, app_version=app_version)
    params.update(queues=list(queues), take_suspect=take_suspect)
    return Stmt(q.claim_batch, params, claims, by_name=True)


@dataclass(frozen=True)
class Beat:
    """What a heartbeat learned: whether the process's lease was extended (False: it ran out
    before this beat and is not revived), and which of the executions it holds are still its
    own, each with its cancel flag."""

    renewed: bool
    owned: dict[uuid.UUID, bool]


def heartbeat(q: Queries, *, owner: str, held: Sequence[tuple[uuid.UUID, int]],
              lease_s: float) -> Script[Beat]:
    """Take or extend *owner*'s lease for *lease_s* (never revived once run out), then say
    which executions of *held* (``(id, epoch)``) are still its own. One transaction."""
    renewed = yield Stmt(q.take_lease, {"owner": owner, "lease_s": lease_s},
                         lambda rows: bool(rows))
    if not renewed:
        return Beat(False, {})
    owned: dict[uuid.UUID, bool] = (yield held_by(q, owner=owner, held=held)) if held else {}
    return Beat(True, owned)


def held_by(q: Queries, *, owner: str,
            held: Sequence[tuple[uuid.UUID, int]]) -> Stmt[dict[uuid.UUID, bool]]:
    """Which executions of *held* (``(id, epoch)``) still run under *owner*'s lease, each
    with its cancel flag (the heartbeat's second statement; it locks nothing)."""
    return Stmt(q.heartbeat, {"owner": owner, "ids": [h[0] for h in held],
                              "epochs": [h[1] for h in held]},
                lambda rows: {r[0]: bool(r[1]) for r in rows})


def running_under(q: Queries, *, owner: str) -> Stmt[list[tuple[uuid.UUID, int]]]:
    """``(id, epoch)`` of every execution running under *owner*'s lease."""
    return Stmt(q.running_under, {"owner": owner}, lambda rows: [(r[0], r[1]) for r in rows])


def end_leases(q: Queries, *, held: Sequence[tuple[uuid.UUID, int]]
               ) -> Stmt[dict[uuid.UUID, bool]]:
    """End the lease of the executions *held* (``(id, epoch)``) for the sweeper to take:
    ``{id: ended}`` for those still running under that epoch (False: another transaction
    holds the row; send it again later); the others are not ours any more."""
    return Stmt(q.end_leases, {"ids": [h[0] for h in held], "epochs": [h[1] for h in held]},
                lambda rows: {r[0]: bool(r[1]) for r in rows})


def park(q: Queries, *, id: uuid.UUID, epoch: int, step_id: int, waiting_for: str,
         seconds: float | None, seen_seq: int | None) -> Stmt[str]:
    """Park the execution at a wait. Returns ``parked`` (now, or by an earlier try whose
    reply was lost), ``cancelled`` (a cancel was requested), ``signalled`` (a signal arrived
    since *seen_seq* was read: look again), ``recorded`` (the position has a checkpoint:
    replay it) or ``lost`` (no longer ours)."""
    return Stmt(q.park, {"id": id, "epoch": epoch, "step_id": step_id,
                         "waiting_for": waiting_for, "seconds": seconds, "seen_seq": seen_seq},
                lambda rows: str(rows[0][0]))


def complete_batch(q: Queries, finishes: Sequence[Finish], *, delegated: bool = False
                   ) -> Stmt[set[uuid.UUID]]:
    """Finish executions and move them to history; the ids that were still owned. A
    Finish with a tail writes that checkpoint in the same statement; one whose tail's
    position is already recorded (an older claim's write) is not finished (it is not in
    the result, and history does not have it).
    *delegated*: the Citus form (``complete_batch_delegated``, a call of ``finish_batch()``,
    which raises no notification: send :func:`kestrel.statements.notify.notify_done`)."""
    now = time.monotonic()
    query = q.complete_batch_delegated if delegated else q.complete_batch
    # The same statement again after unique_violation: a tail met a row an older claim
    # committed after this statement's snapshot; the next snapshot sees it (and leaves
    # that execution unfinished).
    return Stmt(query, {"rows": json_rows(_finish_row(f, now) for f in finishes)}, _ids,
                if_recorded=query)


def _finish_row(f: Finish, now: float) -> list[Any]:
    row = [f.execution_id, f.epoch, f.status.value, wrapped(f.result), wrapped(f.error)]
    if f.tail is not None:
        row += checkpoint_fields(f.tail, now)  # as a checkpoint batch's, after the five above
    return row


def finished_readback(q: Queries, finishes: Sequence[Finish]) -> Stmt[set[uuid.UUID]]:
    """Of *finishes*, the ids that are in history under their epoch and status: our own
    completion committed, though its reply was lost."""
    return Stmt(q.finished_readback,
                {"ids": [f.execution_id for f in finishes],
                 "epochs": [f.epoch for f in finishes],
                 "statuses": [f.status.value for f in finishes]}, _ids)


def release_batch(q: Queries, *, held: Sequence[tuple[uuid.UUID, int]]
                  ) -> Stmt[set[uuid.UUID]]:
    """Put still-owned executions back in the queue at once (drain)."""
    return Stmt(q.release_batch, {"ids": [h[0] for h in held],
                                  "epochs": [h[1] for h in held]}, _ids)


def _ids(rows: list[tuple[Any, ...]]) -> set[uuid.UUID]:
    return {row[0] for row in rows}


def give_back(q: Queries, *, id: uuid.UUID, epoch: int, app_version: str | None,
              base_s: float, cap_s: float,
              ) -> Stmt[tuple[int, datetime] | Literal["cancelled"] | None]:
    """Give back an execution this worker's code is too old for (CodeTooOld), unrun: it
    waits until now + ``min(cap_s, base_s * 2**give_backs)``, its give-back counted and
    *app_version* recorded, whose claims skip it from then on. Returns the execution's
    give-back count and when it can be claimed again (also on a retry after a lost reply),
    ``"cancelled"`` if a cancel was requested meanwhile (nothing given back: the worker
    finishes it as cancelled), or None if it is no longer ours."""

    def decode(rows: list[tuple[Any, ...]]
               ) -> tuple[int, datetime] | Literal["cancelled"] | None:
        if not rows:
            return None
        return "cancelled" if rows[0][2] else (int(rows[0][0]), rows[0][1])

    return Stmt(q.give_back, {"id": id, "epoch": epoch, "app_version": app_version,
                              "base_s": base_s, "cap_s": cap_s}, decode)

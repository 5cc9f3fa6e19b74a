"""The worker's statements on checkpoints (``sql/queries/steps.sql``): saving a batch of
steps, reading one back, taking a signal into a wait's checkpoint, publishing an event and
changing the execution's tags."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

from kestrel.sql import Queries
from kestrel.statements.stmt import Stmt, checkpoint_fields, json_rows
from kestrel.types import RecordedStep, SignalTaken, StepSaved, StepWrite


def save_steps(q: Queries, writes: Sequence[StepWrite], *, delegated: bool = False
               ) -> Stmt[list[StepSaved]]:
    """Checkpoint *writes* in one statement; results are in the order of *writes*.

    *delegated*: the Citus form (``save_new_steps_delegated``, a call of ``save_steps()``
    that a distributed schema runs on the tenant's node), with the same parameters, rows and
    fallback; the worker sends it where its schema is distributed.

    The statement is ``save_new_steps_batch``, a plain INSERT (no speculative insertion, so
    less WAL). If a step of the batch is already recorded (only a retry after a lost reply
    can meet one: FAULTS F3), it fails whole with unique_violation and the batch is sent
    again as ``save_steps_batch`` (``ON CONFLICT DO NOTHING``), which returns the output
    recorded first: a second round trip, on that rare path only.
    """
    now = time.monotonic()
    params = {"rows": json_rows([w.execution_id, w.epoch, *checkpoint_fields(w, now)]
                                for w in writes)}

    def decode(rows: list[tuple[Any, ...]]) -> list[StepSaved]:
        by_key = {(r[0], r[1]): r for r in rows}
        saved = []
        for w in writes:
            r = by_key[(w.execution_id, w.step_id)]
            recorded = RecordedStep(r[4], r[5], r[6]) if r[4] is not None else None
            saved.append(StepSaved(owned=bool(r[2]), inserted=bool(r[3]), recorded=recorded,
                                   cancelled=bool(r[7])))
        return saved

    if delegated:
        return Stmt(q.save_new_steps_delegated, params, decode,
                    if_recorded=q.save_steps_delegated)
    return Stmt(q.save_new_steps_batch, params, decode, if_recorded=q.save_steps_batch)


def load_step(q: Queries, *, execution_id: uuid.UUID, step_id: int
              ) -> Stmt[RecordedStep | None]:
    """Read the checkpoint recorded at *step_id*, or None if there is none."""
    return Stmt(q.load_step, {"execution_id": execution_id, "step_id": step_id},
                lambda rows: RecordedStep(rows[0][0], rows[0][1], rows[0][2]) if rows
                else None)


def consume_signal(q: Queries, *, id: uuid.UUID, epoch: int, step_id: int, name: str,
                   step_name: str) -> Stmt[SignalTaken]:
    """Take the oldest pending signal *name* into the checkpoint of the wait at *step_id*.

    Fenced by *epoch*. Returns ownership, the cancel flag, the recorded output (None when no
    signal is pending) and the ``signal_seq`` to park with.
    """
    return Stmt(q.consume_signal, {"id": id, "epoch": epoch, "step_id": step_id,
                                   "name": name, "step_name": step_name},
                lambda rows: SignalTaken(owned=bool(rows[0][0]), cancelled=bool(rows[0][1]),
                                         output=rows[0][2], signal_seq=int(rows[0][3] or 0)))


def set_event(q: Queries, *, id: uuid.UUID, epoch: int, key: str, value: str) -> Stmt[bool]:
    """Upsert event *key* to *value* (JSON text) and notify those waiting on it.

    False if the execution is no longer running under *epoch*.
    """
    return Stmt(q.set_event, {"id": id, "epoch": epoch, "key": key, "value": value},
                lambda rows: bool(rows and rows[0][0]))


def set_tags(q: Queries, *, id: uuid.UUID, epoch: int, tags: str) -> Stmt[bool]:
    """Merge *tags* (a JSON object as text; a null value removes its tag) into the
    execution's tags.

    False if the execution is no longer running under *epoch*. Raises ConfigError (from
    :func:`kestrel.db.run`) when the merged tags would break the rule of ``check_tags``
    (more than 32).
    """
    return Stmt(q.set_tags, {"id": id, "epoch": epoch, "tags": tags}, lambda rows: bool(rows))

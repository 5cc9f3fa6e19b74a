"""Frozen rows and results shared by the runtime's modules."""

from __future__ import annotations

import enum
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any


class Status(enum.StrEnum):
    """Where an execution is in its life. The first three are live, the rest terminal."""

    QUEUED = "queued"
    RUNNING = "running"
    WAITING = "waiting"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    QUARANTINED = "quarantined"

    @property
    def terminal(self) -> bool:
        """Whether the execution has ended (completed, failed, cancelled or quarantined)."""
        return self not in (Status.QUEUED, Status.RUNNING, Status.WAITING)


@dataclass(frozen=True, slots=True)
class RecordedStep:
    """A checkpoint as a replay sees it."""

    name: str
    output: Any
    error: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class Claimed:
    """An execution this process now owns under *epoch*.

    ``wait_step``/``wait_deadline`` describe the wait it was parked at, if any; ``db_now`` is
    the database clock at the claim, which decides whether that wait is over.
    """

    id: uuid.UUID
    workflow: str
    args: list[Any]
    epoch: int
    attempt: int
    steps: dict[int, RecordedStep]
    wait_step: int | None = None
    wait_deadline: datetime | None = None
    signal_seq: int = 0
    deadline: datetime | None = None
    cancel_requested: bool = False
    db_now: datetime | None = None
    created_at: datetime | None = None
    # Why the claimed row cannot run at all (arguments or history it cannot decode, a history
    # over the bound): the worker fails the execution with this instead of running it.
    broken: Exception | None = None
    # What the wait at wait_step was parked for (kestrel.sleep, a signal's name, or
    # kestrel.child:<id>): the replay checks that the call at that position is that wait.
    waiting_for: str | None = None
    # The submitter's W3C trace context (migration 0018), which the spans of this attempt
    # continue (kestrel.tracing); None: no trace.
    traceparent: str | None = None
    tracestate: str | None = None


@dataclass(frozen=True, slots=True)
class StepWrite:
    """One checkpoint waiting for the process's next group commit."""

    execution_id: uuid.UUID
    epoch: int
    step_id: int
    name: str
    output: str | None
    error: str | None
    attempt: int
    # How long the body ran, and when it ended, by this process's monotonic clock. The
    # database derives started_at and finished_at from its own clock at the write, so a
    # worker's skewed wall clock never reaches a row and time spent waiting for the write
    # (group commit, an outage) does not shift them.
    ran_s: float
    ended_at: float = field(default_factory=time.monotonic)
    # The failed tries before this outcome, a JSON array (definitions.note_failed_try), or
    # None: the first try stood.
    tries: str | None = None


@dataclass(frozen=True, slots=True)
class StepSaved:
    """What the database holds for a step after a write: ours (*inserted*; *recorded* is
    then None, the writer knows what it wrote), or the first one committed (*recorded*)."""

    owned: bool
    inserted: bool
    recorded: RecordedStep | None
    cancelled: bool = False


@dataclass(frozen=True, slots=True)
class SignalTaken:
    """What looking for a signal found: a recorded output, or the seq to park with."""

    owned: bool
    cancelled: bool
    output: Any
    signal_seq: int


@dataclass(frozen=True, slots=True)
class Finish:
    """A terminal transition waiting for the next group commit."""

    execution_id: uuid.UUID
    epoch: int
    status: Status
    result: str | None
    error: str | None
    # The workflow's last checkpoint, not yet written (the run ended right after its step):
    # the completion writes it in its own statement (statements.executions.complete_batch).
    tail: StepWrite | None = None


@dataclass(frozen=True, slots=True)
class SweepResult:
    """What one ``reenqueue_expired`` pass did.

    Executions requeued and quarantined, and expired leases examined.
    """

    requeued: int
    quarantined: int
    examined: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Execution:
    """An execution as the client and the CLI show it (hot queue or history)."""

    id: uuid.UUID
    workflow: str
    queue: str
    priority: int
    status: Status
    args: list[Any]
    result: Any
    error: dict[str, Any] | None
    attempts: int
    lease_epoch: int
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    deadline: datetime | None = None
    """When it ends failed if it has not finished (``submit(timeout=…)``)."""
    waiting_for: str | None = None
    """While waiting: ``kestrel.signal:<name>``, ``kestrel.child:<id>``, ``kestrel.sleep``, or
    None for a delayed start."""
    wake_at: datetime | None = None
    """While waiting: when it is claimed again (a sleep's end, a delayed start, a timeout)."""
    wait_deadline: datetime | None = None
    """While waiting: when the current wait times out."""
    queue_limit: str | None = None
    """While live, in a limited queue: its limits (a queued one may wait for a slot)."""
    give_backs: int = 0
    """While live: how many times a worker whose code was older than its history gave it
    back unrun (CodeTooOld)."""
    given_back_by: list[str] | None = None
    """While live: the app versions that gave it back; their workers never claim it again."""
    given_back_at: datetime | None = None
    """While live: when it was last given back, if no worker has claimed it since (it waits
    for a worker of another version until ``wake_at``)."""
    tags: dict[str, str] | None = None
    """Its tags (``submit(tags=…)``, ``ctx.set_tags``), live and in history; None: none."""
    concurrency_key: str | None = None
    """Its concurrency key (``submit(concurrency_key=…)``), live and in history."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FailedTry:
    """A try of a step that raised and was retried: its attempt number, the exception's
    type and message (up to 2,000 characters), and when it failed (the database's clock)."""

    attempt: int
    type: str
    message: str
    failed_at: datetime


@dataclass(frozen=True, slots=True, kw_only=True)
class StepRow:
    """A checkpoint as ``show`` lists it."""

    step_id: int
    name: str
    output: Any
    error: dict[str, Any] | None
    attempt: int
    lease_epoch: int
    started_at: datetime
    finished_at: datetime
    tries: tuple[FailedTry, ...] = ()
    """The failed tries before the outcome, oldest first (the last 20 of them): empty when
    the first try stood."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ExecutionSummary:
    """One line of ``list``."""

    id: uuid.UUID
    workflow: str
    queue: str
    status: Status
    attempts: int
    created_at: datetime
    finished_at: datetime | None
    app_version: str | None = None
    tags: dict[str, str] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class QueueStat:
    """Live executions of one queue in one status.

    ``oldest_age_s`` is the age in seconds of the oldest queued one (None for other statuses).
    """

    queue: str
    status: str
    count: int
    oldest_age_s: float | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Stats:
    """What ``stats`` shows: live work by queue and status, running by worker, totals."""

    queues: list[QueueStat]
    running_by_worker: dict[str, int]
    totals: dict[str, int]


@dataclass(frozen=True, slots=True, kw_only=True)
class Unclaimable:
    """Live executions of one workflow and queue that no live worker registers: they wait."""

    workflow: str
    queue: str
    count: int
    oldest_created_at: datetime
    given_back_by: list[str] | None = None
    """The app versions that gave these back (every live worker serving them runs one), or
    None: no live worker registers the workflow and queue."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LiveWorker:
    """A worker process seen within its lifetime: what it claims and its app version."""

    worker_id: str
    app_version: str
    workflows: list[str]
    queues: list[str]
    started_at: datetime
    seen_at: datetime


@dataclass(frozen=True, slots=True, kw_only=True)
class PatchUse:
    """One patch of one workflow: executions that recorded its marker, and the live ones
    that have not (they may still need the old code path)."""

    workflow: str
    patch: str
    at_step: int | None
    total_with: int
    live_with: int
    live_without: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Match:
    """Which executions, live and finished, a bulk action acts on: ``list``'s filters (None
    is any). *patch* with ``with_patch=False``: those of the patch's workflows that did not
    record it. *tags*: those carrying every one of these tags."""

    status: str | None = None
    workflow: str | None = None
    queue: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    app_version: str | None = None
    patch: str | None = None
    with_patch: bool = True
    tags: dict[str, str] | None = None

    def given(self) -> bool:
        """Whether any filter is set (a bulk action needs one)."""
        return any(v is not None for v in (self.status, self.workflow, self.queue,
                                           self.since, self.until, self.app_version,
                                           self.patch)) or bool(self.tags)

    def surely_matches(self, ex: Execution) -> bool:
        """Whether *ex* is certainly one this matches: False also when it cannot be told
        from *ex* alone (an app version or patch filter)."""
        if self.app_version is not None or self.patch is not None:
            return False
        return ((self.status is None or ex.status.value == self.status)
                and (self.workflow is None or ex.workflow == self.workflow)
                and (self.queue is None or ex.queue == self.queue)
                and (self.since is None or ex.created_at >= self.since)
                and (self.until is None or ex.created_at < self.until)
                and (not self.tags or (ex.tags or {}).items() >= self.tags.items()))


@dataclass(slots=True, kw_only=True)
class BulkResult:
    """What a bulk action did so far (:meth:`kestrel.Client.bulk`).

    *matched*: executions the filters matched (a dry run counts them all; otherwise those
    seen so far). *acted*: cancelled, retried or signalled (under *key*: a run again with it
    acts on none of them twice). *skipped*: by reason (``"already cancelled"``, ``"not
    failed, cancelled or quarantined"``, ``"finished"``, …). *sample*: the first ids matched.
    *cursor*: where the next page starts, or None when every page was done."""

    action: str
    key: str
    matched: int = 0
    acted: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    sample: list[uuid.UUID] = field(default_factory=list)
    cursor: tuple[datetime, uuid.UUID] | None = None
    dry_run: bool = False

    def skip(self, why: str) -> None:
        """Count one execution passed over for *why*."""
        self.skipped[why] = self.skipped.get(why, 0) + 1

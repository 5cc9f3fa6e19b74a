"""Replay before deploy: run recorded histories through new workflow code, writing nothing.

A history is what a claim hands the runner (:class:`~kestrel.types.Claimed`: arguments,
checkpoints with their patch markers, the wait a parked execution is at) plus the recorded
status. :func:`replay_one` runs the workflow code on it with a :class:`Context` in
``read_only`` mode and a :class:`ReadOnlyWriter`: a position the history holds returns its
recorded output (or raises its recorded error), exactly as at a claim, through the same
checks (``NonDeterminismError``, ``CodeTooOld``); at the first position the history does not
hold, after the checks a claim makes there, the replay of that execution ends
(:class:`~kestrel.workflow.steps.HistoryEnd`). No step body runs, nothing is parked, signalled or
written: a new patch marker stays in the writer's memory, which is how the replay knows the
code takes a new path. One mechanism decides both at claim time and here, so a replay and a
deploy cannot disagree.

Histories come from the database (:func:`histories_from_db`, one read-only snapshot; the
``replay_history`` statement) or from a JSON-lines file that ``kestrel-runtime
export-histories`` wrote (:func:`write_history`, :func:`read_histories`), so CI can replay
without the production database. A file is input from outside: each line is bounded,
parsed as every door parses JSON, and checked field by field; a bad one raises
:class:`HistoryFileError` naming the line.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import IO, Any

import orjson
import psycopg

from kestrel import buckets, codec, connections, db, statements
from kestrel.definitions import WorkflowFn, retired_patches
from kestrel.errors import (
    CodeTooOld,
    ConfigError,
    ExecutionNotFound,
    KestrelError,
    NonDeterminismError,
    StepFailed,
)
from kestrel.lease import Lease
from kestrel.sql import queries
from kestrel.types import Claimed, RecordedStep, SignalTaken, Status, StepSaved, StepWrite
from kestrel.workflow import Context
from kestrel.workflow.steps import PATCH_STEP, HistoryEnd

FORMAT = "kestrel-history/1"
"""The ``format`` of every line ``export-histories`` writes; a reader refuses any other."""

REPLAY_TIMEOUT_S = 30.0
"""Default seconds one execution's replay may take before it is reported stuck: workflow
code between two ctx calls runs for real (only step bodies are skipped)."""

LIVE = frozenset({Status.QUEUED.value, Status.RUNNING.value, Status.WAITING.value})

# Statuses whose execution the new code would run (live ones) or that a replay should
# reproduce (completed): a workflow error or a missing workflow there is a regression. A
# failed, cancelled or quarantined one ended otherwise; it runs again only if retried.
_MUST_RUN = LIVE | {Status.COMPLETED.value}

_MAX_STEP_ID = 2**31 - 1


class HistoryFileError(KestrelError, ValueError):
    """A line of a histories file is not a history ``export-histories`` writes."""


class ReplayFailed(AssertionError):
    """:func:`kestrel.testing.replay` found executions the new code would break; the
    message has one line per execution. ``results`` holds every result."""

    def __init__(self, message: str, results: list[ReplayResult]) -> None:
        super().__init__(message)
        self.results = results


@dataclass(frozen=True, slots=True, kw_only=True)
class History:
    """One execution's recorded history, as a claim would load it."""

    claimed: Claimed
    status: str
    app_version: str | None = None

    @property
    def id(self) -> uuid.UUID:
        """The execution's id."""
        return self.claimed.id

    @property
    def workflow(self) -> str:
        """The workflow name it was submitted under."""
        return self.claimed.workflow


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayResult:
    """What replaying one history through the new code found.

    *outcome* is one of ``same`` (the code takes the recorded path), ``new_path`` (it takes
    the new path of *patches*, which the recording never saw), ``diverges`` (it calls
    *called* at step *position* where the history records *recorded*), ``too_old`` (the
    history recorded a patch this code does not know: a worker of it gives the execution
    back), ``raises`` (the workflow code raises where the execution did not fail),
    ``stuck`` (no ctx call within the timeout), ``not_in_app`` (no such workflow in the
    app) or ``broken`` (the history cannot be loaded: the runtime fails it too).
    """

    id: uuid.UUID
    workflow: str
    status: str
    outcome: str
    failed: bool
    detail: str
    replayed: int = 0
    position: int | None = None
    recorded: str | None = None
    called: str | None = None
    patches: tuple[str, ...] = ()

    @property
    def line(self) -> str:
        """The one line ``kestrel-runtime replay`` prints for it."""
        mark = "FAIL" if self.failed else "ok  "
        return f"{mark} {self.id}  {self.workflow} ({self.status}): {self.detail}"

    def as_dict(self) -> dict[str, Any]:
        """The result as JSON-ready values (``replay --json``)."""
        return {"id": str(self.id), "workflow": self.workflow, "status": self.status,
                "outcome": self.outcome, "failed": self.failed, "detail": self.detail,
                "replayed": self.replayed, "position": self.position,
                "recorded": self.recorded, "called": self.called,
                "patches": list(self.patches)}


@dataclass
class ReadOnlyWriter:
    """The Writer of a replay: writes nothing anywhere.

    A read-only Context ends the replay before any step body, park or signal, so the only
    write that reaches it is a new patch marker, which it keeps in memory and answers as
    recorded (the code then goes down the path it would take). Anything else is a bug in
    the Context, and raises.
    """

    markers: list[tuple[str, int]] = field(default_factory=list)

    async def save_step(self, write: StepWrite) -> StepSaved:
        """Keep a new patch marker in memory; answer it as recorded."""
        if write.step_id >= 0 or not write.name.startswith(PATCH_STEP) or write.output is None:
            raise AssertionError(f"a replay writes nothing, but was asked to checkpoint "
                                 f"{write.name!r} at {write.step_id}")
        output = orjson.loads(write.output)
        self.markers.append((write.name[len(PATCH_STEP):], int(output.get("at", 0))))
        return StepSaved(owned=True, inserted=True,
                         recorded=RecordedStep(write.name, output, None))

    def _refuse(self, what: str) -> AssertionError:
        return AssertionError(f"a replay writes nothing, but was asked to {what}")

    async def park(self, lease: Lease, *, step_id: int, waiting_for: str,
                   seconds: float | None, seen_seq: int | None) -> str:
        """Refuse (a read-only Context never parks)."""
        raise self._refuse("park")

    async def load_step(self, lease: Lease, *, step_id: int) -> RecordedStep | None:
        """Refuse (only a park refused as recorded reads a checkpoint back)."""
        raise self._refuse("read a checkpoint back")

    async def consume_signal(self, lease: Lease, *, step_id: int, name: str,
                             step_name: str) -> SignalTaken:
        """Refuse (a read-only Context never consumes a signal)."""
        raise self._refuse("consume a signal")

    async def set_event(self, lease: Lease, key: str, value: str) -> bool:
        """Refuse (a read-only Context never publishes an event)."""
        raise self._refuse("set an event")

    async def set_tags(self, lease: Lease, tags: str) -> bool:
        """Refuse (a read-only Context never changes tags)."""
        raise self._refuse("set tags")

    async def submit_child(self, lease: Lease, *, workflow: str, args: str, queue: str,
                           priority: int, key: str, timeout_s: float | None) -> uuid.UUID:
        """Refuse (a read-only Context never starts a child)."""
        raise self._refuse("start a child")

    async def send_signal(self, lease: Lease, execution_id: uuid.UUID, name: str,
                          payload: str | None, key: str) -> bool:
        """Refuse (a read-only Context never sends a signal)."""
        raise self._refuse("send a signal")


# -- replaying -----------------------------------------------------------------------------


async def replay_one(history: History, workflows: Mapping[str, WorkflowFn], *,
                     timeout: float = REPLAY_TIMEOUT_S) -> ReplayResult:
    """Replay *history* through *workflows* (name → workflow function); write nothing."""
    c = history.claimed
    base: dict[str, Any] = {"id": c.id, "workflow": c.workflow, "status": history.status}
    if c.broken is not None:
        return ReplayResult(**base, outcome="broken", failed=True,
                            detail=f"cannot be replayed: {_one_line(c.broken)}")
    fn = workflows.get(c.workflow)
    if fn is None:
        live = history.status in LIVE
        return ReplayResult(**base, outcome="not_in_app", failed=live,
                            detail=f"workflow {c.workflow!r} is not in the app"
                                   + (": this live execution would wait for ever for a "
                                      "worker that registers it" if live else
                                      " (finished: nothing left to run)"))
    writer = ReadOnlyWriter()
    lease = Lease(c, trusted_until=math.inf, claimed_at=time.monotonic())
    ctx = Context(c, c.workflow, writer, lease, retired_patches=retired_patches(fn),
                  read_only=True)
    raised: BaseException | None = None
    stuck = False
    try:
        await asyncio.wait_for(ctx.run_workflow(fn, *c.args), timeout)
    except HistoryEnd:
        pass
    except TimeoutError:
        stuck = ctx.history_end is None and ctx.decision is None
    except Exception as exc:
        raised = exc
    if ctx.history_end is None and not stuck:
        # The workflow's own end, as the runner checks it (FAULTS O5).
        with contextlib.suppress(CodeTooOld):
            ctx.check_end()
    decision = ctx.decision
    end = ctx.history_end
    upto = end.position if end is not None else ctx.next_position
    replayed = sum(1 for k in c.steps if 0 <= k < upto)
    patches = tuple(p for p, _ in writer.markers)
    if isinstance(decision, CodeTooOld):
        return ReplayResult(**base, outcome="too_old", failed=True, replayed=replayed,
                            detail=f"needs newer code: {_one_line(decision)}")
    if isinstance(decision, NonDeterminismError):
        if decision.position is not None:
            detail = (f"diverges at step {decision.position} (recorded `{decision.recorded}`,"
                      f" code calls `{decision.called}`)")
        else:
            detail = f"diverges: {_one_line(decision)}"
        return ReplayResult(**base, outcome="diverges", failed=True, replayed=replayed,
                            detail=detail, position=decision.position,
                            recorded=decision.recorded, called=decision.called)
    if decision is not None:  # nothing else is decided without a writer or a lease to lose
        return ReplayResult(**base, outcome="raises", failed=True, replayed=replayed,
                            detail=f"the runtime decided {type(decision).__name__}: "
                                   f"{_one_line(decision)}")
    if stuck:
        return ReplayResult(**base, outcome="stuck", failed=True, replayed=replayed,
                            detail=f"reached no step, wait or end within {timeout:g}s "
                                   f"(after step {upto - 1})")
    if raised is not None and end is None:
        described = (f"{raised.error_type}: {raised.error_message} (recorded by step "
                     f"{raised.step_name!r})" if isinstance(raised, StepFailed)
                     else f"{type(raised).__name__}: {raised}")
        must = history.status in _MUST_RUN
        detail = (f"the workflow raises {described} after step {upto - 1}"
                  + ("" if must else f", as an execution that ended {history.status} may"))
        return ReplayResult(**base, outcome="raises", failed=must, replayed=replayed,
                            detail=_one_line(detail))
    where = (f"the code goes on at step {end.position} with {end.what}" if end is not None
             else "the workflow returns")
    counted = f"{replayed} checkpoint{'s' if replayed != 1 else ''} replayed; {where}"
    if patches:
        at = ", ".join(f"{p!r} (at step {a})" for p, a in writer.markers)
        return ReplayResult(**base, outcome="new_path", failed=False, replayed=replayed,
                            patches=patches, position=writer.markers[0][1],
                            detail=f"takes the new path after patch {at}; {counted}")
    return ReplayResult(**base, outcome="same", failed=False, replayed=replayed,
                        position=end.position if end is not None else None,
                        detail=f"same path ({counted})")


def _one_line(exc: BaseException | str) -> str:
    text = str(exc)
    return " ".join(text.split())


def summary(results: Sequence[ReplayResult]) -> str:
    """One line counting *results* by outcome: ``replayed 3 executions: 2 same path, …``."""
    names = {"same": "same path", "new_path": "new path", "diverges": "diverging",
             "too_old": "needing newer code", "raises": "raising", "stuck": "stuck",
             "not_in_app": "not in the app", "broken": "not replayable"}
    counts: dict[str, int] = {}
    for r in results:
        counts[r.outcome] = counts.get(r.outcome, 0) + 1
    parts = [f"{n} {names[k]}" for k, n in counts.items()]
    failed = sum(1 for r in results if r.failed)
    n = len(results)
    return (f"replayed {n} execution{'s' if n != 1 else ''}: "
            + (", ".join(parts) if parts else "none") + f"; {failed} failed")


def resolve_workflows(workflows: Mapping[str, WorkflowFn] | Iterable[WorkflowFn] | None,
                      ) -> dict[str, WorkflowFn]:
    """*workflows* as name → function: a mapping as it is, registered workflow functions by
    their names, None: every registered workflow."""
    from kestrel.definitions import registry, workflow_name

    if workflows is None:
        return registry()
    if isinstance(workflows, Mapping):
        return dict(workflows)
    return {workflow_name(fn): fn for fn in workflows}


# -- histories from the database -----------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Selection:
    """Which executions to read: *ids* (each must exist), else the newest *limit* matching
    *workflow*, *status* and *since* (live and finished alike)."""

    ids: tuple[uuid.UUID, ...] = ()
    workflow: str | None = None
    status: str | None = None
    since: datetime | None = None
    limit: int | None = None

    def matches(self, h: History) -> bool:
        """Whether a history read from a file is selected (ids, workflow, status, since)."""
        created = h.claimed.created_at
        return ((not self.ids or h.id in self.ids)
                and (self.workflow is None or h.workflow == self.workflow)
                and (self.status is None or h.status == self.status)
                and (self.since is None or created is None or created >= self.since))


DEFAULT_LIMIT = 100
MAX_LIMIT = 100_000


def check_selection(sel: Selection) -> None:
    """Refuse a selection that names nothing sensible.

    Raises:
        ConfigError: a limit out of 1-100000, or an unknown status.
    """
    if sel.limit is not None and not 1 <= sel.limit <= MAX_LIMIT:
        raise ConfigError(f"--limit {sel.limit}: must be 1-{MAX_LIMIT}")
    statuses = [s.value for s in Status]
    if sel.status is not None and sel.status not in statuses:
        raise ConfigError(f"--status {sel.status!r}: must be one of {', '.join(statuses)}")


def histories_from_db(dsn: str, schema: str, sel: Selection, *,
                      max_history_bytes: int = codec.MAX_HISTORY_BYTES) -> Iterator[History]:
    """Yield the selected histories from one read-only snapshot (REPEATABLE READ, READ
    ONLY: PostgreSQL refuses any write in it, and every execution is read as of one
    moment, so none is missed or seen twice as it moves to history).

    Raises:
        ExecutionNotFound: an id in ``sel.ids`` names no execution.
        ConfigError: see :func:`check_selection`.
        psycopg.Error: the database cannot be reached or read.
    """
    check_selection(sel)
    q = queries(schema)
    with connections.connect(dsn, autocommit=False, prepare_threshold=None) as conn:
        conn.read_only = True
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        try:
            # A namespace spread over buckets (kestrel.buckets) is read in every bucket's
            # schema, in the same snapshot; each execution in the bucket its id names.
            made = (db.run_sync(conn, statements.migrate.read_bucket(q))
                    if db.run_sync(conn, statements.migrate.bucket_table_exists(q)) else None)
            qs = [queries(s) for s in buckets.served_by(schema, made)]
            ids: Sequence[uuid.UUID] = sel.ids
            if not ids:
                limit = sel.limit or DEFAULT_LIMIT
                rows = buckets.merge_list([db.run_sync(conn, statements.client.list_executions(
                    one, status=sel.status, workflow=sel.workflow, since=sel.since,
                    limit=limit)) for one in qs], limit)
                ids = [r.id for r in rows]
            for eid in ids:
                home = qs[buckets.bucket_of(eid, len(qs))] if len(qs) > 1 else q
                row = db.run_sync(conn, statements.versions.replay_history(
                    home, id=eid, max_history_bytes=max_history_bytes))
                if row is None:
                    raise ExecutionNotFound(f"no execution {eid} in schema {schema}")
                yield history_from_row(row)
        finally:
            conn.rollback()


def history_from_row(row: Sequence[Any]) -> History:
    """A ``replay_history`` row as a History, decoded as a claim decodes its row (a value
    that cannot be decoded, a history over the bound: ``claimed.broken``)."""
    (eid, workflow, status, args, wait_step, waiting_for, app_version, created_at,
     steps) = row
    claimed = statements.executions.claimed_from_texts(
        id=eid, workflow=workflow, args=args, steps=steps,
                                    wait_step=wait_step, waiting_for=waiting_for,
                                    created_at=created_at)
    return History(claimed=claimed, status=status, app_version=app_version)


# -- histories in a file -------------------------------------------------------------------


def write_history(out: IO[bytes], h: History) -> None:
    """Write *h* as one JSON line of the ``export-histories`` format."""
    c = h.claimed
    line: dict[str, Any] = {
        "format": FORMAT, "id": str(c.id), "workflow": c.workflow, "status": h.status,
        "app_version": h.app_version,
        "created_at": c.created_at.isoformat() if c.created_at is not None else None,
        "wait_step": c.wait_step, "waiting_for": c.waiting_for,
        "args": c.args,
        "steps": [[k, s.name, s.output, s.error] for k, s in sorted(c.steps.items())],
    }
    if c.broken is not None:
        line["broken"] = f"{type(c.broken).__name__}: {_one_line(c.broken)}"
        line["args"], line["steps"] = [], []
    out.write(orjson.dumps(line) + b"\n")


def line_limit(max_history_bytes: int, max_payload_bytes: int) -> int:
    """The longest line :func:`read_histories` reads: a history's checkpoints and arguments
    at their bounds, plus room for the rest."""
    return max_history_bytes + max_payload_bytes + 64 * 1024


def read_histories(source: IO[bytes], *, name: str, max_line_bytes: int,
                   ) -> Iterator[History]:
    """Yield the histories of a JSON-lines file that ``export-histories`` wrote.

    Blank lines are skipped. Each line is read with a bound (*max_line_bytes*), parsed by the
    decoder every door uses (:func:`kestrel.codec.decode_exact`) and checked field by field.

    Raises:
        HistoryFileError: a line is too long, not JSON, nested too deeply, or not a history
            of this format (the message names the file and line).
    """
    for number, raw in enumerate(_lines(source, name, max_line_bytes), start=1):
        if not raw.strip():
            continue
        where = f"{name} line {number}"
        try:
            obj = codec.decode_exact(raw)
        except RecursionError:
            raise HistoryFileError(f"{where}: nested too deeply to be a history") from None
        except ValueError as exc:
            raise HistoryFileError(f"{where}: not JSON that reads back unchanged "
                                   f"({_one_line(str(exc))[:200]})") from None
        try:
            yield _history(obj)
        except (ValueError, TypeError, KeyError) as exc:
            raise HistoryFileError(f"{where}: not a kestrel history: "
                                   f"{_one_line(str(exc))[:300]}") from None


def _lines(source: IO[bytes], name: str, limit: int) -> Iterator[bytes]:
    number = 0
    while True:
        raw = source.readline(limit + 1)
        if not raw:
            return
        number += 1
        if len(raw) > limit:
            raise HistoryFileError(f"{name} line {number}: longer than {limit} bytes (the "
                                   "bound is --max-history-bytes + --max-payload-bytes)")
        yield raw


def _history(obj: Any) -> History:
    """Check one parsed line field by field; raise ValueError/TypeError naming the field."""
    if not isinstance(obj, dict):
        raise TypeError(f"expected a JSON object, got {type(obj).__name__}")
    if obj.get("format") != FORMAT:
        raise ValueError(f"format must be {FORMAT!r}, got {str(obj.get('format'))[:60]!r}")
    eid = uuid.UUID(_field(obj, "id", str))
    workflow = codec.check_text(_field(obj, "workflow", str), what="workflow")
    status = _field(obj, "status", str)
    if status not in {s.value for s in Status}:
        raise ValueError(f"status {status[:40]!r} is not a status")
    args = _field(obj, "args", list)
    raw_steps = _field(obj, "steps", list)
    steps: dict[int, RecordedStep] = {}
    for i, s in enumerate(raw_steps):
        if not (isinstance(s, list) and len(s) == 4):
            raise TypeError(f"steps[{i}] must be [step_id, name, output, error]")
        k, step_name, output, error = s
        if not isinstance(k, int) or isinstance(k, bool) or not -_MAX_STEP_ID <= k <= \
                _MAX_STEP_ID:
            raise TypeError(f"steps[{i}]: the step id must be an integer")
        if k in steps:
            raise ValueError(f"steps[{i}]: step {k} appears twice")
        codec.check_text(step_name, what=f"steps[{i}] name")
        if error is not None and not isinstance(error, dict):
            raise TypeError(f"steps[{i}]: the error must be an object or null")
        steps[k] = RecordedStep(step_name, output, error)
    wait_step = _field(obj, "wait_step", int, optional=True)
    if wait_step is not None and not 0 <= wait_step <= _MAX_STEP_ID:
        raise ValueError("wait_step must be a step position")
    waiting_for = _field(obj, "waiting_for", str, optional=True)
    if waiting_for is not None:
        codec.check_text(waiting_for, what="waiting_for")
    app_version = _field(obj, "app_version", str, optional=True)
    created = _field(obj, "created_at", str, optional=True)
    created_at = datetime.fromisoformat(created) if created is not None else None
    broken_text = _field(obj, "broken", str, optional=True)
    broken = HistoryFileError(broken_text) if broken_text is not None else None
    claimed = Claimed(eid, workflow, args, 0, 1, steps, wait_step, None, 0, None, False, None,
                      created_at, broken, waiting_for=waiting_for)
    return History(claimed=claimed, status=status, app_version=app_version)


def _field(obj: dict[str, Any], key: str, kind: type, *, optional: bool = False) -> Any:
    if key not in obj:
        if optional:
            return None
        raise KeyError(f"no {key!r}")
    value = obj[key]
    if value is None and optional:
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TypeError(f"{key!r} must be {kind.__name__}"
                        + (" or null" if optional else "")
                        + f", got {type(value).__name__}")
    return value


async def replay_all(histories: Iterable[History], workflows: Mapping[str, WorkflowFn], *,
                     timeout: float = REPLAY_TIMEOUT_S) -> list[ReplayResult]:
    """Replay each of *histories* in turn; return every result."""
    return [await replay_one(h, workflows, timeout=timeout) for h in histories]


def failure_message(results: Sequence[ReplayResult]) -> str:
    """The message of :class:`ReplayFailed`: each failing execution's line, then the count."""
    bad = [r.line for r in results if r.failed]
    return ("the new code would break recorded executions:\n  " + "\n  ".join(bad)
            + "\n" + summary(results))

"""The exceptions kestrel raises. Every one derives from :class:`KestrelError`."""

from __future__ import annotations


class KestrelError(Exception):
    """Base class of every error kestrel raises on purpose."""


class ConfigError(KestrelError, ValueError):
    """A setting is invalid; the message names the setting."""


class SerializationError(KestrelError, TypeError):
    """A value cannot be stored as JSON and read back unchanged."""


class PayloadTooLarge(SerializationError):
    """An encoded value is larger than the configured cap (``max_payload_bytes``)."""


class IdempotencyConflict(KestrelError):
    """An idempotency key is already used by an execution with other arguments."""

    def __init__(self, message: str, *, key: str) -> None:
        super().__init__(message)
        self.key = key


class DuplicateExecution(KestrelError):
    """A live execution already holds that dedup key in that queue (``on_duplicate="reject"``)."""


class UnknownWorkflow(KestrelError, LookupError):
    """No workflow of that name is registered in this process."""


class ExecutionNotFound(KestrelError, LookupError):
    """No execution has that id."""


class InvalidState(KestrelError):
    """The execution is not in a state that allows the operation (e.g. retry of a live one,
    a signal to a finished one)."""


class DeadlineExceeded(KestrelError):
    """The workflow ran past the deadline given at submit (``timeout=``)."""


class Cancelled(KestrelError):
    """The execution was cancelled; raised inside the workflow at its next step boundary."""


class ParentCancelled(Cancelled, InvalidState):
    """A child cannot be started (or retried): its parent is cancelled or being cancelled.

    Inside the parent's workflow it is a :class:`Cancelled`; to a caller of the SQL
    functions an :class:`InvalidState`.
    """


class MigrationError(KestrelError):
    """The schema cannot be brought to the version this code needs."""


class LeaseLost(KestrelError):
    """This worker no longer owns the execution: its lease expired or a newer claim fenced it.

    The worker drops the execution without writing anything more; the owner of the newer
    epoch finishes it.
    """


class NonDeterminismError(KestrelError):
    """A replay called a different step at a position that already has a checkpoint.

    The execution fails with this reason even if workflow code catches the exception: going
    on would pair checkpoints with the wrong steps. Where the replay met another call than
    the history holds, *position* is that step position, *recorded* what the history holds
    there and *called* what the code called (step names as checkpoints record them, e.g.
    ``kestrel.sleep``); ``kestrel-runtime replay`` reports them.
    """

    def __init__(self, message: str, *, position: int | None = None,
                 recorded: str | None = None, called: str | None = None) -> None:
        super().__init__(message)
        self.position = position
        self.recorded = recorded
        self.called = called


class ConcurrentCallError(NonDeterminismError):
    """A kestrel call made concurrently in a way whose step position would depend on timing
    (which body finished first), not on the workflow's code: refused before it takes a
    position, so a replay can never hand one call another's output. See the README,
    "Parallel steps"."""


class CodeTooOld(NonDeterminismError):
    """A replay diverged where newer code recorded a patch this code does not know.

    The execution was run by a newer version of the workflow (a rolling deploy, or a
    rollback): this worker gives it back to the queue, unfailed, for a worker of that version.
    """


class StepFailed(KestrelError):
    """A step exhausted its retries; its error is checkpointed and replays raise it again."""

    def __init__(self, step_name: str, error_type: str, message: str) -> None:
        super().__init__(f"step {step_name!r} failed: {error_type}: {message}")
        self.step_name = step_name
        self.error_type = error_type
        self.error_message = message


class WorkflowFailed(KestrelError):
    """The awaited execution ended failed, cancelled or quarantined."""

    def __init__(self, execution_id: object, status: str, error: object) -> None:
        super().__init__(f"execution {execution_id} ended {status}: {error}")
        self.execution_id = execution_id
        self.status = status
        self.error = error


class ChildFailed(WorkflowFailed):
    """A child execution awaited with ``ctx.child``/``ctx.wait_child`` did not complete."""


class HistoryTooLarge(KestrelError):
    """The execution's recorded history is larger than ``max_history_bytes``: it cannot be
    loaded to replay, so it fails instead of stalling every claim that meets it."""


class WriteRejected(KestrelError):
    """The database refused one of this execution's writes as such (a value it cannot
    store); the rest of its group commit went through. The execution fails with this."""


class UndecodableInput(KestrelError):
    """Stored arguments or checkpoints that the runtime cannot decode unchanged (e.g. a
    number beyond float range submitted through SQL); the execution fails with this."""

"""Workflows, steps and the replay context.

A workflow is an ``async def`` taking a :class:`Context` and its JSON arguments. Each
``await ctx.step(fn, *args)`` is numbered in call order. When a step already has a checkpoint
the recorded output is returned (or its recorded error raised) without running the body; when
it has none the body runs, its output is encoded and checkpointed, and the workflow goes on
only after that checkpoint has committed. Whatever the live run got back is exactly what every
replay gets back, because both read the stored value.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import random
import traceback
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, ParamSpec, Protocol, TypeVar, overload

from kestrel import codec
from kestrel.errors import (
    LeaseLost,
    NonDeterminismError,
    SerializationError,
    StepFailed,
)
from kestrel.types import Claimed, RecordedStep, StepSaved, StepWrite

if TYPE_CHECKING:
    from concurrent.futures import Executor

P = ParamSpec("P")
T = TypeVar("T")

WorkflowFn = Callable[..., Awaitable[Any]]

_registry: dict[str, WorkflowFn] = {}


W = TypeVar("W", bound=WorkflowFn)


@overload
def workflow(fn: W, /) -> W: ...
@overload
def workflow(*, name: str | None = None) -> Callable[[W], W]: ...
def workflow(fn: W | None = None, *, name: str | None = None) -> W | Callable[[W], W]:
    """Register an ``async def f(ctx, *args)`` as a workflow, under *name* or its own name.

    Usable bare (``@workflow``) or with arguments (``@workflow(name="incident")``).
    """

    def register(f: W) -> W:
        is_async: bool = inspect.iscoroutinefunction(f)
        if not is_async:
            raise TypeError(f"workflow {f.__qualname__} must be an async def")
        wf_name = name or f.__name__
        existing = _registry.get(wf_name)
        if existing is not None and existing is not f:
            raise ValueError(f"workflow name {wf_name!r} is already registered")
        _registry[wf_name] = f
        f.__kestrel_workflow__ = wf_name  # type: ignore[attr-defined]
        return f

    return register(fn) if fn is not None else register


def registry() -> dict[str, WorkflowFn]:
    """Return the registered workflows by name (a copy)."""
    return dict(_registry)


def workflow_name(wf: WorkflowFn | str) -> str:
    """Return the registered name of *wf* (a workflow function or a name)."""
    if isinstance(wf, str):
        return wf
    name = getattr(wf, "__kestrel_workflow__", None)
    if name is None:
        raise TypeError(f"{wf!r} is not a @kestrel.workflow")
    return str(name)


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryPolicy:
    """How a failing step is retried inside one claim.

    Attempt *n* (from 1) waits ``min(max_delay, base_delay * 2**(n-1))`` scaled by a random
    factor in [0.5, 1.0] ("equal jitter") before the next attempt.
    """

    attempts: int = 1
    base_delay: float = 0.5
    max_delay: float = 30.0
    retry_on: tuple[type[BaseException], ...] = (Exception,)

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("retry attempts must be at least 1")
        if self.base_delay < 0 or self.max_delay < 0:
            raise ValueError("retry delays must not be negative")

    def delay(self, attempt: int) -> float:
        cap = min(self.max_delay, self.base_delay * 2.0 ** (attempt - 1))
        return cap * random.uniform(0.5, 1.0)


@dataclass(frozen=True, slots=True)
class StepSpec:
    name: str
    retry: RetryPolicy


@overload
def step(fn: Callable[P, T], /) -> Callable[P, T]: ...
@overload
def step(
    *,
    name: str | None = None,
    retries: int = 0,
    base_delay: float = 0.5,
    max_delay: float = 30.0,
    retry_on: tuple[type[BaseException], ...] = (Exception,),
) -> Callable[[Callable[P, T]], Callable[P, T]]: ...
def step(
    fn: Callable[P, T] | None = None,
    *,
    name: str | None = None,
    retries: int = 0,
    base_delay: float = 0.5,
    max_delay: float = 30.0,
    retry_on: tuple[type[BaseException], ...] = (Exception,),
) -> Callable[P, T] | Callable[[Callable[P, T]], Callable[P, T]]:
    """Mark a function (``async def`` or plain ``def``) as a step with a retry policy.

    ``retries`` is the number of extra attempts after the first. Plain functions run in a
    worker thread so they never block the event loop. Undecorated functions can be passed to
    :meth:`Context.step` too; they get no retries.
    """

    def mark(f: Callable[P, T]) -> Callable[P, T]:
        f.__kestrel_step__ = StepSpec(  # type: ignore[attr-defined]
            name or f.__qualname__,
            RetryPolicy(attempts=retries + 1, base_delay=base_delay, max_delay=max_delay,
                        retry_on=retry_on),
        )
        return f

    return mark(fn) if fn is not None else mark


def _spec(fn: Callable[..., Any]) -> StepSpec:
    spec = getattr(fn, "__kestrel_step__", None)
    if isinstance(spec, StepSpec):
        return spec
    return StepSpec(getattr(fn, "__qualname__", repr(fn)), RetryPolicy())


@dataclass(frozen=True, slots=True)
class StepInfo:
    """The step a body is running as: use :attr:`idempotency_key` for calls downstream."""

    execution_id: uuid.UUID
    step_id: int
    name: str
    attempt: int
    lease_epoch: int

    @property
    def idempotency_key(self) -> str:
        """Stable across every retry and replay of this step; differs between steps."""
        return f"{self.execution_id}:{self.step_id}"


_current_step: contextvars.ContextVar[StepInfo] = contextvars.ContextVar("kestrel_step")


def current_step() -> StepInfo:
    """Return the step whose body is running (raises LookupError outside a step body)."""
    return _current_step.get()


def describe_error(exc: BaseException) -> dict[str, str]:
    """Return the stored form of an exception: type, message and traceback."""
    return {
        "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
        "message": codec.printable(str(exc), 8192),
        "traceback": codec.printable("".join(traceback.format_exception(exc))),
    }


class Writer(Protocol):
    """What a Context needs from its worker: the group-commit writer and the lease clock."""

    async def save_step(self, write: StepWrite) -> StepSaved:
        """Checkpoint *write* in the next group commit; return what is now recorded."""

    def trusted(self, execution_id: uuid.UUID) -> bool:
        """Whether the lease on *execution_id* is surely still ours (worker's monotonic clock)."""


@dataclass(eq=False)
class Context:
    """Handed to every workflow: run steps, read the execution's identity."""

    claimed: Claimed
    workflow: str
    writer: Writer
    executor: Executor | None = None
    max_payload_bytes: int = codec.DEFAULT_MAX_PAYLOAD_BYTES
    _next_step: int = field(default=0, init=False)
    nondeterminism: NonDeterminismError | None = field(default=None, init=False)

    @property
    def execution_id(self) -> uuid.UUID:
        return self.claimed.id

    @property
    def attempt(self) -> int:
        """How many times this execution has been claimed, this claim included."""
        return self.claimed.attempt

    @overload
    async def step(self, fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T: ...
    @overload
    async def step(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T: ...
    async def step(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Return the recorded output of the next step, or run *fn* once and record it.

        Raises:
            StepFailed: the step failed (now, or in the run that recorded it).
            NonDeterminismError: a different step was recorded at this position.
            LeaseLost: this worker no longer owns the execution.
        """
        spec = _spec(fn)
        step_id = self._next_step
        self._next_step += 1
        recorded = self.claimed.steps.get(step_id)
        if recorded is not None:
            return self._replay(step_id, spec.name, recorded)
        if not self.writer.trusted(self.execution_id):
            raise LeaseLost(f"lease of {self.execution_id} may have expired; not starting a step")
        started = datetime.now(UTC)
        output: str | None = None
        error: str | None = None
        attempt = 1
        while True:
            info = StepInfo(self.execution_id, step_id, spec.name, attempt, self.claimed.epoch)
            try:
                value = await self._run_body(info, fn, args, kwargs)
                output = codec.encode(
                    value,
                    what=f"output of step {spec.name!r} in workflow {self.workflow!r}",
                    max_bytes=self.max_payload_bytes,
                )
                break
            except SerializationError as exc:
                error = codec.encode(describe_error(exc), what="step error")
                break
            except (LeaseLost, asyncio.CancelledError):
                raise
            except Exception as exc:
                if attempt >= spec.retry.attempts or not isinstance(exc, spec.retry.retry_on):
                    error = codec.encode(describe_error(exc), what="step error")
                    break
                await asyncio.sleep(spec.retry.delay(attempt))
                if not self.writer.trusted(self.execution_id):
                    raise LeaseLost(f"lease of {self.execution_id} expired during a retry") from exc
                attempt += 1
        saved = await self.writer.save_step(
            StepWrite(self.execution_id, self.claimed.epoch, step_id, spec.name, output, error,
                      attempt, started)
        )
        if not saved.owned:
            raise LeaseLost(f"execution {self.execution_id} was claimed by a newer epoch")
        assert saved.recorded is not None
        return self._replay(step_id, spec.name, saved.recorded)

    def _replay(self, step_id: int, name: str, recorded: RecordedStep) -> Any:
        if recorded.name != name:
            self.nondeterminism = NonDeterminismError(
                f"workflow {self.workflow!r} called step {name!r} at position {step_id}, "
                f"but the recorded history has {recorded.name!r} there; the workflow code "
                "changed under a running execution"
            )
            raise self.nondeterminism
        if recorded.error is not None:
            raise StepFailed(name, recorded.error.get("type", "Error"),
                             recorded.error.get("message", ""))
        return recorded.output

    async def _run_body(
        self, info: StepInfo, fn: Callable[..., Any], args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        token = _current_step.set(info)
        try:
            if inspect.iscoroutinefunction(fn):
                return await fn(*args, **kwargs)
            loop = asyncio.get_running_loop()
            call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
            return await loop.run_in_executor(self.executor, call)
        finally:
            _current_step.reset(token)

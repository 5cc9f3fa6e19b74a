"""Declaring workflows and steps: the registry, ``@workflow``, ``@step`` with its retry
policy, what a running step knows about itself (:func:`current_step`), and how an error is
stored. :mod:`kestrel.workflow` re-exports all of it next to the replay :class:`Context`.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import random
import traceback
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar, overload
from uuid import UUID

from kestrel import codec

P = ParamSpec("P")
T = TypeVar("T")

WorkflowFn = Callable[..., Awaitable[Any]]

_registry: dict[str, WorkflowFn] = {}


W = TypeVar("W", bound=WorkflowFn)


@overload
def workflow(fn: W, /) -> W: ...
@overload
def workflow(*, name: str | None = None,
             retired_patches: Iterable[str] = ()) -> Callable[[W], W]: ...
def workflow(fn: W | None = None, *, name: str | None = None,
             retired_patches: Iterable[str] = ()) -> W | Callable[[W], W]:
    """Register an ``async def f(ctx, *args)`` as a workflow, under *name* or its own name.

    Usable bare (``@workflow``) or with arguments (``@workflow(name="incident")``).

    *retired_patches*: ids of patches whose ``ctx.patched``/``ctx.deprecate_patch`` call was
    removed from this code (the last step of a change). Their markers in an execution's
    history are then this code's own: without the declaration, a marker the code never asks
    about means the history was written by newer code, and the worker gives the execution
    back (``CodeTooOld``) instead of running it; with it, the execution runs, and a real
    divergence fails with ``NonDeterminismError``.

    Raises:
        TypeError: *retired_patches* is a single string, not a collection of ids.
        SerializationError: a retired id is not a valid patch id (1-1024 characters, no NUL).
    """
    if isinstance(retired_patches, str):
        raise TypeError("retired_patches must be a collection of patch ids, not one string")
    retired = frozenset(codec.check_text(p, what="retired patch id") for p in retired_patches)

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
        f.__kestrel_retired_patches__ = retired  # type: ignore[attr-defined]
        return f

    return register(fn) if fn is not None else register


def registry() -> dict[str, WorkflowFn]:
    """Return the registered workflows by name (a copy)."""
    return dict(_registry)


def retired_patches(wf: WorkflowFn) -> frozenset[str]:
    """The patch ids *wf* declared retired (``@workflow(retired_patches=…)``)."""
    retired = getattr(wf, "__kestrel_retired_patches__", None)
    return retired if isinstance(retired, frozenset) else frozenset()


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
        """Return the seconds to wait after failed attempt *attempt* (from 1), jittered."""
        cap = min(self.max_delay, self.base_delay * 2.0 ** (attempt - 1))
        return cap * random.uniform(0.5, 1.0)


@dataclass(frozen=True, slots=True)
class StepSpec:
    """A step's name (recorded, and checked on replay) and its retry policy."""

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
    """The step's name and retry policy. The name comes from code, never from ``repr()``:
    it must be the same in every process (it is checked on replay) and it is a metric label,
    so an address or a partial's arguments must never reach it (FAULTS P7)."""
    spec = getattr(fn, "__kestrel_step__", None)
    if isinstance(spec, StepSpec):
        return spec
    if isinstance(fn, functools.partial):
        return _spec(fn.func)
    name = getattr(fn, "__qualname__", None)
    if not isinstance(name, str):  # a callable object: its class names it
        name = type(fn).__qualname__
    return StepSpec(name, RetryPolicy())


@dataclass(frozen=True, slots=True)
class StepInfo:
    """The step a body is running as: use :attr:`idempotency_key` for calls downstream."""

    execution_id: UUID
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
    """Return the stored form of an exception: type, message and traceback. Never raises,
    whatever the exception's ``__str__`` does."""
    kind, message = _kind_and_message(exc)
    try:
        trace = "".join(traceback.format_exception(exc))
    except Exception:
        trace = "".join(traceback.format_tb(exc.__traceback__)) + f"{kind}: {message}\n"
    return {"type": kind, "message": codec.printable(message, 8192),
            "traceback": codec.printable(trace)}


def _kind_and_message(exc: BaseException) -> tuple[str, str]:
    # A class can be named anything (type("a\0b", …)): its name is stored as text too.
    kind = codec.printable(f"{type(exc).__module__}.{type(exc).__qualname__}", 512)
    try:
        return kind, str(exc)
    except Exception as broken:
        return kind, f"<str() of this {type(exc).__name__} raised {type(broken).__name__}>"


TRIES_KEPT = 20
"""How many failed tries of one step its checkpoint keeps: the last ones (each has its
attempt number, so a gap says how many came before). A step retried a thousand times stays
one bounded row."""

TRY_MESSAGE_CHARS = 2000
"""The most of a failed try's message kept (the outcome's own error keeps 8,192 and its
traceback)."""


def note_failed_try(tries: list[dict[str, Any]] | None, attempt: int, exc: BaseException,
                    after_s: float) -> list[dict[str, Any]]:
    """Add the try *attempt* that raised *exc*, *after_s* seconds into the step, to *tries*
    (a new list when None), keeping the last :data:`TRIES_KEPT`; return it. Stored with the
    checkpoint (``operation_outputs.tries``, migration 0023); the database gives it a time
    (``started_at + after_s``), not this process's clock."""
    kind, message = _kind_and_message(exc)
    entry = {"attempt": attempt, "type": kind,
             "message": codec.printable(message, TRY_MESSAGE_CHARS),
             "after_s": round(max(0.0, after_s), 6)}
    kept = [] if tries is None else tries
    kept.append(entry)
    del kept[:-TRIES_KEPT]
    return kept

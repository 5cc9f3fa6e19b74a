"""OpenTelemetry traces: a span per execution attempt and per step, in the submitter's trace.

Optional: it needs the ``opentelemetry-api`` package (``pip install 'kestrel-runtime[otel]'``)
and a tracer provider the application configures (the SDK, an exporter). Without the package
nothing here imports it and every call returns at once; without a provider no span is made
and the only cost is one ``isinstance`` per attempt.

The trace context travels in the execution's row as the W3C trace context headers
(``traceparent``, ``tracestate``; migration 0018): ``Client.submit`` takes the current span's,
the HTTP door takes the request's headers, a child takes its parent's step span (or, with
tracing off in the worker, its parent's row), and the claim hands it to whichever worker
runs the execution. Each attempt's span is a child of the submitter's span; each step run
in it, a child of the attempt's span. So all the attempts of one execution, on any worker
and after any crash or wait, are one trace.

A step a replay returns from its checkpoint makes no span: its body does not run, and a span
for it would read as a second run. The attempt's span counts such steps instead
(``kestrel.steps.replayed``). Durable waits (sleeps, signal waits) and patch markers make no
step span either; an attempt that parks at a wait ends with ``kestrel.outcome = parked``.

Span names: ``workflow <name>`` and ``step <name>``. Attributes (all spans):
``kestrel.workflow``, ``kestrel.execution.id``, ``kestrel.execution.attempt`` (the claim's
attempt count), ``kestrel.lease.epoch``, ``kestrel.outcome``. Attempt spans add
``kestrel.worker.id`` and ``kestrel.steps.replayed``; step spans add ``kestrel.step.name``,
``kestrel.step.position`` and ``kestrel.step.attempt`` (tries of the body, retries
included). Outcomes of an attempt: completed, failed, cancelled (what it committed), parked,
given_back, lost, fenced, refused, released (the worker stopped) or interrupted; of a step:
ok, error (its body failed; the error is recorded as the step's) or interrupted (the
runtime stopped it before its checkpoint: lease lost, cancelled).

The header rules (:func:`parse_traceparent`, :func:`parse_tracestate`) are the SQL
functions' ``trace_parent_or_null`` and ``trace_state_or_null``: a malformed value is
ignored, never stored and never an error.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from types import ModuleType, TracebackType
from typing import TYPE_CHECKING, Any

from kestrel.errors import StepFailed

if TYPE_CHECKING:
    from kestrel.types import Claimed

log = logging.getLogger("kestrel.tracing")

_TRACEPARENT = re.compile(r"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
_KEY = re.compile(r"[a-z][a-z0-9_*/-]{0,255}|[a-z0-9][a-z0-9_*/-]{0,240}@[a-z][a-z0-9_*/-]{0,13}")
MAX_TRACESTATE = 512
"""Characters of tracestate kept (the W3C recommendation asks for at least 512)."""

TraceContext = tuple[str, str | None]
"""A checked (traceparent, tracestate)."""


def parse_traceparent(value: object) -> str | None:
    """*value* if it is a W3C traceparent as version 00 writes it (lowercase hex, a trace id
    and a parent id that are not all zeros), else None."""
    if not isinstance(value, str) or len(value) != 55 or not _TRACEPARENT.fullmatch(value):
        return None
    if value[3:35] == "0" * 32 or value[36:52] == "0" * 16:
        return None
    return value


def parse_tracestate(value: object) -> str | None:
    """*value* if it is a W3C tracestate of at most 512 characters and 32 list members (each
    ``key=value`` by the recommendation's grammar; empty members and spaces or tabs around
    members allowed), else None; None too when it has no member."""
    if not isinstance(value, str) or len(value) > MAX_TRACESTATE:
        return None
    count = 0
    for raw in value.split(","):
        member = raw.strip(" \t")
        if not member:
            continue
        count += 1
        key, eq, val = member.partition("=")
        if (count > 32 or not eq or not _KEY.fullmatch(key) or not 1 <= len(val) <= 256
                or val[-1] == " " or "=" in val or not all(" " <= ch <= "~" for ch in val)):
            return None
    return value if count else None


def from_headers(traceparent: Sequence[str], tracestate: Sequence[str]) -> TraceContext | None:
    """The trace context of a request's ``traceparent`` and ``tracestate`` header values
    (every occurrence of each), or None: none, more than one traceparent, or a malformed
    one. A malformed tracestate is dropped alone."""
    if len(traceparent) != 1:
        return None
    parent = parse_traceparent(traceparent[0])
    if parent is None:
        return None
    return parent, parse_tracestate(",".join(tracestate)) if tracestate else None


_api: ModuleType | None = None
_loaded = False


def _trace() -> ModuleType | None:
    """``opentelemetry.trace``, imported on first use; None when it is not installed."""
    global _api, _loaded
    if not _loaded:
        try:
            from opentelemetry import trace
        except ImportError:
            trace = None  # type: ignore[assignment]
        _api, _loaded = trace, True
    return _api


def current() -> TraceContext | None:
    """The current span's trace context (what a submit made now continues), or None: no
    OpenTelemetry, or no span is current."""
    trace = _trace()
    if trace is None:
        return None
    sc = trace.get_current_span().get_span_context()
    if not sc.is_valid:
        return None
    parent = f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{int(sc.trace_flags) & 0xff:02x}"
    state = parse_tracestate(sc.trace_state.to_header()) if sc.trace_state else None
    return parent, state


_tracer: tuple[Any, Any] | None = None  # (provider, its tracer for kestrel)


def start_attempt(claimed: Claimed, worker_id: str) -> Attempt | None:
    """Start the span of an attempt at *claimed* (not yet current: :meth:`Attempt.attach`),
    or None when there is no OpenTelemetry or no tracer provider is configured.

    Never raises: a provider that fails (the API promises it does not, a custom one may)
    costs the attempt its span, never the execution."""
    global _tracer
    trace = _trace()
    if trace is None:
        return None
    try:
        provider = trace.get_tracer_provider()
        if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
            return None
        if _tracer is None or _tracer[0] is not provider:
            _tracer = (provider, provider.get_tracer("kestrel"))
        return Attempt(trace, _tracer[1], claimed, worker_id)
    except Exception:
        log.exception("could not start the span of an attempt at %s; running it untraced",
                      claimed.id)
        return None


def _remote_parent(trace: ModuleType, claimed: Claimed) -> Any:
    """The OpenTelemetry context of the row's trace context, or None (a new trace)."""
    parent = parse_traceparent(claimed.traceparent)
    if parent is None:
        return None
    state = trace.TraceState()
    if claimed.tracestate:
        state = trace.TraceState.from_header([claimed.tracestate])
    remote = trace.SpanContext(trace_id=int(parent[3:35], 16), span_id=int(parent[36:52], 16),
                               is_remote=True, trace_flags=trace.TraceFlags(int(parent[53:], 16)),
                               trace_state=state)
    return trace.set_span_in_context(trace.NonRecordingSpan(remote))


class Attempt:
    """The span of one attempt at an execution, and the steps it runs."""

    __slots__ = ("_attrs", "_token", "_trace", "_tracer", "context", "outcome", "replayed",
                 "span")

    def __init__(self, trace: ModuleType, tracer: Any, claimed: Claimed,
                 worker_id: str) -> None:
        self._trace = trace
        self._tracer = tracer
        self._attrs: dict[str, Any] = {
            "kestrel.workflow": claimed.workflow,
            "kestrel.execution.id": str(claimed.id),
            "kestrel.execution.attempt": claimed.attempt,
            "kestrel.lease.epoch": claimed.epoch,
        }
        parent = _remote_parent(trace, claimed)
        self.span = tracer.start_span(f"workflow {claimed.workflow}", context=parent,
                                      attributes={**self._attrs, "kestrel.worker.id": worker_id})
        self.context = trace.set_span_in_context(self.span, parent)
        self.outcome = "interrupted"
        self.replayed = 0
        self._token: Any = None

    def attach(self) -> None:
        """Make this attempt's span the current one (in this task; :meth:`end` detaches)."""
        from opentelemetry import context

        self._token = context.attach(self.context)

    def failed(self, error: BaseException) -> None:
        """Record the error the workflow ends with."""
        self.span.record_exception(error)

    def end(self) -> None:
        """End the span with its outcome; detach it if :meth:`attach` attached it. Never
        raises (see :func:`start_attempt`)."""
        try:
            self.span.set_attribute("kestrel.outcome", self.outcome)
            self.span.set_attribute("kestrel.steps.replayed", self.replayed)
            if self.outcome == "failed":
                self.span.set_status(self._trace.StatusCode.ERROR, "the workflow failed")
            if self._token is not None:
                from opentelemetry import context

                context.detach(self._token)
                self._token = None
            self.span.end()
        except Exception:
            log.exception("could not end the span of an attempt")

    def step(self, name: str, position: int) -> StepSpan:
        """The span of the step *name* at *position*, as a context manager."""
        return StepSpan(self, name, position)


class StepSpan:
    """The span of one step run (not a replay): current while its body runs."""

    __slots__ = ("_attempt", "_name", "_position", "_token", "span")

    def __init__(self, attempt: Attempt, name: str, position: int) -> None:
        self._attempt = attempt
        self._name = name
        self._position = position
        self._token: Any = None
        self.span: Any = None

    def __enter__(self) -> StepSpan:
        from opentelemetry import context

        a = self._attempt
        self.span = a._tracer.start_span(
            f"step {self._name}", context=a.context,
            attributes={**a._attrs, "kestrel.step.name": self._name,
                        "kestrel.step.position": self._position})
        self._token = context.attach(a._trace.set_span_in_context(self.span, a.context))
        return self

    def retried(self, tries: int, error: BaseException) -> None:
        """The body failed on try *tries* and will run again."""
        self.span.record_exception(error, attributes={"kestrel.step.attempt": tries})

    def tried(self, tries: int) -> None:
        """The body ran *tries* times in all."""
        self.span.set_attribute("kestrel.step.attempt", tries)

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        from opentelemetry import context

        trace = self._attempt._trace
        if error is None:
            outcome = "ok"
        elif isinstance(error, StepFailed):
            outcome = "error"
            why = f"{error.error_type}: {error.error_message}"
            self.span.set_status(trace.StatusCode.ERROR, why[:500])
        else:
            outcome = "interrupted"
            self.span.set_status(trace.StatusCode.ERROR, type(error).__name__)
        self.span.set_attribute("kestrel.outcome", outcome)
        context.detach(self._token)
        self.span.end()


def mark(attempt: Attempt | None, outcome: str) -> None:
    """Set the outcome of *attempt* (nothing when tracing is off)."""
    if attempt is not None:
        attempt.outcome = outcome

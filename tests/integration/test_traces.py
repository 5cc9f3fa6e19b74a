"""Traces across steps (issue 27): a span per attempt and per step, in the submitter's trace,
whichever worker runs the execution, from every door (the client, HTTP submits, webhooks,
children); exported for real over OTLP/HTTP to a receiver on loopback.

The global tracer provider is the SDK's, set once for the process; a gate passes spans to
this module's exporters only while its tests run."""

from __future__ import annotations

import gzip
import hashlib
import hmac
import http.server
import json
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
)
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import tests.apps.trace_app  # noqa: F401  (registers the workflows)
from kestrel import tracing
from kestrel.client import SyncClient
from kestrel.migrate import migrate
from tests.helpers import config, q, q1, run_worker_until
from tests.http_helpers import Api, free_port, make_token, serve_process

APP = "tests.apps.trace_app"
SECRET = "trace-secret-" + uuid.uuid4().hex


class Gate(SpanProcessor):
    """Passes ended spans to *targets* while open (a global provider cannot drop a
    processor, and other modules' workers must not fill this module's exporters)."""

    def __init__(self) -> None:
        self.targets: list[SpanProcessor] = []

    def on_start(self, span: Span, parent_context: otel_context.Context | None = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        for target in list(self.targets):
            target.on_end(span)


GATE = Gate()
EXPORTER = InMemorySpanExporter()


@pytest.fixture(scope="module", autouse=True)
def provider() -> Iterator[TracerProvider]:
    current = trace.get_tracer_provider()
    if not isinstance(current, TracerProvider):
        current = TracerProvider()
        trace.set_tracer_provider(current)
    assert trace.get_tracer_provider() is current
    current.add_span_processor(GATE)
    memory = SimpleSpanProcessor(EXPORTER)
    GATE.targets.append(memory)
    yield current
    GATE.targets.remove(memory)


@pytest.fixture(autouse=True)
def _fresh_spans() -> None:
    EXPORTER.clear()


def _spans(execution_id: uuid.UUID | str) -> list[ReadableSpan]:
    return [s for s in EXPORTER.get_finished_spans()
            if (s.attributes or {}).get("kestrel.execution.id") == str(execution_id)]


def _attempts(spans: list[ReadableSpan]) -> list[ReadableSpan]:
    found = [s for s in spans if s.name.startswith("workflow ")]
    return sorted(found, key=lambda s: s.start_time or 0)


def _steps(spans: list[ReadableSpan]) -> list[ReadableSpan]:
    found = [s for s in spans if s.name.startswith("step ")]
    return sorted(found, key=lambda s: s.start_time or 0)


def _finished(dsn: str, schema: str, eid: uuid.UUID | str) -> bool:
    return bool(q1(dsn, schema, "SELECT count(*) FROM {s}.workflow_history WHERE id = %s",
                   [str(eid)]))


def _status(dsn: str, schema: str, eid: uuid.UUID | str) -> str | None:
    rows = q(dsn, schema, "SELECT status FROM {s}.workflow_executions WHERE id = %s "
             "UNION ALL SELECT status FROM {s}.workflow_history WHERE id = %s",
             [str(eid), str(eid)])
    return rows[0][0] if rows else None


def _stored_trace(dsn: str, schema: str, eid: uuid.UUID | str) -> tuple[Any, Any]:
    rows = q(dsn, schema, "SELECT traceparent, tracestate FROM {s}.workflow_executions "
             "WHERE id = %s", [str(eid)])
    assert rows, f"execution {eid} is not live"
    return rows[0][0], rows[0][1]


def _ctx(span: ReadableSpan) -> trace.SpanContext:
    sc = span.get_span_context()
    assert sc is not None
    return sc


def test_a_client_submit_in_a_span_is_the_parent_of_the_attempt_and_its_steps(
        pg_dsn: str, schema: str) -> None:
    tracer = trace.get_tracer("tests.caller")
    with SyncClient(pg_dsn, schema=schema) as client:
        with tracer.start_as_current_span("caller") as caller:
            eid = client.submit("traces.steps", 41).id
        run_worker_until(pg_dsn, config(schema), lambda: _finished(pg_dsn, schema, eid))
        assert client.result(eid, timeout=10) == 42
    cc = caller.get_span_context()

    spans = _spans(eid)
    [attempt] = _attempts(spans)
    assert _ctx(attempt).trace_id == cc.trace_id
    assert attempt.parent is not None and attempt.parent.span_id == cc.span_id
    assert attempt.name == "workflow traces.steps"
    attrs = dict(attempt.attributes or {})
    assert attrs["kestrel.workflow"] == "traces.steps"
    assert attrs["kestrel.execution.attempt"] == 1
    assert attrs["kestrel.lease.epoch"] == 1
    assert attrs["kestrel.outcome"] == "completed"
    assert attrs["kestrel.steps.replayed"] == 0

    steps = _steps(spans)
    assert [s.name for s in steps] == ["step traces.add_one", "step traces.flaky"]
    for position, s in enumerate(steps):
        assert _ctx(s).trace_id == cc.trace_id
        assert s.parent is not None and s.parent.span_id == _ctx(attempt).span_id
        sa = dict(s.attributes or {})
        assert sa["kestrel.step.position"] == position
        assert sa["kestrel.outcome"] == "ok"
        assert sa["kestrel.lease.epoch"] == 1
    # The retried step: two tries, the failed one recorded as an event.
    assert dict(steps[1].attributes or {})["kestrel.step.attempt"] == 2
    assert [e.name for e in steps[1].events] == ["exception"]
    assert dict(steps[0].attributes or {})["kestrel.step.attempt"] == 1


def test_a_limited_queues_claim_continues_the_trace_too(pg_dsn: str, schema: str) -> None:
    """claim_limited returns the context as claim_batch does."""
    tracer = trace.get_tracer("tests.caller")
    with SyncClient(pg_dsn, schema=schema) as client:
        with tracer.start_as_current_span("caller") as caller:
            eid = client.submit("traces.steps", 1, queue="traced").id
        run_worker_until(pg_dsn, config(schema, queues=["traced"],
                                        queue_limits="traced:concurrency=2"),
                         lambda: _finished(pg_dsn, schema, eid))
    [attempt] = _attempts(_spans(eid))
    assert attempt.parent is not None
    assert attempt.parent.span_id == caller.get_span_context().span_id
    assert len(_steps(_spans(eid))) == 2


def test_a_submit_without_a_span_stores_no_context_and_starts_a_trace_per_attempt(
        pg_dsn: str, schema: str) -> None:
    with SyncClient(pg_dsn, schema=schema) as client:
        eid = client.submit("traces.steps", 1).id
        assert _stored_trace(pg_dsn, schema, eid) == (None, None)
        run_worker_until(pg_dsn, config(schema), lambda: _finished(pg_dsn, schema, eid))
    [attempt] = _attempts(_spans(eid))
    assert attempt.parent is None
    assert {_ctx(s).trace_id for s in _steps(_spans(eid))} == {_ctx(attempt).trace_id}


def test_steps_on_two_workers_are_one_trace_and_replayed_steps_make_no_span(
        pg_dsn: str, schema: str) -> None:
    """The first worker runs a step and parks at a signal, then stops; the signal wakes
    the execution on a second worker, which replays the first step and runs the last."""
    tracer = trace.get_tracer("tests.caller")
    with SyncClient(pg_dsn, schema=schema) as client:
        with tracer.start_as_current_span("caller") as caller:
            eid = client.submit("traces.approval", 1).id
        run_worker_until(pg_dsn, config(schema, worker_id="worker-one"),
                         lambda: _status(pg_dsn, schema, eid) == "waiting")
        client.signal(eid, "go", 10)
        run_worker_until(pg_dsn, config(schema, worker_id="worker-two"),
                         lambda: _finished(pg_dsn, schema, eid))
        assert client.result(eid, timeout=10) == 13
    cc = caller.get_span_context()

    spans = _spans(eid)
    first, second = _attempts(spans)
    assert {_ctx(s).trace_id for s in spans} == {cc.trace_id}
    for a in (first, second):
        assert a.parent is not None and a.parent.span_id == cc.span_id
    fa, sa = dict(first.attributes or {}), dict(second.attributes or {})
    assert (fa["kestrel.worker.id"], sa["kestrel.worker.id"]) == ("worker-one", "worker-two")
    assert (fa["kestrel.outcome"], sa["kestrel.outcome"]) == ("parked", "completed")
    assert (fa["kestrel.lease.epoch"], sa["kestrel.lease.epoch"]) == (1, 2)
    assert (fa["kestrel.steps.replayed"], sa["kestrel.steps.replayed"]) == (0, 1)

    # One span per step that ran: the first under the first attempt; the second attempt
    # replayed it (no span) and ran the last step (position 2: the wait is position 1).
    steps = _steps(spans)
    assert [(s.name, dict(s.attributes or {})["kestrel.step.position"]) for s in steps] == [
        ("step traces.add_one", 0), ("step traces.add_one", 2)]
    assert steps[0].parent is not None and steps[0].parent.span_id == _ctx(first).span_id
    assert steps[1].parent is not None and steps[1].parent.span_id == _ctx(second).span_id


def test_a_child_continues_its_parents_trace(pg_dsn: str, schema: str) -> None:
    tracer = trace.get_tracer("tests.caller")
    with SyncClient(pg_dsn, schema=schema) as client:
        with tracer.start_as_current_span("caller") as caller:
            eid = client.submit("traces.parent", 1).id
        run_worker_until(pg_dsn, config(schema), lambda: _finished(pg_dsn, schema, eid))
        assert client.result(eid, timeout=10) == 3
    trace_id = caller.get_span_context().trace_id
    parent_steps = _steps(_spans(eid))
    [start] = [s for s in parent_steps if s.name == "step kestrel.start_child:traces.steps"]
    child_id = q1(pg_dsn, schema, "SELECT id FROM {s}.workflow_history WHERE parent_id = %s",
                  [str(eid)])
    [child] = _attempts(_spans(child_id))
    assert _ctx(child).trace_id == trace_id
    # The child's attempt is a child of the parent's step that started it.
    assert child.parent is not None and child.parent.span_id == _ctx(start).span_id
    assert {_ctx(s).trace_id for s in _steps(_spans(child_id))} == {trace_id}


def test_a_child_inherits_its_parents_stored_context_in_sql(pg_dsn: str, schema: str) -> None:
    """A child whose submitter gives no context (a worker with tracing off) takes its
    parent's, in submit() itself."""
    parent_tp = f"00-{uuid.uuid4().hex}-{uuid.uuid4().hex[:16]}-01"
    parent = q1(pg_dsn, schema, "SELECT {s}.submit('traces.parent', '[1]', "
                "p_traceparent => %s, p_tracestate => 'k=v')", [parent_tp])
    child = q1(pg_dsn, schema, "SELECT {s}.submit('traces.steps', '[1]', p_parent => %s)",
               [str(parent)])
    assert _stored_trace(pg_dsn, schema, child) == (parent_tp, "k=v")
    own = f"00-{uuid.uuid4().hex}-{uuid.uuid4().hex[:16]}-00"
    other = q1(pg_dsn, schema, "SELECT {s}.submit('traces.steps', '[2]', p_parent => %s, "
               "p_traceparent => %s)", [str(parent), own])
    assert _stored_trace(pg_dsn, schema, other) == (own, None)


# -- the HTTP door ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def door(pg_dsn: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """``kestrel-runtime serve`` (no workers) on its own schema, with a token and a hook."""
    schema = f"t_{uuid.uuid4().hex[:12]}"
    migrate(pg_dsn, schema, test_clock=True)
    folder = tmp_path_factory.mktemp("traces")
    cfg = folder / "kestrel.toml"
    cfg.write_text('[hooks.traced]\nworkflow = "traces.hooked"\nformat = "hmac"\n'
                   'secret_env = "T_TRACE_SECRET"\n')
    with serve_process(pg_dsn, schema, port=free_port(), log=folder / "serve.log", app=APP,
                       args=["--config", str(cfg)],
                       env={"T_TRACE_SECRET": SECRET}) as api:
        api.token = make_token(pg_dsn, schema, "tracer", "submit")
        yield {"api": api, "schema": schema}
    q(pg_dsn, schema, "DROP SCHEMA {s} CASCADE")


def _traceparent() -> tuple[str, int, int]:
    trace_id, span_id = uuid.uuid4().int, uuid.uuid4().int >> 64
    return f"00-{trace_id:032x}-{span_id:016x}-01", trace_id, span_id


def test_an_http_submit_with_a_traceparent_header_is_continued_by_the_steps(
        pg_dsn: str, door: dict[str, Any]) -> None:
    api: Api = door["api"]
    schema = door["schema"]
    header, trace_id, span_id = _traceparent()
    reply = api.post("/api/v1/workflows/traces.steps/submit", {"args": [5]},
                     headers={"traceparent": header, "tracestate": "vendor=abc,other=x y"})
    assert reply.status == 201, reply.body
    eid = reply.json()["id"]
    assert _stored_trace(pg_dsn, schema, eid) == (header, "vendor=abc,other=x y")
    run_worker_until(pg_dsn, config(schema), lambda: _finished(pg_dsn, schema, eid))

    spans = _spans(eid)
    [attempt] = _attempts(spans)
    assert _ctx(attempt).trace_id == trace_id
    assert attempt.parent is not None and attempt.parent.span_id == span_id
    assert attempt.parent.is_remote
    assert _ctx(attempt).trace_state.to_header() == "vendor=abc,other=x y"
    steps = _steps(spans)
    assert [s.name for s in steps] == ["step traces.add_one", "step traces.flaky"]
    assert {_ctx(s).trace_id for s in steps} == {trace_id}


def test_an_http_submit_is_one_trace_with_its_steps_on_two_workers(
        pg_dsn: str, door: dict[str, Any]) -> None:
    """End to end (issue 27): the caller's traceparent on an HTTP submit; a first worker runs
    a step and parks at a signal, a second one resumes it: both attempts and every step
    that ran are in the caller's trace, children of its span."""
    api: Api = door["api"]
    schema = door["schema"]
    header, trace_id, span_id = _traceparent()
    reply = api.post("/api/v1/workflows/traces.approval/submit", {"args": [1]},
                     headers={"traceparent": header})
    assert reply.status == 201, reply.body
    eid = reply.json()["id"]
    run_worker_until(pg_dsn, config(schema, worker_id="worker-one"),
                     lambda: _status(pg_dsn, schema, eid) == "waiting")
    with SyncClient(pg_dsn, schema=schema, pool_size=0) as client:
        client.signal(eid, "go", 10)
        run_worker_until(pg_dsn, config(schema, worker_id="worker-two"),
                         lambda: _finished(pg_dsn, schema, eid))
        assert client.result(eid, timeout=10) == 13

    spans = _spans(eid)
    first, second = _attempts(spans)
    assert {_ctx(s).trace_id for s in spans} == {trace_id}
    assert [dict(a.attributes or {})["kestrel.worker.id"] for a in (first, second)] == [
        "worker-one", "worker-two"]
    for a in (first, second):
        assert a.parent is not None and a.parent.span_id == span_id and a.parent.is_remote
    steps = _steps(spans)
    assert [(s.parent.span_id if s.parent else None) for s in steps] == [
        _ctx(first).span_id, _ctx(second).span_id]


def test_a_webhook_with_a_traceparent_header_is_continued_by_the_steps(
        pg_dsn: str, door: dict[str, Any]) -> None:
    api: Api = door["api"]
    schema = door["schema"]
    header, trace_id, span_id = _traceparent()
    body = json.dumps({"n": 7, "delivery": uuid.uuid4().hex}).encode()
    signature = "sha256=" + hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
    reply = api.post("/hooks/traced", body, token=None, headers={
        "X-Signature-256": signature, "Content-Type": "application/json",
        "traceparent": header})
    assert reply.status == 200, reply.body
    eid = reply.json()["id"]
    assert _stored_trace(pg_dsn, schema, eid) == (header, None)
    run_worker_until(pg_dsn, config(schema), lambda: _finished(pg_dsn, schema, eid))
    spans = _spans(eid)
    [attempt] = _attempts(spans)
    assert attempt.parent is not None and attempt.parent.span_id == span_id
    [step] = _steps(spans)
    assert _ctx(step).trace_id == trace_id
    assert step.parent is not None and step.parent.span_id == _ctx(attempt).span_id


HOSTILE = [
    "00-" + "0" * 32 + "-" + "1" * 16 + "-01",           # all-zero trace id
    "00-" + "1" * 32 + "-" + "0" * 16 + "-01",           # all-zero parent id
    "00-" + "A" * 32 + "-" + "1" * 16 + "-01",           # uppercase
    "ff-" + "1" * 32 + "-" + "1" * 16 + "-01",           # the forbidden version
    "01-" + "1" * 32 + "-" + "1" * 16 + "-01-extra",     # a future version
    "00-" + "1" * 32 + "-" + "1" * 16 + "-01-",          # trailing field
    "00-" + "1" * 32 + "-" + "1" * 16 + "-1",            # short flags
    "00-" + "1" * 31 + "-" + "1" * 17 + "-01",
    "00-" + "1" * 32 + "-" + "1" * 16 + "-01' OR 1=1 --",
    "'); DROP TABLE workflow_executions; --",
    "00-" + "1" * 32 + "-" + "1" * 16 + "-01" + "x" * 10_000,  # a 10 KB header
    "0" * 10_240,
    "",
]


def test_hostile_traceparent_headers_are_ignored_never_stored(
        pg_dsn: str, door: dict[str, Any]) -> None:
    api: Api = door["api"]
    schema = door["schema"]
    good, _, _ = _traceparent()
    # (headers, what is stored): hostile traceparents store nothing; a good one with a
    # hostile tracestate stores the traceparent alone. SQL-looking text that is a valid
    # tracestate value is data like any other, stored as sent.
    sqlish = "k=v'; DROP SCHEMA x; --"
    cases: list[tuple[dict[str, str], tuple[Any, Any]]] = [
        ({"traceparent": h}, (None, None)) for h in HOSTILE]
    cases += [
        ({"traceparent": good, "tracestate": "x" * 10_240}, (good, None)),  # 10 KB
        ({"traceparent": good, "tracestate": "k=v" + ",k=v" * 3000}, (good, None)),
        ({"traceparent": good, "tracestate": "UPPER=case"}, (good, None)),
        ({"traceparent": good, "tracestate": "k=v,=;DROP TABLE x"}, (good, None)),
        ({"traceparent": good, "tracestate": sqlish}, (good, sqlish)),
        ({"traceparent": "00-" + "1" * 32 + "-" + "1" * 16 + "-01\x00"}, (None, None)),  # NUL
        ({"traceparent": "00-" + "1" * 32 + "-" + "1" * 16 + "-01\x7f"}, (None, None)),
        ({"traceparent": good, "tracestate": "k=v\x00"}, (good, None)),
    ]
    for i, (headers, want) in enumerate(cases):
        reply = api.post("/api/v1/workflows/traces.steps/submit", {"args": [i]},
                         headers=headers)
        # The HTTP server itself refuses a header with a control character (NUL, DEL) as
        # a malformed request: then nothing was submitted. Otherwise the submit goes
        # through with the bad context ignored.
        if reply.status == 400 and b"malformed HTTP request" in reply.body:
            assert any(ch in v for v in headers.values() for ch in "\x00\x7f"), headers
            assert q1(pg_dsn, schema, "SELECT count(*) FROM {s}.workflow_executions "
                      "WHERE args = jsonb_build_array(%s::int)", [i]) == 0
            continue
        assert reply.status == 201, (headers, reply.body)
        assert _stored_trace(pg_dsn, schema, reply.json()["id"]) == want, headers
    # Two traceparent headers: ambiguous, ignored (W3C).
    conn = __import__("http.client").client.HTTPConnection("127.0.0.1", api.port, timeout=30)
    try:
        conn.putrequest("POST", "/api/v1/workflows/traces.steps/submit")
        for name, value in (("Authorization", f"Bearer {api.token}"),
                            ("Content-Type", "application/json"),
                            ("traceparent", good), ("traceparent", _traceparent()[0]),
                            ("Content-Length", "2")):
            conn.putheader(name, value)
        conn.endheaders(b"{}")
        resp = conn.getresponse()
        assert resp.status == 201
        eid = json.loads(resp.read())["id"]
    finally:
        conn.close()
    assert _stored_trace(pg_dsn, schema, eid) == (None, None)


def test_the_sql_rules_are_the_python_rules(pg_dsn: str, schema: str) -> None:
    """submit() and kestrel.tracing agree on every value (the SQL door and the client)."""
    good, _, _ = _traceparent()
    parents = [good, good.upper(), good[:-2] + "00", *HOSTILE, good + "\n", " " + good,
               "00-" + "١" * 32 + "-" + "1" * 16 + "-01"]  # Arabic-Indic digits
    for value in parents:
        sql = q1(pg_dsn, schema, "SELECT {s}.trace_parent_or_null(%s)", [value])
        assert sql == tracing.parse_traceparent(value), value
    states = ["k=v", "k=v,l=w", " k=v , ,\tl=w ", "a@b=c", "0a@b=c", "0a=c", "k=", "=v",
              "k=v ", "k= v", "k=v=w", "K=v", "k=\x7f", "k=é", "k" * 257 + "=v",
              "k=" + "v" * 256, "k=" + "v" * 257, ",".join(f"k{i}=v" for i in range(32)),
              ",".join(f"k{i}=v" for i in range(33)), "x" * 600, "", " , ", "k=v;x"]
    for value in states:
        sql = q1(pg_dsn, schema, "SELECT {s}.trace_state_or_null(%s)", [value])
        assert sql == tracing.parse_tracestate(value), value


def test_submit_in_sql_ignores_a_malformed_context(pg_dsn: str, schema: str) -> None:
    for value in HOSTILE:
        eid = q1(pg_dsn, schema, "SELECT {s}.submit('traces.steps', '[1]', "
                 "p_traceparent => %s, p_tracestate => 'k=v')", [value])
        assert _stored_trace(pg_dsn, schema, eid) == (None, None), value
    # The old signature's callers (positional, twelve arguments) still resolve.
    eid = q1(pg_dsn, schema, "SELECT {s}.submit('traces.steps', '[1]', 'default', 0, NULL, "
             "NULL, NULL, NULL, NULL, NULL, 'return', NULL)")
    assert _stored_trace(pg_dsn, schema, eid) == (None, None)


# -- OTLP/HTTP ----------------------------------------------------------------------------


class _Receiver(http.server.BaseHTTPRequestHandler):
    received: list[ExportTraceServiceRequest]

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        type(self).received.append(request)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_spans_reach_an_otlp_http_receiver(pg_dsn: str, schema: str,
                                           monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    for name in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY",
                 "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    handler = type("Receiver", (_Receiver,), {"received": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    exporter = OTLPSpanExporter(endpoint=f"http://127.0.0.1:{server.server_port}/v1/traces",
                                timeout=10)
    otlp = SimpleSpanProcessor(exporter)
    GATE.targets.append(otlp)
    try:
        tracer = trace.get_tracer("tests.caller")
        with SyncClient(pg_dsn, schema=schema) as client:
            with tracer.start_as_current_span("caller") as caller:
                eid = client.submit("traces.steps", 1).id
            run_worker_until(pg_dsn, config(schema), lambda: _finished(pg_dsn, schema, eid))
    finally:
        GATE.targets.remove(otlp)
        exporter.shutdown()
        server.shutdown()
        server.server_close()
    want = caller.get_span_context().trace_id.to_bytes(16, "big")
    got: list[tuple[str, dict[str, Any]]] = []
    for request in handler.received:
        for rs in request.resource_spans:
            for ss in rs.scope_spans:
                for span in ss.spans:
                    if span.trace_id == want:
                        attrs = {a.key: a.value for a in span.attributes}
                        got.append((span.name, attrs))
    names = sorted(n for n, a in got if a.get("kestrel.execution.id") is not None
                   and a["kestrel.execution.id"].string_value == str(eid))
    assert names == ["step traces.add_one", "step traces.flaky", "workflow traces.steps"]
    assert "caller" in [n for n, _ in got]

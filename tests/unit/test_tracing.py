"""kestrel.tracing without a database: the W3C header rules, and a runtime that works (and
imports nothing of OpenTelemetry) when the API package is absent or no provider is set."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from opentelemetry.sdk.trace import TracerProvider

from kestrel import tracing
from tests.helpers import ROOT

GOOD = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.mark.parametrize("value", [
    GOOD, GOOD[:-2] + "00", GOOD[:-2] + "ff",
])
def test_a_well_formed_traceparent_is_kept_as_sent(value: str) -> None:
    assert tracing.parse_traceparent(value) == value


@pytest.mark.parametrize("value", [
    None, 42, b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "",
    GOOD.upper(), "ff" + GOOD[2:], "01" + GOOD[2:], GOOD + "-", GOOD + "\n", " " + GOOD,
    GOOD[:-1], GOOD + "\x00", "\x00" * 55, GOOD[:20] + "\ud800" + GOOD[21:],
    GOOD[:3] + "0" * 32 + GOOD[35:], GOOD[:36] + "0" * 16 + GOOD[52:],
    GOOD[:3] + "١" * 32 + GOOD[35:],  # digits, but not ASCII ones
    GOOD + "' OR 1=1 --", "'); DROP TABLE workflow_executions; --", GOOD + "x" * 10_240,
    "0" * 10_240,
])
def test_a_malformed_traceparent_is_refused(value: object) -> None:
    assert tracing.parse_traceparent(value) is None


@pytest.mark.parametrize(("value", "kept"), [
    ("k=v", True), ("k=v,l=w", True), (" k=v , ,\tl=w ", True), ("a@b=c", True),
    ("k=v ", True), ("k= v", True),  # spaces around a member; a value may start with one
    ("0a@b=c", True), ("k=v'; DROP TABLE x; --", True), ("k=" + "v" * 256, True),
    (",".join(f"k{i}=v" for i in range(32)), True),
    ("", False), (" , ", False), ("0a=c", False), ("K=v", False), ("k=", False),
    ("=v", False), ("k=v=w", False), ("k=\x00", False), ("k=\ud800", False),
    ("k=é", False), ("k=\x7f", False), ("k=" + "v" * 257, False), ("x" * 513, False),
    (",".join(f"k{i}=v" for i in range(33)), False), ("k=v" + ",k=v" * 3000, False),
])
def test_tracestate_rules(value: str, kept: bool) -> None:
    assert tracing.parse_tracestate(value) == (value if kept else None)


def test_headers_one_traceparent_and_an_optional_tracestate() -> None:
    assert tracing.from_headers([GOOD], []) == (GOOD, None)
    assert tracing.from_headers([GOOD], ["a=b", "c=d"]) == (GOOD, "a=b,c=d")
    assert tracing.from_headers([GOOD], ["A=b"]) == (GOOD, None)
    assert tracing.from_headers([GOOD, GOOD], []) is None  # two: ambiguous (W3C)
    assert tracing.from_headers([], ["a=b"]) is None
    assert tracing.from_headers([GOOD.upper()], ["a=b"]) is None


def test_current_is_the_current_spans_context() -> None:
    assert tracing.current() is None
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("caller") as span:
        sc = span.get_span_context()
        got = tracing.current()
    assert got == (f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{int(sc.trace_flags):02x}", None)
    assert got is not None and tracing.parse_traceparent(got[0]) == got[0]


RUN_A_WORKFLOW = """
import asyncio, sys, uuid
import kestrel, kestrel.client, kestrel.runner, kestrel.worker, kestrel.http.app
from kestrel import codec, tracing
from kestrel.client import SyncClient
from kestrel.types import Claimed, RecordedStep, StepSaved

@kestrel.step(name="t.add")
async def add(a: int, b: int) -> int:
    return a + b

@kestrel.workflow(name="t.flow")
async def flow(ctx: kestrel.Context, n: int) -> int:
    return await ctx.step(add, await ctx.step(add, n, 1), 1)

class Writer:
    async def save_step(self, w):
        return StepSaved(owned=True, inserted=True,
                         recorded=RecordedStep(w.name, codec.decode_exact(w.output), None))

class Lease:
    cancel_requested = False
    def trusted(self):
        return True

claimed = Claimed(uuid.uuid4(), "t.flow", [1], 1, 1, {{}},
                  traceparent="00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
attempt = tracing.start_attempt(claimed, "w")
assert attempt is None, attempt
ctx = kestrel.Context(claimed, "t.flow", Writer(), Lease(), trace=attempt)
assert asyncio.run(flow(ctx, 1)) == 3
assert tracing.current() is None
params = SyncClient("postgresql://unused.invalid/x")._submit_params(
    "t.flow", (1,), "default", 0, None, None)
assert params["traceparent"] is None and params["tracestate"] is None
loaded = sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry"
                and sys.modules[m] is not None)
assert loaded == {expected!r}, loaded
print("ok")
"""


def _run(prelude: str, expected: list[str]) -> None:
    script = prelude + textwrap.dedent(RUN_A_WORKFLOW).format(expected=expected)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         cwd=ROOT, timeout=120,
                         env={"PYTHONPATH": f"{ROOT / 'src'}:{ROOT}", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")


def test_the_runtime_works_with_opentelemetry_absent() -> None:
    """With the import blocked (as if the package were not installed) every door and the
    step path work, make no span and carry no context, and nothing tries to import it
    again."""
    _run("import sys\nsys.modules['opentelemetry'] = None\n", [])


def test_with_the_api_but_no_provider_nothing_is_traced() -> None:
    """The API installed, no provider configured: kestrel imports only opentelemetry.trace
    (on first use) and makes no span."""
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, kestrel, kestrel.runner, kestrel.worker, "
         "kestrel.client, kestrel.http.app\n"
         "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))"],
        capture_output=True, text=True, cwd=ROOT, timeout=120, check=True,
        env={"PYTHONPATH": f"{ROOT / 'src'}:{ROOT}", "PATH": "/usr/bin:/bin"})
    assert loaded.stdout.strip() == "[]", "kestrel imports OpenTelemetry before it is used"
    _run("", _api_modules())


def _api_modules() -> list[str]:
    """The modules ``import opentelemetry.trace`` loads, in a fresh interpreter."""
    out = subprocess.run(
        [sys.executable, "-c", "import sys, opentelemetry.trace\n"
         "print('\\n'.join(m for m in sys.modules if m.startswith('opentelemetry')))"],
        capture_output=True, text=True, timeout=120, check=True,
        env={"PATH": "/usr/bin:/bin"})
    return sorted(out.stdout.split())


def test_a_failing_provider_costs_the_span_never_the_execution(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import types
    import uuid

    import opentelemetry.trace as api

    from kestrel.types import Claimed

    class Broken(api.TracerProvider):
        def get_tracer(self, *args: object, **kwargs: object) -> api.Tracer:
            raise RuntimeError("a provider that breaks the API's promise")

    fake = types.ModuleType("opentelemetry.trace")
    fake.__dict__.update(api.__dict__)
    fake.get_tracer_provider = Broken  # type: ignore[attr-defined]
    monkeypatch.setattr(tracing, "_api", fake)
    monkeypatch.setattr(tracing, "_loaded", True)
    monkeypatch.setattr(tracing, "_tracer", None)
    claimed = Claimed(uuid.uuid4(), "w", [], 1, 1, {})
    assert tracing.start_attempt(claimed, "w") is None
    assert "running it untraced" in caplog.text

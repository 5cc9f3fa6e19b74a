"""kestrel.testing, the kit users test their own workflows with: a real worker in the test's
process, failures injected at a step, a crash right after a checkpoint, durable sleeps
skipped by moving the database clock, and the step timeline to assert on.

Every test here uses the plugin's own ``kestrel_env`` fixture (this suite's conftest only
points ``kestrel_dsn`` at the suite's server), so the plugin is what is tested."""

from __future__ import annotations

import asyncio
import math
import os
import re
import subprocess
import sys
import textwrap
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

import kestrel
from kestrel.testing import INTERNAL_STEPS, KestrelTestEnv, TimelineEntry, Waiting
from tests.apps import kit_app as app

ALERT = {"workload": "api"}
APPROVED = {"approval": {"approved": True}}


@pytest.fixture(autouse=True)
def _fresh_counts() -> None:
    app.bodies.clear()


def test_a_run_returns_the_result_and_the_step_timeline(kestrel_env: KestrelTestEnv) -> None:
    run = kestrel_env.run_to_completion(app.incident, ALERT, signals=APPROVED)
    assert run.assert_completed() == {"outcome": "PR: raise the memory limit of api"}
    assert run.timeline == [("kit.analyze", 1, "ok"), ("kit.generate_fix", 1, "ok"),
                            ("kestrel.signal:approval", 1, "ok"), ("kit.open_pr", 1, "ok")]
    run.assert_timeline(["kit.analyze", "kit.generate_fix", "kestrel.signal:approval",
                         ("kit.open_pr", 1, "ok")])
    assert run.step("kit.generate_fix").output["rca"] == "api ran out of memory"
    assert dict(app.bodies) == {"kit.analyze": 1, "kit.generate_fix": 1, "kit.open_pr": 1}
    assert run.crashes == 0 and run.skipped_s == 0


@pytest.mark.parametrize("queue", ["kit-ai", "kit-undeclared.queue:1"])
def test_the_worker_serves_the_queue_the_execution_is_in(
    kestrel_env: KestrelTestEnv, queue: str
) -> None:
    run = kestrel_env.run_to_completion(app.in_a_queue, ALERT, queue=queue, timeout=20)
    assert run.assert_completed() == "api ran out of memory"
    assert kestrel_env.client.get(run.id).queue == queue


def test_an_unknown_execution_id_is_a_lookup_error(kestrel_env: KestrelTestEnv) -> None:
    with pytest.raises(LookupError, match="no execution"):
        kestrel_env.run_until_finished("00000000-0000-0000-0000-000000000000", timeout=1)
    with pytest.raises(ValueError, match="badly formed"):
        kestrel_env.run_until_finished("'); DROP TABLE x; --", timeout=1)


def test_assert_timeline_names_the_difference(kestrel_env: KestrelTestEnv) -> None:
    run = kestrel_env.run_to_completion("kit.incident", ALERT, signals=APPROVED)
    with pytest.raises(AssertionError, match=r"recorded\n  TimelineEntry\(name='kit.analyze'"):
        run.assert_timeline(["kit.analyze", ("kit.generate_fix", 2, "ok")])
    with pytest.raises(AssertionError, match="no step 'nope'"):
        run.step("nope")


def test_an_injected_failure_goes_through_the_retry_policy(kestrel_env: KestrelTestEnv) -> None:
    kestrel_env.fail_step(app.analyze, TimeoutError("model timed out"), times=2)
    run = kestrel_env.run_to_completion(app.incident, ALERT, signals=APPROVED)
    run.assert_completed()
    # Attempts 1 and 2 raised instead of running the body; attempt 3 ran it and recorded.
    assert run.timeline[0] == TimelineEntry("kit.analyze", 3, "ok")
    assert app.bodies["kit.analyze"] == 1


def test_current_step_attempt_counts_the_tries_as_the_readme_says(
        kestrel_env: KestrelTestEnv) -> None:
    app.tries.clear()
    run = kestrel_env.run_to_completion(app.flaky_twice)
    assert run.assert_completed() == [1, 2, 3]
    assert run.timeline == [("kit.flaky", 3, "ok")]


def test_a_failure_past_the_retries_is_the_workflows_to_handle(
    kestrel_env: KestrelTestEnv,
) -> None:
    kestrel_env.fail_step("kit.analyze", TimeoutError("model timed out"), times=4)
    run = kestrel_env.run_to_completion(app.incident, ALERT, timeout=20)
    assert run.assert_completed() == {"outcome": "analysis failed"}
    assert run.timeline == [("kit.analyze", 4, "error")]  # retries=3: four attempts
    assert run.step("kit.analyze").error["type"] == "builtins.TimeoutError"
    assert app.bodies["kit.analyze"] == 0


def test_a_failure_outside_retry_on_fails_the_step_at_once(kestrel_env: KestrelTestEnv) -> None:
    kestrel_env.fail_step(app.analyze)  # a RuntimeError: not in retry_on
    run = kestrel_env.run_to_completion(app.incident, ALERT)
    assert run.timeline == [("kit.analyze", 1, "error")]
    assert "injected failure in 'kit.analyze'" in run.step("kit.analyze").error["message"]


def test_an_exception_class_is_raised_as_the_step_error(kestrel_env: KestrelTestEnv) -> None:
    kestrel_env.fail_step(app.generate_fix, PermissionError)
    run = kestrel_env.run_to_completion(app.incident, ALERT)
    assert run.status is kestrel.Status.FAILED
    assert run.timeline == [("kit.analyze", 1, "ok"), ("kit.generate_fix", 1, "error")]
    assert run.step("kit.generate_fix").error["type"] == "builtins.PermissionError"


def test_a_failure_armed_for_another_attempt_or_step_never_fires(
    kestrel_env: KestrelTestEnv,
) -> None:
    kestrel_env.fail_step(app.analyze, TimeoutError(), attempt=2)  # attempt 1 succeeds
    kestrel_env.fail_step("no such step '); DROP TABLE x; --")
    run = kestrel_env.run_to_completion(app.incident, ALERT, signals=APPROVED)
    assert run.timeline[0] == ("kit.analyze", 1, "ok")
    assert run.status is kestrel.Status.COMPLETED


def test_a_crash_after_a_checkpoint_is_recovered_as_a_killed_worker_would_be(
    kestrel_env: KestrelTestEnv,
) -> None:
    kestrel_env.crash_after_checkpoint(app.generate_fix)
    run = kestrel_env.run_to_completion(app.incident, ALERT, signals=APPROVED)
    assert run.assert_completed() == {"outcome": "PR: raise the memory limit of api"}
    assert run.crashes == 1
    # The first worker committed generate_fix's checkpoint and died before hearing of it;
    # the second (a new claim, epoch 2) replayed both steps from their checkpoints.
    assert [(s.name, s.lease_epoch) for s in run.steps] == [
        ("kit.analyze", 1), ("kit.generate_fix", 1), ("kestrel.signal:approval", 2),
        ("kit.open_pr", 2)]
    assert dict(app.bodies) == {"kit.analyze": 1, "kit.generate_fix": 1, "kit.open_pr": 1}
    assert kestrel_env.client.get(run.id).attempts == 2


def test_a_durable_sleep_is_skipped_by_moving_the_database_clock(
    kestrel_env: KestrelTestEnv,
) -> None:
    before = datetime.now(UTC)
    run = kestrel_env.run_to_completion(app.cooldown, 30)
    result = run.assert_completed()
    month = 30 * 24 * 3600
    # ctx.now() is recorded from the database clock: the workflow saw the month pass.
    assert month <= result["slept_s"] < month + 60
    assert month - 60 < run.skipped_s <= month
    assert kestrel_env.now() - before >= timedelta(days=30)
    run.assert_timeline(["kit.analyze", "kestrel.now", "kestrel.sleep", "kestrel.now",
                         "kit.generate_fix", "kit.open_pr"])


def test_a_childs_sleep_is_skipped_while_its_parent_waits_for_it(
    kestrel_env: KestrelTestEnv,
) -> None:
    run = kestrel_env.run_to_completion(app.parent_of_a_sleeper, 3)
    assert run.assert_completed()["slept_s"] >= 3 * 24 * 3600
    [child] = [e for e in kestrel_env.client.list() if e.workflow == "kit.cooldown"]
    assert child.status is kestrel.Status.COMPLETED
    assert run.step_names == ["kestrel.start_child:kit.cooldown",
                              f"kestrel.signal:kestrel.child:{child.id}"]


def test_without_skipping_a_sleep_never_wakes_early(kestrel_env: KestrelTestEnv) -> None:
    with pytest.raises(TimeoutError, match=r"it is waiting for kestrel\.sleep"):
        kestrel_env.run_to_completion(app.cooldown, 2, skip_sleeps=False, timeout=2)
    [summary] = kestrel_env.client.list()
    kestrel_env.advance_clock(2 * 24 * 3600 - 120)  # two minutes short
    with pytest.raises(TimeoutError, match=r"kestrel\.sleep"):
        kestrel_env.run_until_finished(summary.id, skip_sleeps=False, timeout=2)
    assert app.bodies["kit.generate_fix"] == 0
    kestrel_env.advance_clock(121)
    run = kestrel_env.run_until_finished(summary.id, skip_sleeps=False)
    assert run.assert_completed()["slept_s"] >= 2 * 24 * 3600


def test_a_wait_for_a_signal_is_not_skipped_and_the_error_names_it(
    kestrel_env: KestrelTestEnv,
) -> None:
    with pytest.raises(TimeoutError, match="still waiting for signal 'approval'"):
        kestrel_env.run_to_completion(app.incident, ALERT, timeout=2)
    [summary] = kestrel_env.client.list()
    kestrel_env.advance_clock(7 * 24 * 3600 + 1)  # past the approval's timeout
    run = kestrel_env.run_until_finished(summary.id)
    assert run.assert_completed() == {"outcome": "not approved"}
    assert run.timeline[-1] == ("kestrel.signal:approval", 1, "ok")
    assert run.steps[-1].output == {"received": False, "payload": None}


def test_reset_empties_the_schema_sets_the_clock_back_and_disarms(
    kestrel_env: KestrelTestEnv,
) -> None:
    kestrel_env.client.submit(app.incident, ALERT)
    kestrel_env.advance_clock(10 * 24 * 3600)
    kestrel_env.fail_step(app.analyze, times=5)
    kestrel_env.reset()
    assert kestrel_env.client.counts() == {}
    assert abs(kestrel_env.now() - datetime.now(UTC)) < timedelta(minutes=1)
    run = kestrel_env.run_to_completion(app.incident, ALERT, signals=APPROVED)
    assert run.timeline[0] == ("kit.analyze", 1, "ok")


@pytest.mark.parametrize("seconds", [-1.0, math.nan, math.inf, 1e300, -0.001])
def test_the_clock_only_moves_forward_by_a_finite_amount(
    kestrel_env: KestrelTestEnv, seconds: float
) -> None:
    before = kestrel_env.now()
    with pytest.raises(ValueError, match="advance_clock"):
        kestrel_env.advance_clock(seconds)
    assert kestrel_env.now() - before < timedelta(minutes=1)


@pytest.mark.parametrize("name", ["bad\x00name", "lone \ud800 surrogate", "x" * 3000])
def test_hostile_workflow_names_are_refused_before_anything_is_written(
    kestrel_env: KestrelTestEnv, name: str
) -> None:
    with pytest.raises(kestrel.SerializationError):
        kestrel_env.run_to_completion(name)
    assert kestrel_env.client.counts() == {}


def _nested(depth: int) -> list[object]:
    value: list[object] = []
    for _ in range(depth - 1):
        value = [value]
    return value


@pytest.mark.parametrize("arg", ["\x00", "\udfff", {"deep": _nested(300)}, 2**70],
                         ids=["nul", "lone-surrogate", "deep", "int-beyond-64-bits"])
def test_hostile_arguments_are_refused_before_anything_is_written(
    kestrel_env: KestrelTestEnv, arg: object
) -> None:
    with pytest.raises(kestrel.SerializationError):
        kestrel_env.run_to_completion(app.incident, arg)
    assert kestrel_env.client.counts() == {}


def test_an_unregistered_workflow_waits_and_the_timeout_says_so(
    kestrel_env: KestrelTestEnv,
) -> None:
    with pytest.raises(TimeoutError, match="it is queued"):
        kestrel_env.run_to_completion("'); DROP TABLE workflow_executions; --", timeout=1)
    assert kestrel_env.client.counts() == {"queued": 1}


def test_fault_arguments_are_checked(kestrel_env: KestrelTestEnv) -> None:
    with pytest.raises(ValueError, match="at least once"):
        kestrel_env.fail_step(app.analyze, times=0)
    with pytest.raises(ValueError, match="at least once"):
        kestrel_env.crash_after_checkpoint(app.analyze, times=-1)
    with pytest.raises(TypeError, match="not int"):
        kestrel_env.fail_step(42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be an exception, not str"):
        kestrel_env.fail_step(app.analyze, "boom")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not NoneType"):
        kestrel_env.crash_after_checkpoint(None)  # type: ignore[arg-type]


def test_an_async_test_awaits_the_run_in_its_own_event_loop(
    kestrel_env: KestrelTestEnv,
) -> None:
    async def an_async_test() -> None:
        with pytest.raises(RuntimeError, match="arun_to_completion"):
            kestrel_env.run_to_completion(app.incident, ALERT)
        run = await kestrel_env.arun_to_completion(app.incident, ALERT, signals=APPROVED)
        run.assert_completed()

    asyncio.run(an_async_test())


def test_every_internal_step_is_named_and_the_user_view_leaves_them_out(
    kestrel_env: KestrelTestEnv,
) -> None:
    run = kestrel_env.run_to_completion(app.every_internal, ALERT)
    result = run.assert_completed()
    assert result["note"] == {"new": True} and result["cause"] == "api ran out of memory"
    assert run.step_names == [
        "kestrel.patch:kit-v2", "kit.analyze", "kestrel.now", "kestrel.random",
        "kestrel.uuid", "kestrel.set_event:stage", "kestrel.set_tags", "kestrel.send_signal:note",
        "kestrel.signal:note", "kestrel.sleep", "kestrel.start_child:kit.in_a_queue",
        f"kestrel.signal:kestrel.child:{result['child']}", "kit.generate_fix"]
    # Each name of the README's table (kestrel.testing.INTERNAL_STEPS) was recorded here.
    for pattern in INTERNAL_STEPS:
        shape = re.sub(r"[A-Z][A-Z_]*", ".+", re.escape(pattern).replace(r"\:", ":"))
        assert any(re.fullmatch(shape, n) for n in run.step_names), pattern
    assert run.user_step_names == ["kit.analyze", "kit.generate_fix"]
    assert run.user_timeline == [("kit.analyze", 1, "ok"), ("kit.generate_fix", 1, "ok")]
    run.assert_timeline(["kit.analyze", "kit.generate_fix"], user_only=True)
    with pytest.raises(AssertionError, match=r"recorded \(its own steps\)"):
        run.assert_timeline(["kit.analyze"], user_only=True)


def test_run_until_waiting_stops_at_the_signal_and_moving_the_clock_times_it_out(
    kestrel_env: KestrelTestEnv,
) -> None:
    handle = kestrel_env.client.submit(app.incident, ALERT)
    waiting = kestrel_env.run_until_waiting(handle)
    assert waiting == Waiting(handle.id, "signal", "approval", waiting.until,
                              waiting.seconds_left)
    week = 7 * 24 * 3600
    assert waiting.seconds_left is not None and week - 60 < waiting.seconds_left <= week
    assert waiting.until is not None and waiting.until - kestrel_env.now() <= timedelta(days=7)
    assert app.bodies["kit.open_pr"] == 0 and app.bodies["kit.generate_fix"] == 1
    kestrel_env.advance_clock(waiting.seconds_left + 1)
    run = kestrel_env.run_until_finished(handle)
    assert run.assert_completed() == {"outcome": "not approved"}
    assert run.steps[-1].output == {"received": False, "payload": None}


def test_run_until_waiting_then_the_signal(kestrel_env: KestrelTestEnv) -> None:
    handle = kestrel_env.client.submit(app.incident, ALERT)
    assert kestrel_env.run_until_waiting(str(handle.id)).signal == "approval"
    kestrel_env.client.signal(handle.id, "approval", {"approved": True})
    run = kestrel_env.run_until_finished(handle.id)
    assert run.assert_completed() == {"outcome": "PR: raise the memory limit of api"}


def test_run_until_waiting_skips_sleeps_or_stops_at_them(kestrel_env: KestrelTestEnv) -> None:
    handle = kestrel_env.client.submit(app.sleep_then_wait, 3)
    slept = kestrel_env.run_until_waiting(handle, skip_sleeps=False)
    assert (slept.kind, slept.signal) == ("sleep", None)
    assert slept.seconds_left is not None and slept.seconds_left > 3 * 24 * 3600 - 60
    waiting = kestrel_env.run_until_waiting(handle)  # the sleep skipped, on to the signal
    assert (waiting.kind, waiting.signal) == ("signal", "go")
    assert waiting.seconds_left is not None and waiting.seconds_left <= 24 * 3600
    kestrel_env.client.signal(handle.id, "go", "now")
    assert kestrel_env.run_until_finished(handle).result == "went now"


def test_run_until_waiting_on_a_parent_finds_its_waiting_child(
    kestrel_env: KestrelTestEnv,
) -> None:
    parent = kestrel_env.client.submit(app.parent_of_a_waiter)
    waiting = kestrel_env.run_until_waiting(parent)
    [child] = [e for e in kestrel_env.client.list() if e.workflow == "kit.sleep_then_wait"]
    assert (waiting.id, waiting.signal) == (child.id, "go")
    kestrel_env.client.signal(waiting.id, "go", 1)
    assert kestrel_env.run_until_finished(parent).result == "went 1"


def test_run_until_waiting_on_an_execution_that_never_waits_fails_the_test(
    kestrel_env: KestrelTestEnv,
) -> None:
    handle = kestrel_env.client.submit(app.in_a_queue, ALERT)
    with pytest.raises(AssertionError, match=r"ended completed without waiting for a signal; "
                                             r"its steps: \['kit.analyze'\]"):
        kestrel_env.run_until_waiting(handle)
    with pytest.raises(TimeoutError, match="it is queued"):
        kestrel_env.run_until_waiting(kestrel_env.client.submit("kit.nobody"), timeout=1)


def test_run_until_waiting_in_an_async_test(kestrel_env: KestrelTestEnv) -> None:
    async def an_async_test() -> None:
        handle = await kestrel.Client(kestrel_env.dsn, schema=kestrel_env.schema,
                                      pool_size=0).submit(app.incident, ALERT)
        with pytest.raises(RuntimeError, match="arun_until_waiting"):
            kestrel_env.run_until_waiting(handle)
        waiting = await kestrel_env.arun_until_waiting(handle)
        assert waiting.signal == "approval"
        kestrel_env.advance_clock((waiting.seconds_left or 0) + 1)
        run = await kestrel_env.arun_until_finished(handle)
        assert run.result == {"outcome": "not approved"}

    asyncio.run(an_async_test())


# -- as a user runs it: the plugin from its entry point, in a project folder of their own ----

USER_APP = textwrap.dedent('''
    import kestrel

    @kestrel.step(retries=2, base_delay=0.01, retry_on=(TimeoutError,))
    async def fetch(n: int) -> int:
        return n * 10

    @kestrel.workflow
    async def report(ctx: kestrel.Context, n: int) -> int:
        value = await ctx.step(fetch, n)
        await ctx.sleep(24 * 3600)
        return value + 1
''')

USER_TEST = textwrap.dedent('''
    from myapp import fetch, report

    def test_report(kestrel_env):
        run = kestrel_env.run_to_completion(report, 4)
        assert run.result == 41
        assert run.timeline == [("fetch", 1, "ok"), ("kestrel.sleep", 1, "ok")]

    def test_report_retries(kestrel_env):
        kestrel_env.fail_step(fetch, TimeoutError())
        run = kestrel_env.run_to_completion(report, 4)
        assert run.timeline[0] == ("fetch", 2, "ok")

    def test_a_wrong_timeline_fails(kestrel_env):
        run = kestrel_env.run_to_completion(report, 4)
        run.assert_timeline(["fetch"])
''')


# The kestrel this session imports, for the user's pytest too (a checkout's src/ may not be
# the one installed in editable mode: another worktree's).
CODE_UNDER_TEST = {"PYTHONPATH": str(Path(kestrel.__file__).resolve().parents[1])}


def _user_pytest(folder: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    (folder / "myapp.py").write_text(USER_APP)
    (folder / "test_myapp.py").write_text(USER_TEST)
    clean = {k: v for k, v in os.environ.items()
             if k not in ("PYTHONPATH", "KESTREL_TEST_DSN", "PYTEST_ADDOPTS")} | CODE_UNDER_TEST
    # A basetemp of its own: the inner session never rotates the outer one's temp folders.
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           f"--basetemp={folder / '.tmp'}"],
                          cwd=folder, env=clean | env, capture_output=True, text=True,
                          timeout=300)


def test_a_users_project_gets_the_fixtures_from_the_entry_point(
    pg_dsn: str, tmp_path: Path
) -> None:
    done = _user_pytest(tmp_path, {"KESTREL_TEST_DSN": pg_dsn})
    assert "1 failed, 2 passed" in done.stdout, done.stdout + done.stderr
    assert "test_a_wrong_timeline_fails" in done.stdout
    assert "TimelineEntry(name='kestrel.sleep'" in done.stdout


def _setup_errors(out: str) -> list[list[str]]:
    """The lines pytest printed under each "ERROR at setup of …" header."""
    sections = re.split(r"^_+ ERROR at setup of \w+ _+$", out, flags=re.MULTILINE)[1:]
    return [section.split("\n=")[0].strip().splitlines() for section in sections]


def test_without_a_database_each_test_says_how_to_give_one_in_one_line(tmp_path: Path) -> None:
    # No DSN anywhere and the embedded extra blocked: pgserver is what the extra installs.
    (tmp_path / "conftest.py").write_text("import sys\nsys.modules['pgserver'] = None\n")
    done = _user_pytest(tmp_path, {})
    out = done.stdout + done.stderr
    assert done.returncode != 0
    line = ("kestrel.testing needs a PostgreSQL: give the tests a PostgreSQL with "
            "--kestrel-dsn=postgresql://… or KESTREL_TEST_DSN, or pip install "
            "'kestrel-runtime[embedded]' for a private one")
    assert _setup_errors(done.stdout) == [[line]] * 3, out
    assert "Traceback" not in out and "3 errors" in done.stdout, out


@pytest.mark.parametrize("how", ["env", "option"])
def test_a_database_that_does_not_answer_is_one_line_naming_the_dsn(
    tmp_path: Path, how: str
) -> None:
    # A closed port on loopback: nothing listens on port 1.
    dsn = "postgresql://kit:s3cret@127.0.0.1:1/kit_db"
    if how == "env":
        done = _user_pytest(tmp_path, {"KESTREL_TEST_DSN": dsn})
        source = "KESTREL_TEST_DSN"
    else:
        done = _user_pytest(tmp_path, {"PYTEST_ADDOPTS": f"--kestrel-dsn={dsn}"})
        source = "--kestrel-dsn"
    out = done.stdout + done.stderr
    errors = _setup_errors(done.stdout)
    assert len(errors) == 3 and all(len(e) == 1 for e in errors), out
    [line] = errors[0]
    assert line.startswith(f"kestrel.testing cannot connect to the PostgreSQL that {source} "
                           "names, postgresql://kit:***@127.0.0.1:1/kit_db (connection failed"), out
    assert "Connection refused): start it, or give the tests a PostgreSQL with " \
           "--kestrel-dsn=postgresql://… or KESTREL_TEST_DSN" in line, out
    assert "s3cret" not in out and "Traceback" not in out, out


# The manual's own example (docs/tutorials/testing.md, the README's "Testing your workflows"
# before it) runs as written, "3 passed" asserted, in tests/docs/test_tutorials.py with the
# other tutorials.

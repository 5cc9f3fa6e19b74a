"""KESTREL_FAILPOINTS: the grammar, the modes, and a clear error for anything else."""

from __future__ import annotations

import os
import subprocess
import sys

import psycopg
import pytest

from kestrel import failpoints as worker
from tests.helpers import ROOT


def test_grammar_modes_and_counts() -> None:
    points = worker._parse_failpoints(
        "after_claim_commit, before_complete=exit:2,before_checkpoint_commit=sleep(0.5):3")
    assert points == {"after_claim_commit": ["raise", 0.0, 1],
                      "before_complete": ["exit", 0.0, 2],
                      "before_checkpoint_commit": ["sleep", 0.5, 3]}
    assert worker._parse_failpoints("") == {}


@pytest.mark.parametrize("spec", ["nowhere", "before_complete=explode",
                                  "before_complete:x", "before_complete=sleep(a)"])
def test_anything_else_is_refused_naming_the_points(spec: str) -> None:
    with pytest.raises(ValueError, match="after_checkpoint_commit_before_ack"):
        worker._parse_failpoints(spec)


def test_raise_fires_n_times_then_never(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker, "_FAILPOINTS", worker._parse_failpoints("before_complete:2"))
    for _ in range(2):
        with pytest.raises(psycopg.OperationalError, match="failpoint before_complete"):
            worker.failpoint("before_complete")
    worker.failpoint("before_complete")  # spent
    worker.failpoint("after_claim_commit")  # never named


def test_sleep_blocks_for_its_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(worker.time, "sleep", slept.append)
    monkeypatch.setattr(worker, "_FAILPOINTS",
                        worker._parse_failpoints("before_complete=sleep(1.5)"))
    worker.failpoint("before_complete")
    worker.failpoint("before_complete")
    assert slept == [1.5]


def test_a_malformed_value_stops_the_runtime_before_it_forks() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), KESTREL_FAILPOINTS="before_completed")
    done = subprocess.run([sys.executable, "-m", "kestrel", "--app", "tests.apps.ledger_app",
                           "--dsn", "postgresql://nobody@127.0.0.1:1/none"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "KESTREL_FAILPOINTS: cannot read 'before_completed'" in done.stderr
    assert "started worker" not in done.stderr


# -- arm(): points set from code, for one subject (kestrel.testing) -------------------------


@pytest.fixture
def disarmed() -> object:
    worker.disarm()
    yield None
    worker.disarm()


def test_armed_points_fire_for_their_subject_only_and_n_times(disarmed: object) -> None:
    worker.arm("step_body", "error", times=2, match=lambda s: s == "mine",
               error=TimeoutError("injected"))
    worker.failpoint("step_body", "another")  # not its subject: nothing
    for _ in range(2):
        with pytest.raises(TimeoutError, match="injected"):
            worker.failpoint("step_body", "mine")
    worker.failpoint("step_body", "mine")  # spent


def test_halt_is_not_an_exception_that_code_can_swallow(disarmed: object) -> None:
    worker.arm("after_checkpoint_commit_before_ack", "halt")
    with pytest.raises(worker.Halt):
        try:
            worker.failpoint("after_checkpoint_commit_before_ack", [])
        except Exception:  # what a writer's error isolation catches
            pytest.fail("Halt was caught as an Exception")
    assert not issubclass(worker.Halt, Exception)


def test_disarm_forgets_every_armed_point(disarmed: object) -> None:
    worker.arm("before_complete", "crash", times=5)
    worker.disarm()
    worker.failpoint("before_complete")


@pytest.mark.parametrize(("name", "mode", "kwargs", "message"), [
    ("nowhere", "raise", {}, "unknown failpoint 'nowhere'"),
    ("'); DROP TABLE x; --", "raise", {}, "unknown failpoint"),
    ("step_body", "explode", {}, "failpoint mode 'explode'"),
    ("step_body", "error", {}, "failpoint mode 'error'"),  # error needs an exception
    ("step_body", "raise", {"error": ValueError()}, "failpoint mode 'raise'"),
    ("step_body", "raise", {"times": 0}, "at least once"),
])
def test_arm_refuses_what_it_cannot_do(disarmed: object, name: str, mode: str,
                                       kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        worker.arm(name, mode, **kwargs)  # type: ignore[arg-type]
    assert worker._ARMED == {}


# -- lost_reply:<statement>: a named statement commits, then its reply is lost ---------------


def test_lost_reply_grammar_names_a_statement() -> None:
    points = worker._parse_failpoints("lost_reply:submit, lost_reply:park:3")
    assert points == {"lost_reply:submit": ["lost_reply", 0.0, 1],
                      "lost_reply:park": ["lost_reply", 0.0, 3]}
    with pytest.raises(ValueError, match="STATEMENT a name of sql/queries"):
        worker._parse_failpoints("lost_reply:no_such_statement")


def test_armed_lost_replies_fire_for_their_subject_then_never() -> None:
    worker.disarm()
    try:
        worker.arm("lost_reply:signal", times=1, match=lambda p: p["name"] == "go")
        assert not worker.lost_reply("signal", {"name": "stop"})
        assert not worker.lost_reply("submit", {"name": "go"})
        assert worker.lost_reply("signal", {"name": "go"})
        assert not worker.lost_reply("signal", {"name": "go"})  # spent
        with pytest.raises(ValueError, match="unknown statement"):
            worker.arm("lost_reply:nowhere")
        with pytest.raises(ValueError, match="mode raise"):
            worker.arm("lost_reply:signal", "halt")
    finally:
        worker.disarm()
    assert worker.LOST_REPLIES == {}

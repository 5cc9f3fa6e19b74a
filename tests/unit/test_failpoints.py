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

"""Parallel calls inside one workflow (FAULTS C1; issue 38, rows 1 and 2).

``asyncio.gather`` and ``TaskGroup`` of steps, waits, events and children take their
positions in the order the workflow's code makes the calls, never in the order their bodies
or writes finish; each position is recorded once; the replay after a durable sleep hands
each call its own output and runs no body again. What cannot be made deterministic (a
branch that goes on after its call returned, a branch whose parent went on first) is
refused with ConcurrentCallError before it takes a position.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from kestrel.client import SyncClient
from tests.apps import parallel_app as app
from tests.apps.ledger_app import read_ledger
from tests.helpers import config, finished_count, run_worker_until


def run_until_finished(pg_dsn: str, schema: str, n: int, **overrides: Any) -> None:
    run_worker_until(pg_dsn, config(schema, **overrides),
                     lambda: finished_count(pg_dsn, schema) >= n, timeout=60)


def checkpoints(pg_dsn: str, schema: str, eid: Any) -> list[tuple[int, str, Any]]:
    """The execution's step checkpoints (not its patch markers) in position order."""
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    return [(r.step_id, r.name, r.output) for r in client.steps(eid) if r.step_id >= 0]


def body_runs(ledger_path: Path, eid: Any) -> Counter[int]:
    return Counter(e["step_id"] for e in read_ledger(ledger_path, execution_id=str(eid))
                   if e["kind"] == "body")


def test_a_fan_out_records_every_position_once_and_replays_each_its_own(
    pg_dsn: str, schema: str, ledger_path: Path
) -> None:
    # Row 1: 36 steps at once lost checkpoints (one tail replaced another's) and ran bodies
    # again on the replay after the sleep.
    n = 36
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    eids = [client.submit(app.fan, n).id for _ in range(4)]
    run_until_finished(pg_dsn, schema, len(eids))
    expected = [f"g({i % 5})" if i % 2 else f"h({i % 5})" for i in range(n)]
    for eid in eids:
        assert client.result(eid, timeout=5) == expected
        steps = checkpoints(pg_dsn, schema, eid)
        # Positions follow the order of the calls in the code, whatever finished first.
        assert [s[0] for s in steps[:n]] == list(range(n))
        assert [s[2] for s in steps[:n]] == expected
        assert [s[1] for s in steps[:n]] == ["par_g" if i % 2 else "par_h" for i in range(n)]
        runs = body_runs(ledger_path, eid)
        assert sorted(runs) == list(range(n)) and set(runs.values()) == {1}, runs


def test_a_fan_out_right_after_a_step_replays_in_call_order(
    pg_dsn: str, schema: str, ledger_path: Path
) -> None:
    # Row 2: the first parallel call suspended in the send of the pending tail and the
    # second took its position: after the replay the outputs came back swapped.
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    eid = client.submit(app.after_step).id
    run_until_finished(pg_dsn, schema, 1)
    assert client.result(eid, timeout=5) == ["g(1)", "g(x)", "g(y)"]
    assert [s[2] for s in checkpoints(pg_dsn, schema, eid)][:3] == ["g(1)", "g(x)", "g(y)"]
    assert set(body_runs(ledger_path, eid).values()) == {1}


def test_nested_fan_outs_with_waits_events_and_children(
    pg_dsn: str, schema: str, ledger_path: Path
) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    eid = client.submit(app.nested, "k1").id
    # The signal wait parks the execution (the rest of the fan-out done first); the signal
    # wakes it, the children's waits and the sleep park it in turn.
    run_worker_until(pg_dsn, config(schema),
                     lambda: client.get(eid).status == "waiting", timeout=30)
    client.signal(eid, "go", {"ok": 1})
    run_until_finished(pg_dsn, schema, 4)  # the parent and its three children
    assert client.result(eid, timeout=5) == {
        "first": "g(start)", "inner": ["g(a)", "h(b)"], "flaky": "flaky(c)",
        "signal": {"ok": 1}, "children": [len(f"g({i})") + i for i in range(3)]}
    steps = checkpoints(pg_dsn, schema, eid)
    names = [s[1] for s in steps]
    # Call order, as the code makes the calls: the step; the inner gather's two and the
    # three child starts (their tasks were made while the outer gather's arguments were
    # evaluated); the outer gather's own branches; then the TaskGroup's waits and sleep.
    kids = [s[2] for s in steps[3:6]]
    assert names == ["par_g", "par_g", "par_h", *["kestrel.start_child:par_child"] * 3,
                     "par_flaky", "kestrel.set_event:progress", "kestrel.signal:go",
                     *[f"kestrel.signal:kestrel.child:{k}" for k in kids], "kestrel.sleep"]
    runs = body_runs(ledger_path, eid)
    flaky_at = names.index("par_flaky")
    assert runs[flaky_at] == 2  # its failed try and the one that succeeded, once each
    assert all(c == 1 for k, c in runs.items() if k != flaky_at), runs


def test_parallel_waits_park_one_after_the_other(pg_dsn: str, schema: str) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    eid = client.submit(app.waits).id
    client.signal(eid, "b", "B")  # kept until its wait takes it
    run_worker_until(pg_dsn, config(schema),
                     lambda: client.get(eid).status == "waiting", timeout=30)
    client.signal(eid, "a", "A")
    run_until_finished(pg_dsn, schema, 1)
    assert client.result(eid, timeout=5) == ["A", "B"]
    assert [s[1] for s in checkpoints(pg_dsn, schema, eid)] == [
        "kestrel.signal:a", "kestrel.signal:b", "kestrel.sleep"]


def test_a_failed_branch_does_not_stop_the_other_from_being_recorded(
    pg_dsn: str, schema: str, ledger_path: Path
) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    eid = client.submit(app.caught).id
    run_until_finished(pg_dsn, schema, 1)
    assert client.result(eid, timeout=5) == "StepFailed|g(2)"
    assert set(body_runs(ledger_path, eid).values()) == {1}


def test_what_timing_would_order_is_refused_before_it_takes_a_position(
    pg_dsn: str, schema: str, ledger_path: Path
) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    seq = client.submit(app.branch_sequence).id
    went_on = client.submit(app.parent_went_on).id
    run_until_finished(pg_dsn, schema, 2)
    for eid in (seq, went_on):
        got = client.get(eid)
        assert got.status == "failed"
        assert got.error is not None, got
        assert got.error["type"] == "kestrel.errors.ConcurrentCallError", got.error
    # Nothing of the refused call ran or was recorded: each branch's first call, no more.
    assert "par_h" not in [s[1] for s in checkpoints(pg_dsn, schema, seq)]
    assert {e["name"] for e in read_ledger(ledger_path, execution_id=str(seq))} == {"par_g"}
    assert [s[1] for s in checkpoints(pg_dsn, schema, went_on)] == ["par_h"]
    assert [e["name"] for e in read_ledger(ledger_path, execution_id=str(went_on))] == [
        "par_h"]

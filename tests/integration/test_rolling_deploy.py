"""A rolling deploy with two versions of an app side by side, as real processes.

v1 (tests/apps/versions_v1.py) runs; executions park waiting for a signal; executions of a
workflow only v2 knows are submitted and wait, listed as unclaimable by the CLI and the
gauge. v2 (tests/apps/versions_v2.py: an audit step behind ``ctx.patched`` and the new
workflow) starts next to v1; v1 is stopped (SIGTERM, or SIGKILL of its whole process group);
v2 finishes everything. Nothing fails or is lost; the executions v1 parked take the old path
(no marker, no audit), the ones v2 starts take the new one; each records the app version that
started it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kestrel.client import SyncClient
from tests.helpers import ROOT, metric, q, q1, start_runtime, stop_runtime, wait_until
from tests.pgbouncer import free_port

FLOW = "versions.approval_flow"
V2_ONLY = "versions.v2_only"
PATCH = "audit-before-wait"


def cli(dsn: str, schema: str, *args: str) -> Any:
    """Run ``kestrel-runtime ARGS --json`` as a process; return its JSON."""
    path = os.pathsep.join((str(ROOT / "src"), str(ROOT)))  # this checkout's kestrel
    out = subprocess.run([sys.executable, "-m", "kestrel", *args, "--json", "--dsn", dsn,
                          "--schema", schema], env=dict(os.environ, PYTHONPATH=path),
                         cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def statuses(dsn: str, schema: str, ids: list[Any]) -> dict[str, str]:
    rows = q(dsn, schema, "SELECT id::text, status FROM {s}.executions WHERE id = ANY(%s)",
             [ids])
    return dict(rows)


def steps_of(dsn: str, schema: str, eid: Any) -> list[tuple[int, str]]:
    return [(r[0], r[1]) for r in q(dsn, schema, "SELECT step_id, step_name FROM "
                                    "{s}.workflow_steps WHERE execution_id = %s ORDER BY "
                                    "step_id", [eid])]


@pytest.mark.parametrize("stop_v1", ["sigterm", "sigkill"])
def test_a_rolling_deploy_of_v2_next_to_v1_fails_and_loses_nothing(
    pg_dsn: str, schema: str, tmp_path: Path, stop_v1: str
) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    port = free_port()
    log1, log2 = open(tmp_path / "v1.log", "ab"), open(tmp_path / "v2.log", "ab")  # noqa: SIM115
    v1 = start_runtime(pg_dsn, schema, procs=2, app="tests.apps.versions_v1", out=log1,
                       args=["--app-version", "v1", "--metrics-port", str(port)])
    v2 = None
    try:
        old = [client.submit(FLOW, n).id for n in range(6)]
        new_only = [client.submit(V2_ONLY, n).id for n in range(3)]
        wait_until(lambda: set(statuses(pg_dsn, schema, old).values()) == {"waiting"},
                   timeout=60, what="v1 parks its executions at the wait")

        # Only v1 runs: the v2-only executions wait, queued, listed as unclaimable.
        unclaimable = wait_until(lambda: cli(pg_dsn, schema, "unclaimable")["unclaimable"],
                                 timeout=30, what="unclaimable listed")
        assert unclaimable == [{"workflow": V2_ONLY, "queue": "default", "count": 3,
                                "oldest_created_at": unclaimable[0]["oldest_created_at"],
                                "given_back_by": None}]
        assert {w["app_version"] for w in cli(pg_dsn, schema, "unclaimable")["workers"]} \
            == {"v1"}
        wait_until(lambda: metric(port, "kestrel_unclaimable_executions") == 3, timeout=30,
                   what="the gauge counts the 3 unclaimable executions")
        assert metric(port, "kestrel_unclaimable_workflows") == 1
        assert set(statuses(pg_dsn, schema, new_only).values()) == {"queued"}
        assert q1(pg_dsn, schema, "SELECT count(*) FROM {s}.workflow_executions WHERE "
                  "id = ANY(%s) AND attempts > 0", [new_only]) == 0  # never claimed

        # v2 starts next to v1, then v1 goes away.
        v2 = start_runtime(pg_dsn, schema, procs=2, app="tests.apps.versions_v2", out=log2,
                           args=["--app-version", "v2"])
        wait_until(lambda: set(statuses(pg_dsn, schema, new_only).values()) == {"completed"},
                   timeout=60, what="v2 runs the executions v1 could not")
        if stop_v1 == "sigterm":
            stop_runtime(v1)
            assert v1.returncode == 0
        else:
            os.killpg(v1.pid, signal.SIGKILL)
            v1.wait()
        assert cli(pg_dsn, schema, "unclaimable")["unclaimable"] == []

        # New executions reach the patch under v2 and take the new path.
        new = [client.submit(FLOW, n).id for n in range(100, 104)]
        wait_until(lambda: set(statuses(pg_dsn, schema, new).values()) == {"waiting"},
                   timeout=60, what="v2 parks the new executions")
        [use] = cli(pg_dsn, schema, "patches", PATCH)
        assert (use["workflow"], use["live_with"], use["live_without"]) == (FLOW, 4, 6)
        without = cli(pg_dsn, schema, "list", "--without-patch", PATCH, "--status", "waiting")
        assert {r["id"] for r in without} == {str(i) for i in old}
        assert {r["id"] for r in cli(pg_dsn, schema, "list", "--patch", PATCH)} \
            == {str(i) for i in new}

        for eid in old + new:
            client.signal(eid, "go", {"approved": str(eid)})
        every = old + new + new_only
        wait_until(lambda: set(statuses(pg_dsn, schema, every).values()) == {"completed"},
                   timeout=90, what="v2 finishes every execution")
    finally:
        if v2 is not None:
            stop_runtime(v2)
        stop_runtime(v1)
        log1.close()
        log2.close()

    # Nothing failed or lost; each took the path its history holds.
    assert q1(pg_dsn, schema, "SELECT count(*) FROM {s}.executions WHERE status <> "
              "'completed'") == 0
    for eid in old:
        assert steps_of(pg_dsn, schema, eid) == [
            (0, "versions.prepare"), (1, "kestrel.signal:go"), (2, "versions.finish")]
    for eid in new:
        assert steps_of(pg_dsn, schema, eid) == [
            (-1, f"kestrel.patch:{PATCH}"), (0, "versions.prepare"), (1, "versions.audit"),
            (2, "kestrel.signal:go"), (3, "versions.finish")]
    for n, eid in zip([*range(6), *range(100, 104)], old + new, strict=True):
        assert client.result(eid, timeout=5) == {"x": n * 10, "payload": {"approved": str(eid)}}
    # The app version that started each one, and the CLI and views filter by it.
    assert {r["id"] for r in cli(pg_dsn, schema, "list", "--app-version", "v1")} \
        == {str(i) for i in old}
    assert {r["id"] for r in cli(pg_dsn, schema, "list", "--app-version", "v2")} \
        == {str(i) for i in new + new_only}
    assert q1(pg_dsn, schema, "SELECT count(*) FROM {s}.executions WHERE app_version = 'v2' "
              "AND workflow = %s", [V2_ONLY]) == 3
    assert q1(pg_dsn, schema, "SELECT count(DISTINCT execution_id) FROM {s}.patch_markers "
              "WHERE patch = %s", [PATCH]) == 4


def test_an_old_worker_gives_back_what_newer_code_ran_instead_of_failing_it(
    pg_dsn: str, schema: str, tmp_path: Path
) -> None:
    """An execution v2 parked past its patch, woken while only v1 runs: v1 cannot replay it
    (the history has an audit step where v1 has none), so it gives it back, unfailed and
    without spending an attempt, until a v2 worker finishes it. The give-back is counted,
    names v1, and parks the row (waiting) for a worker of another version."""
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    log = open(tmp_path / "rt.log", "ab")  # noqa: SIM115
    try:
        v2 = start_runtime(pg_dsn, schema, procs=1, app="tests.apps.versions_v2", out=log,
                           args=["--app-version", "v2"])
        try:
            eid = client.submit(FLOW, 7).id
            wait_until(lambda: statuses(pg_dsn, schema, [eid]) == {str(eid): "waiting"},
                       timeout=60, what="v2 parks it at the wait")
        finally:
            stop_runtime(v2)
        v1 = start_runtime(pg_dsn, schema, procs=1, app="tests.apps.versions_v1", out=log,
                           args=["--app-version", "v1"])
        try:
            client.signal(eid, "go", "ok")
            wait_until(lambda: "giving" in (tmp_path / "rt.log").read_text(), timeout=60,
                       what="v1 gives it back")
            assert statuses(pg_dsn, schema, [eid])[str(eid)] in {"waiting", "running"}
        finally:
            stop_runtime(v1)
        assert statuses(pg_dsn, schema, [eid]) == {str(eid): "waiting"}
        assert q(pg_dsn, schema, "SELECT attempts, give_backs, given_back_by FROM "
                 "{s}.workflow_executions WHERE id = %s", [eid]) == [(0, 1, ["v1"])]
        v2 = start_runtime(pg_dsn, schema, procs=1, app="tests.apps.versions_v2", out=log,
                           args=["--app-version", "v2"])
        try:
            assert client.result(eid, timeout=60) == {"x": 70, "payload": "ok"}
        finally:
            stop_runtime(v2)
    finally:
        log.close()

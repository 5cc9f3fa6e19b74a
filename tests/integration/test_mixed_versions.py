"""Workers of two versions as real processes over executions that newer code recorded a
patch marker or a wait for (FAULTS O5, issue 22 rows 4 and 6).

An old worker never runs such an execution down its old path: it gives it back (CodeTooOld)
before running any position the history does not hold, whether newer code parked right after
the marker (A) or died between the marker and its new step (B). The give-back backs off, is
counted, named in ``show``, ``unclaimable`` and the metrics, and the old version never claims
the execution again; a new-version worker then ends it as it would have.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from kestrel.client import SyncClient
from tests.helpers import (
    ROOT,
    metric,
    q,
    q1,
    runtime,
    start_runtime,
    wait_until,
)
from tests.pgbouncer import free_port

V1, V2 = "tests.apps.mixed_v1", "tests.apps.mixed_v2"
ROLL_V1, ROLL_V2 = "tests.apps.versions_v1", "tests.apps.versions_v2"


def cli(dsn: str, schema: str, *args: str) -> Any:
    """Run ``kestrel-runtime ARGS --json`` as a process; return its JSON."""
    path = os.pathsep.join((str(ROOT / "src"), str(ROOT)))  # this checkout's kestrel
    out = subprocess.run([sys.executable, "-m", "kestrel", *args, "--json", "--dsn", dsn,
                          "--schema", schema], env=dict(os.environ, PYTHONPATH=path),
                         cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def status(dsn: str, schema: str, eid: Any) -> str:
    return str(q1(dsn, schema, "SELECT status FROM {s}.executions WHERE id = %s", [eid]))


def steps_of(dsn: str, schema: str, eid: Any) -> list[tuple[int, str]]:
    return [(r[0], r[1]) for r in q(dsn, schema, "SELECT step_id, step_name FROM "
                                    "{s}.workflow_steps WHERE execution_id = %s ORDER BY "
                                    "step_id", [eid])]


def give_backs_logged(log: Path, eid: Any) -> int:
    """Lines of *log* in which a worker gives *eid* back (before issue 22 as after)."""
    return sum(1 for line in log.read_text(errors="replace").splitlines()
               if "giving" in line and str(eid) in line)


def test_o5a_an_old_worker_does_not_run_past_a_patch_newer_code_parked_right_after(
    pg_dsn: str, schema: str, tmp_path: Path
) -> None:
    """v2 parks at a signal wait right behind its marker; the signal wakes the execution
    while only v1 runs. v1 must not run its next step there (it would complete with v1's
    result): it gives the execution back, the signal unconsumed; v2 then ends it."""
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    log1 = tmp_path / "v1.log"
    with runtime(pg_dsn, schema, procs=1, app=V2, args=["--app-version", "v2"],
                 log=tmp_path / "v2.log"):
        eid = client.submit("mixed.park_after_patch", 4).id
        wait_until(lambda: status(pg_dsn, schema, eid) == "waiting", timeout=60,
                   what="v2 parks it right after its marker")
    with runtime(pg_dsn, schema, procs=1, app=V1, args=["--app-version", "v1"], log=log1):
        client.signal(eid, "approve", "yes")
        wait_until(lambda: give_backs_logged(log1, eid) > 0
                   or status(pg_dsn, schema, eid) == "completed", timeout=60,
                   what="v1 gives it back (or, before issue 22, completes it)")
    assert status(pg_dsn, schema, eid) == "waiting"
    assert steps_of(pg_dsn, schema, eid) == [(-1, "kestrel.patch:approve-first"),
                                             (0, "mixed.prepare")]
    with runtime(pg_dsn, schema, procs=1, app=V2, args=["--app-version", "v2"]):
        assert client.result(eid, timeout=60) == {"x": 40, "extra": "yes"}
    assert steps_of(pg_dsn, schema, eid) == [
        (-1, "kestrel.patch:approve-first"), (0, "mixed.prepare"), (1, "kestrel.signal:approve"),
        (2, "mixed.finish")]


def test_o5b_an_old_worker_does_not_complete_what_newer_code_died_in_after_its_marker(
    pg_dsn: str, schema: str, tmp_path: Path
) -> None:
    """v2 records its marker and dies (SIGKILL) in the new step; v1 recovers the execution
    after the lease. It must not complete it with v1's result: it gives it back; v2 then runs
    the new step and ends it with v2's result."""
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    hold = tmp_path / "hold"
    hold.touch()
    log1 = tmp_path / "v1.log"
    v2 = start_runtime(pg_dsn, schema, procs=1, app=V2, args=["--app-version", "v2"],
                       env={"MIXED_HOLD_FILE": str(hold)})
    try:
        eid = client.submit("mixed.die_after_marker", 3).id
        wait_until(lambda: (-1, "kestrel.patch:check-first") in steps_of(pg_dsn, schema, eid),
                   timeout=60, what="v2 records its marker and enters the new step")
    finally:
        os.killpg(v2.pid, signal.SIGKILL)
        v2.wait()
    hold.unlink()
    assert steps_of(pg_dsn, schema, eid) == [(-1, "kestrel.patch:check-first"),
                                             (0, "mixed.prepare")]
    with runtime(pg_dsn, schema, procs=1, app=V1, args=["--app-version", "v1"], log=log1):
        wait_until(lambda: give_backs_logged(log1, eid) > 0
                   or status(pg_dsn, schema, eid) == "completed", timeout=60,
                   what="v1 gives it back (or, before issue 22, completes it)")
    assert status(pg_dsn, schema, eid) == "waiting"
    with runtime(pg_dsn, schema, procs=1, app=V2, args=["--app-version", "v2"]):
        assert client.result(eid, timeout=60) == {"x": 30, "extra": {"checked": 30}}
    assert steps_of(pg_dsn, schema, eid) == [
        (-1, "kestrel.patch:check-first"), (0, "mixed.prepare"), (1, "mixed.check"),
        (2, "mixed.finish")]


def test_o5_row6_an_idle_old_worker_gives_back_once_and_a_new_worker_completes_it(
    pg_dsn: str, schema: str, tmp_path: Path
) -> None:
    """After a rollback, an idle v1 next to an execution it gave back: it claims it once,
    not in a loop (issue 22 row 6: 1.2 claims/s idle, for ever), though the backoff passes
    several times over while it polls; the give-back is visible; v2 then completes it.

    The apps of test_rolling_deploy: v2 recorded an audit step behind its patch where v1 has
    the wait, so v1 gave this execution back before issue 22 too, in a loop."""
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    log1 = tmp_path / "v1.log"
    port = free_port()
    with runtime(pg_dsn, schema, procs=1, app=ROLL_V2, args=["--app-version", "v2"]):
        eid = client.submit("versions.approval_flow", 5).id
        wait_until(lambda: status(pg_dsn, schema, eid) == "waiting", timeout=60,
                   what="v2 parks it")
    with runtime(pg_dsn, schema, procs=1, app=ROLL_V1, log=log1,
                 args=["--app-version", "v1", "--metrics-port", str(port)]):
        client.signal(eid, "go", "ok")
        wait_until(lambda: give_backs_logged(log1, eid) > 0
                   or status(pg_dsn, schema, eid) == "completed", timeout=60,
                   what="v1 gives it back")
        # A window by the database clock in which the first backoff (1 s) passes three
        # times over while v1 polls every 0.2 s.
        since = q1(pg_dsn, schema, "SELECT {s}.kestrel_now()")
        wait_until(lambda: q1(pg_dsn, schema, "SELECT {s}.kestrel_now() > %s + interval "
                              "'4 seconds'", [since]), timeout=30, what="the window passes")
        assert give_backs_logged(log1, eid) == 1
        assert q(pg_dsn, schema, "SELECT status, attempts, give_backs, given_back_by FROM "
                 "{s}.workflow_executions WHERE id = %s", [eid]) == [("waiting", 0, 1, ["v1"])]

        # Visible: show, unclaimable (only v1 runs: nobody can take it), the metrics.
        shown = cli(pg_dsn, schema, "show", str(eid))
        assert (shown["give_backs"], shown["given_back_by"]) == (1, ["v1"])
        assert shown["waits_for"]["kind"] == "version"
        [stuck] = cli(pg_dsn, schema, "unclaimable")["unclaimable"]
        assert (stuck["workflow"], stuck["count"], stuck["given_back_by"]) \
            == ("versions.approval_flow", 1, ["v1"])
        wait_until(lambda: metric(port, "kestrel_given_back_executions") == 1, timeout=30,
                   what="the gauge counts it")
        assert metric(port, "kestrel_give_backs_total") == 1

        # A v2 worker next to v1 takes it and completes it with v2's result.
        with runtime(pg_dsn, schema, procs=1, app=ROLL_V2, args=["--app-version", "v2"]):
            assert client.result(eid, timeout=60) == {"x": 50, "payload": "ok"}
    assert give_backs_logged(log1, eid) == 1


HELPER_APP = {
    "__init__.py": "",
    "flows.py": """
import kestrel
from helperapp import helpers


@kestrel.step(name="helperapp.prepare")
async def prepare(n: int) -> int:
    return n * 10


@kestrel.workflow(name="helperapp.flow")
async def flow(ctx: kestrel.Context, n: int) -> object:
    x = await ctx.step(prepare, n)
    return await helpers.finish(ctx, x)
""",
}
HELPER_V1 = """
from helperapp import flows


async def finish(ctx, x):
    return await ctx.step(done, x, None)


import kestrel


@kestrel.step(name="helperapp.done")
async def done(x, extra):
    return {"x": x, "extra": extra}
"""
HELPER_V2 = HELPER_V1.replace(
    "    return await ctx.step(done, x, None)",
    "    extra = None\n"
    "    if await ctx.patched('approve-first'):\n"
    "        extra = (await ctx.wait_for_signal('approve')).payload\n"
    "    return await ctx.step(done, x, extra)")


def test_c5_a_patch_inside_a_helper_gives_a_version_of_its_own(
    pg_dsn: str, schema: str, tmp_path: Path
) -> None:
    """FAULTS C5: old and new code whose workflow functions are the same and whose helper
    differs (the patch lives in the helper), with the default version. Before, both had one
    version (it hashed the workflow functions only): the old code gave the execution back,
    and the new code, taking that give-back as its own, skipped it for ever. Now the version
    covers the application's modules: the new code takes it and completes it."""
    assert HELPER_V2 != HELPER_V1
    roots = {}
    for tag, helper in (("v1", HELPER_V1), ("v2", HELPER_V2)):
        pkg = tmp_path / tag / "helperapp"
        pkg.mkdir(parents=True)
        for name, text in {**HELPER_APP, "helpers.py": helper}.items():
            (pkg / name).write_text(text)
        roots[tag] = os.pathsep.join((str(ROOT / "src"), str(ROOT), str(tmp_path / tag)))
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    log1 = tmp_path / "v1.log"
    with runtime(pg_dsn, schema, procs=1, app="helperapp.flows", env={"PYTHONPATH": roots["v2"]},
                 log=tmp_path / "v2.log"):
        eid = client.submit("helperapp.flow", 4).id
        wait_until(lambda: status(pg_dsn, schema, eid) == "waiting", timeout=60,
                   what="v2 parks it behind the helper's patch")
    v2_version = q1(pg_dsn, schema, "SELECT app_version FROM {s}.workflow_executions "
                    "WHERE id = %s", [eid])
    with runtime(pg_dsn, schema, procs=1, app="helperapp.flows", env={"PYTHONPATH": roots["v1"]},
                 log=log1):
        client.signal(eid, "approve", "yes")
        wait_until(lambda: give_backs_logged(log1, eid) > 0
                   or status(pg_dsn, schema, eid) == "completed", timeout=60,
                   what="v1 gives it back")
    [given_back_by] = q1(pg_dsn, schema, "SELECT given_back_by FROM {s}.workflow_executions "
                         "WHERE id = %s", [eid])
    assert given_back_by != v2_version  # the old code's version is not the new code's
    with runtime(pg_dsn, schema, procs=1, app="helperapp.flows", env={"PYTHONPATH": roots["v2"]}):
        assert client.result(eid, timeout=60) == {"x": 40, "extra": "yes"}

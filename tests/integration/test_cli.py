"""Every operator command: its output (table and --json) and its error on bad input."""

from __future__ import annotations

import json
import uuid

import pytest

from kestrel.cli import main
from kestrel.client import SyncClient
from tests.apps import ledger_app as app
from tests.helpers import config, finished_count, run_worker_until

MISSING = "00000000-0000-0000-0000-000000000000"


@pytest.fixture
def cli(pg_dsn: str, schema: str, capsys: pytest.CaptureFixture[str]):  # type: ignore[no-untyped-def]
    def run(*args: str) -> tuple[int, str, str]:
        code = main([*args, "--dsn", pg_dsn, "--schema", schema, "--log-level", "error"])
        out, err = capsys.readouterr()
        return code, out, err

    return run


def test_migrate(cli, pg_dsn: str, schema: str) -> None:  # type: ignore[no-untyped-def]
    code, out, _ = cli("migrate")
    assert code == 0 and out.strip() == f"schema {schema}: up to date"
    fresh = schema + "_m"
    # At the default log level the first migrate prints its one-line summary alone (issue
    # 43 item 10: it printed 21 INFO lines around it, one per migration).
    import subprocess
    import sys

    from tests.helpers import ROOT

    made = subprocess.run([sys.executable, "-m", "kestrel", "migrate", "--dsn", pg_dsn,
                           "--schema", fresh], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert made.returncode == 0, made.stderr
    assert made.stdout.startswith(f"schema {fresh}: applied 1, 2, ")
    assert len(made.stdout.splitlines()) == 1 and "migration" not in made.stderr, made
    code = main(["migrate", "--dsn", pg_dsn, "--schema", "Bad-Name"])
    assert code == 2
    import psycopg

    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA "{fresh}" CASCADE')


def test_submit_table_json_and_errors(cli, pg_dsn: str, schema: str) -> None:  # type: ignore[no-untyped-def]
    code, out, _ = cli("submit", "three_steps", "--args", "[1]")
    assert code == 0 and uuid.UUID(out.strip())
    code, out, _ = cli("submit", "three_steps", "--args", "[2]", "--idempotency-key", "k",
                       "--json")
    first = json.loads(out)["id"]
    assert code == 0
    code, out, _ = cli("submit", "three_steps", "--args", "[2]", "--idempotency-key", "k")
    assert out.strip() == first
    code, _, err = cli("submit", "three_steps", "--args", "[3]", "--idempotency-key", "k")
    assert code == 1 and "already used by execution" in err
    code, _, err = cli("submit", "three_steps", "--args", "[1,")
    assert code == 1 and "--args is not valid JSON" in err
    code, _, err = cli("submit", "three_steps", "--args", '{"a": 1}')
    assert code == 1 and "--args must be a JSON array" in err
    assert len(SyncClient(pg_dsn, schema=schema, pool_size=0).list()) == 2


def test_list_filters_and_errors(cli, pg_dsn: str, schema: str) -> None:  # type: ignore[no-untyped-def]
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    done = client.submit(app.three_steps, 1)
    run_worker_until(pg_dsn, config(schema), lambda: finished_count(pg_dsn, schema) == 1)
    live = client.submit(app.quick, 2, queue="elsewhere")
    code, out, _ = cli("list")
    assert code == 0 and str(done.id) in out and str(live.id) in out and "(2 shown)" in out
    code, out, _ = cli("list", "--status", "completed", "--json")
    rows = json.loads(out)
    assert [r["id"] for r in rows] == [str(done.id)] and rows[0]["status"] == "completed"
    code, out, _ = cli("list", "--workflow", "quick", "--since", "1h", "--json")
    assert [r["id"] for r in json.loads(out)] == [str(live.id)]
    code, _, err = cli("list", "--status", "bogus")
    assert code == 1 and "unknown status 'bogus'" in err
    code, _, err = cli("list", "--since", "yesterday")
    assert code == 1 and "--since 'yesterday'" in err


def test_show_timeline_and_errors(cli, pg_dsn: str, schema: str) -> None:  # type: ignore[no-untyped-def]
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    h = client.submit(app.three_steps, 4)
    run_worker_until(pg_dsn, config(schema), lambda: finished_count(pg_dsn, schema) == 1)
    code, out, _ = cli("show", str(h.id))
    assert code == 0 and "status completed" in out and "steps (3):" in out
    assert out.count(" add ") == 3 and f"result    {app.model(4)}" in out
    code, out, _ = cli("show", str(h.id), "--json")
    data = json.loads(out)
    assert data["result"] == app.model(4)
    assert [s["output"] for s in data["steps"]] == [40, 41, 42]
    code, _, err = cli("show", "not-a-uuid")
    assert code == 1 and "is not an execution id" in err
    code, _, err = cli("show", MISSING)
    assert code == 1 and f"no execution {MISSING}" in err


def test_cancel_retry_signal(cli, pg_dsn: str, schema: str) -> None:  # type: ignore[no-untyped-def]
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    waiting = client.submit(app.waiter)
    failed = client.submit(app.raises, "boom")
    run_worker_until(pg_dsn, config(schema),
                     lambda: client.get(waiting.id).status.value == "waiting"
                     and finished_count(pg_dsn, schema) == 1)
    code, out, _ = cli("signal", str(waiting.id), "go", "--payload", '{"ok": true}')
    assert code == 0 and "delivered" in out
    code, out, _ = cli("signal", str(waiting.id), "go", "--idempotency-key", "x", "--json")
    assert json.loads(out) == {"id": str(waiting.id), "signal": "go", "delivered": True,
                               "taken": True, "status": "waiting", "waiting_for": "go"}
    code, out, _ = cli("signal", str(waiting.id), "go", "--idempotency-key", "x")
    assert code == 0 and "already delivered" in out
    code, _, err = cli("signal", str(waiting.id), "go", "--payload", "{oops")
    assert code == 1 and "--payload is not valid JSON" in err
    code, _, err = cli("signal", MISSING, "go")
    assert code == 1 and "no execution" in err
    code, _, err = cli("signal", str(failed.id), "go")
    assert code == 1 and "already finished" in err

    code, out, _ = cli("retry", str(failed.id))
    assert code == 0 and "queued again" in out
    code, _, err = cli("retry", str(failed.id))
    assert code == 1 and "only failed, cancelled or quarantined" in err
    code, _, err = cli("retry", "nope")
    assert code == 1 and "is not an execution id" in err

    code, out, _ = cli("cancel", str(failed.id), "--json")
    assert json.loads(out) == {"id": str(failed.id), "status": "cancelled"}
    code, out, _ = cli("cancel", str(failed.id))  # idempotent
    assert code == 0 and out.strip().endswith(": cancelled")
    run_worker_until(pg_dsn, config(schema),
                     lambda: client.get(waiting.id).status.value == "completed")
    assert waiting.result(timeout=1) == {"ok": True}
    # Like retry of an execution it cannot re-run, cancel of one that already ended
    # otherwise is an error (issue 18: it exited 0 while retry exited 1).
    code, out, err = cli("cancel", str(waiting.id))
    assert (code, out) == (1, "")
    assert err.strip() == (f"kestrel-runtime cancel: execution {waiting.id} already "
                           "completed; only a queued, running or waiting execution can be "
                           "cancelled")
    code, _, err = cli("retry", str(waiting.id))
    assert code == 1 and "only failed, cancelled or quarantined" in err
    code, _, err = cli("cancel", MISSING)
    assert code == 1 and "no execution" in err


def test_stats(cli, pg_dsn: str, schema: str) -> None:  # type: ignore[no-untyped-def]
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    for n in range(3):
        client.submit(app.quick, n, queue="ai-model")
    client.submit(app.quick, 9)
    run_worker_until(pg_dsn, config(schema), lambda: finished_count(pg_dsn, schema) == 1)
    code, out, _ = cli("stats")
    assert code == 0
    line = next(line for line in out.splitlines() if line.startswith("ai-model"))
    assert line.split()[:3] == ["ai-model", "queued", "3"] and line.endswith("s")
    assert "completed 1" in out
    code, out, _ = cli("stats", "--json")
    data = json.loads(out)
    assert data["queues"][0]["queue"] == "ai-model" and data["queues"][0]["count"] == 3
    assert data["queues"][0]["oldest_queued_age_s"] >= 0
    assert data["totals"]["completed"] == 1 and data["totals"]["queued"] == 3


def test_json_logs_one_object_per_line_with_masked_dsn(pg_dsn: str, schema: str) -> None:
    import subprocess
    import sys

    from tests.helpers import APP, ROOT

    canary = "pw-canary-4242"
    dsn = pg_dsn + ("&" if "?" in pg_dsn else "?") + f"password={canary}"
    out = subprocess.run(
        [sys.executable, "-m", "kestrel", "--app", APP, "--dsn", dsn, "--schema", schema,
         "--log-format", "json", "--procs", "1", "--queues", "nope"],
        capture_output=True, text=True, cwd=ROOT, env={**__import__("os").environ,
                                                       "PYTHONPATH": str(ROOT)}, timeout=60)
    assert out.returncode == 2 and "unknown queue" in out.stderr  # stopped before forking
    done = subprocess.run(
        [sys.executable, "-m", "kestrel", "migrate", "--dsn", dsn, "--schema", schema,
         "--log-format", "json", "--log-level", "debug"],
        capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0
    assert canary not in done.stdout + done.stderr
    for line in done.stderr.splitlines():
        record = json.loads(line)
        assert {"ts", "level", "logger", "msg"} <= set(record)


def test_demo_runs_end_to_end(pg_dsn: str, schema: str,
                              capfd: pytest.CaptureFixture[str]) -> None:
    # capfd: the demo runs the CLI commands it shows as processes of their own.
    code = main(["demo", "--incidents", "4", "--dsn", pg_dsn, "--schema", schema])
    out = capfd.readouterr().out
    assert code == 0
    assert "4 executions now wait for approval" in out
    assert "demo done: 3 pull requests opened, 1 rejected" in out
    assert "kestrel.signal:approval" in out  # the timeline shows the approval wait

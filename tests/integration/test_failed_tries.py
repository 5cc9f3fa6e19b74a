"""Every try's error (issue 42, item 5): ``show``, the HTTP API and the web UI list each
failed try of a step (attempt, error type and message, when) before its outcome.

The tries travel with the checkpoint (``operation_outputs.tries``, migration 0023): through a
checkpoint batch (a step after it), a completion's tail (the last step), parallel steps of
one execution (each its own), a fork's copy; hostile messages are stored escaped and cut,
and a step retried past the cap keeps its last 20."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql as pgsql

from kestrel.client import SyncClient
from kestrel.types import StepRow
from tests.apps import tries_app as app
from tests.helpers import ROOT, config, finished_count, run_worker_until
from tests.http_helpers import free_port, make_token, serve_process
from tests.ui_helpers import Browserless


def run(pg_dsn: str, schema: str, *workflows: Any) -> list[Any]:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    eids = [client.submit(wf).id for wf in workflows]
    before = finished_count(pg_dsn, schema)
    run_worker_until(pg_dsn, config(schema),
                     lambda: finished_count(pg_dsn, schema) >= before + len(eids), timeout=60)
    return eids


def steps(pg_dsn: str, schema: str, eid: Any) -> list[StepRow]:
    return [s for s in SyncClient(pg_dsn, schema=schema, pool_size=0).steps(eid)
            if s.step_id >= 0]


def kestrel(pg_dsn: str, schema: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kestrel", *args, "--dsn", pg_dsn,
                           "--schema", schema], capture_output=True, text=True, cwd=ROOT,
                          timeout=60)


def test_each_failed_try_is_kept_with_the_outcome_it_led_to(pg_dsn: str, schema: str) -> None:
    middle, last, doomed = run(pg_dsn, schema, app.middle, app.last, app.doomed_wf)
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    assert client.result(middle, timeout=5) == ["middle ok", "after ok"]

    # In a checkpoint batch: two failed tries, then the outcome of try 3.
    first, after = steps(pg_dsn, schema, middle)
    assert first.attempt == 3 and first.output == "middle ok"
    assert [(t.attempt, t.type, t.message) for t in first.tries] == [
        (1, "builtins.ConnectionError", "middle: try 1 refused"),
        (2, "builtins.ConnectionError", "middle: try 2 refused")]
    # Dated by the database's clock from the step's start, in order, inside the step.
    times = [first.started_at, *(t.failed_at for t in first.tries), first.finished_at]
    assert times == sorted(times)
    assert after.tries == () and after.attempt == 1

    # In the completion's tail (the last step's checkpoint goes with the end).
    (tail,) = steps(pg_dsn, schema, last)
    assert tail.output == "last ok" and [t.attempt for t in tail.tries] == [1]

    # A step that never succeeded: its error is the outcome, the tries before it listed.
    (failed,) = steps(pg_dsn, schema, doomed)
    assert failed.error is not None and failed.error["message"] == "doomed, try 3"
    assert [(t.attempt, t.type, t.message) for t in failed.tries] == [
        (1, "builtins.ValueError", "doomed, try 1"), (2, "builtins.ValueError", "doomed, try 2")]

    # show: each try under its step, in the table and in --json.
    table = kestrel(pg_dsn, schema, "show", str(middle))
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if "tries_flaky" in line and "try 3" in line)
    assert "try 1 failed at +" in lines[at + 1] and "middle: try 1 refused" in lines[at + 1]
    assert "try 2 failed at +" in lines[at + 2] and "middle: try 2 refused" in lines[at + 2]
    assert "failed at" not in lines[at + 3]  # the next step: no failed try
    shown = kestrel(pg_dsn, schema, "show", str(doomed), "--json")
    assert shown.returncode == 0, shown.stderr
    data = json.loads(shown.stdout)["steps"][0]
    assert [t["message"] for t in data["failed_tries"]] == ["doomed, try 1", "doomed, try 2"]
    assert all(t["failed_at"] for t in data["failed_tries"])


def test_parallel_steps_each_keep_their_own_tries(pg_dsn: str, schema: str) -> None:
    (eid,) = run(pg_dsn, schema, app.parallel)
    assert SyncClient(pg_dsn, schema=schema, pool_size=0).result(eid, timeout=5) == [
        "a ok", "b ok", "c ok"]
    by_output = {s.output: s for s in steps(pg_dsn, schema, eid)}
    assert [t.message for t in by_output["a ok"].tries] == ["a: try 1 refused"]
    assert [t.message for t in by_output["b ok"].tries] == [
        "b: try 1 refused", "b: try 2 refused", "b: try 3 refused"]
    assert by_output["c ok"].tries == ()


def test_hostile_messages_are_stored_escaped_and_cut_and_only_the_last_20_kept(
        pg_dsn: str, schema: str) -> None:
    (eid,) = run(pg_dsn, schema, app.hostile_wf)
    (step,) = steps(pg_dsn, schema, eid)
    assert step.output == "survived" and step.attempt == 30
    # 29 failed; the last 20 are kept (attempts 10 to 29), each with its own number.
    assert [t.attempt for t in step.tries] == list(range(10, 30))
    by_attempt = {t.attempt: t for t in step.tries}
    assert by_attempt[10].type == "tests.apps.tries_app.Odd\\x00Error"
    hostile = [by_attempt[n].message for n in range(24, 30)]
    assert hostile[0] == "NUL \\x00 inside"
    assert hostile[1] == "lone surrogate \\ud800 here"
    assert hostile[2] == "\x1b[31mred\x1b[0m and a\nnew line"  # stored as raised
    assert hostile[3] == "'); DROP TABLE operation_outputs; --"
    assert hostile[4] == "</span><script>alert(1)</script>"
    assert len(hostile[5]) == 2000 and hostile[5].endswith("…")

    table = kestrel(pg_dsn, schema, "show", str(eid))
    assert table.returncode == 0, table.stderr
    assert "(tries 1-9 failed too; only the last 20 are kept)" in table.stdout
    assert "\x1b" not in table.stdout  # an escape sequence is shown, never sent
    assert "\\x1b[31mred\\x1b[0m and a\\nnew line" in table.stdout
    assert "DROP TABLE operation_outputs" in table.stdout


def test_a_fork_keeps_the_tries_of_the_steps_it_reuses(pg_dsn: str, schema: str) -> None:
    (eid,) = run(pg_dsn, schema, app.middle)
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    fork = client.fork(eid, from_step=1).id
    (reused,) = [s for s in client.steps(fork) if s.step_id == 0]
    assert [t.message for t in reused.tries] == ["middle: try 1 refused",
                                                 "middle: try 2 refused"]


def test_the_http_api_and_the_ui_list_each_failed_try(pg_dsn: str, schema: str,
                                                       tmp_path: Path) -> None:
    (eid,) = run(pg_dsn, schema, app.hostile_wf)
    token = make_token(pg_dsn, schema, "reader", "read")
    with serve_process(pg_dsn, schema, port=free_port(), log=tmp_path / "serve.log",
                       app="tests.apps.tries_app") as api:
        api.token = token
        got = api.get(f"/api/v1/executions/{eid}")
        assert got.status == 200, got.body
        tries = got.json()["steps"][0]["failed_tries"]
        assert [t["attempt"] for t in tries] == list(range(10, 30))
        assert tries[-3]["message"] == "'); DROP TABLE operation_outputs; --"
        assert tries[-5]["message"] == "lone surrogate \\ud800 here"
        assert all(t["failed_at"] and t["type"] for t in tries)

        ui = Browserless(api)
        ui.login(token)
        page = ui.get(f"/ui/executions/{eid}")
        assert page.status == 200
        html = page.body.decode()
        assert "20 failed tries before it succeeded (the last 20 of 29)" in html
        assert '<li value="29">' in html
        # Escaped for the page: markup in a message is text, never markup.
        assert "&#39;); DROP TABLE operation_outputs; --" in html
        assert "&lt;/span&gt;&lt;script&gt;alert(1)&lt;/script&gt;" in html
        assert "<script>alert" not in html


def test_the_happy_path_writes_no_tries(pg_dsn: str, schema: str) -> None:
    # The column stays NULL where the first try stood: nothing more is written for it.
    eids = run(pg_dsn, schema, app.last, app.middle)
    with psycopg.connect(pg_dsn) as conn:
        rows = conn.execute(
            pgsql.SQL("SELECT execution_id, step_id, tries IS NULL FROM {}.operation_outputs "
                      "WHERE step_id >= 0 ORDER BY execution_id, step_id"
                      ).format(pgsql.Identifier(schema))).fetchall()
    assert sorted(rows) == sorted([(eids[0], 0, False), (eids[1], 0, False),
                                   (eids[1], 1, True)])

"""The CLI as a new user meets it in the first hour (issue 27): a typo'd workflow or signal
name, the hint `show` prints, a command run from another folder, an option typo, --app with a
file name, the DSN for Python, and the demo's port and follow-up commands."""

from __future__ import annotations

import json
import os
import socket
import sys
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest

from kestrel import db, demo, statements
from kestrel.cli import build_parser, import_app, main
from kestrel.cli import common as cli_common
from kestrel.client import SyncClient
from kestrel.errors import ConfigError
from kestrel.sql import queries
from tests.apps import ledger_app as app
from tests.helpers import config, q1, run_worker_until


@pytest.fixture
def cli(pg_dsn: str, schema: str, capsys: pytest.CaptureFixture[str]):  # type: ignore[no-untyped-def]
    def run(*args: str) -> tuple[int, str, str]:
        code = main([*args, "--dsn", pg_dsn, "--schema", schema, "--log-level", "error"])
        out, err = capsys.readouterr()
        return code, out, err

    return run


def live_worker(dsn: str, schema: str, workflows: list[str]) -> None:
    """A worker's row, as a running worker writes it (the statement it uses)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        db.run_sync(conn, statements.versions.register_worker(
            queries(schema), worker_id=f"test:{uuid.uuid4()}", app_version="v1",
            workflows=workflows, queues=["default"], stale_after_s=600))


def executions(dsn: str, schema: str) -> int:
    return int(q1(dsn, schema, "SELECT count(*) FROM {s}.executions"))


def test_a_workflow_no_live_worker_runs_is_refused_with_the_closest_names(
    cli: Any, pg_dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    code, _, err = cli("submit", "three_steps", "--args", "[1]")
    assert code == 0 and err == ""  # no fleet yet: queued; a script reads no note
    monkeypatch.setattr(cli_common, "interactive", lambda: True)
    code, _, err = cli("submit", "three_steps", "--args", "[3]")
    assert code == 0 and err == ("kestrel-runtime submit: note: no worker is running; the "
                                 "execution waits until one that runs 'three_steps' claims "
                                 "it\n")  # a person at a terminal is told
    live_worker(pg_dsn, schema, ["three_steps", "waiter"])
    code, _, err = cli("submit", "thre_steps", "--args", "[1]")
    assert code == 1 and "no live worker runs workflow 'thre_steps'" in err
    assert "did you mean 'three_steps'?" in err and len(err.strip().splitlines()) == 1
    code, _, err = cli("submit", "zzz", "--args", "[1]")
    assert code == 1 and "they run 'three_steps', 'waiter'" in err
    assert executions(pg_dsn, schema) == 2  # nothing written by the refusals
    code, out, _ = cli("submit", "thre_steps", "--allow-unknown")
    assert code == 0 and uuid.UUID(out.strip())
    code, _, err = cli("submit", "three_steps", "--args", "[2]")
    assert code == 0 and err == ""


@pytest.mark.parametrize("name", ["\x00", "a'; DROP TABLE x; --", "\ud800", "w" * 10_000,
                                  "three_steps\n"])
def test_hostile_workflow_names_are_refused_before_anything_is_written(
    cli: Any, pg_dsn: str, schema: str, name: str
) -> None:
    live_worker(pg_dsn, schema, ["three_steps"])
    code, _, err = cli("submit", name)
    assert code == 1 and err.startswith("kestrel-runtime submit: ")
    assert len(err.strip().splitlines()) == 1
    assert executions(pg_dsn, schema) == 0


def test_a_signal_the_execution_does_not_wait_for_says_what_it_waits_for(
    cli: Any, pg_dsn: str, schema: str
) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    h = client.submit(app.waiter)
    run_worker_until(pg_dsn, config(schema),
                     lambda: client.get(h.id).status.value == "waiting")
    wanted = client.get(h.id).waiting_for
    assert wanted and not wanted.startswith("kestrel.")
    code, out, err = cli("signal", str(h.id), wanted + "x", "--json")
    assert code == 0 and json.loads(out)["waiting_for"] == wanted
    assert f"waits for signal {wanted!r}, not {wanted + 'x'!r}" in err
    _, out, _ = cli("show", str(h.id))
    assert f"kestrel-runtime signal {h.id} {wanted} --payload 'JSON'" in out
    code, _, err = cli("signal", str(h.id), wanted, "--payload", "1")
    assert code == 0 and err == ""  # the right name: no note


def test_signal_strict_exits_5_when_no_wait_can_take_it(
    cli: Any, pg_dsn: str, schema: str
) -> None:
    """Issue 43 item 10: a misspelled signal exited 0 with a note a script cannot catch, and
    one sent to an execution that finished as it arrived printed "delivered" and then a note.
    ``--strict`` exits 5 when no wait can take it; the signal is kept (a later wait of that
    name may take it)."""
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    h = client.submit(app.waiter)
    run_worker_until(pg_dsn, config(schema),
                     lambda: client.get(h.id).status.value == "waiting")
    wanted = client.get(h.id).waiting_for
    assert wanted
    code, out, err = cli("signal", str(h.id), wanted + "x", "--strict", "--json")
    assert code == 5 and json.loads(out)["taken"] is False
    assert err.startswith("kestrel-runtime signal: error: ") and len(err.splitlines()) == 1
    code, out, err = cli("signal", str(h.id), wanted + "x", "--strict")
    assert code == 5 and out.strip().endswith("kept, not taken")
    code, out, err = cli("signal", str(h.id), wanted, "--payload", "1", "--strict")
    assert (code, err) == (0, "") and out.strip().endswith("delivered")
    run_worker_until(pg_dsn, config(schema), lambda: client.get(h.id).status.terminal)
    # A finished execution refuses a signal outright (exit 1, nothing kept), strict or not.
    for strict in ((), ("--strict",)):
        code, out, err = cli("signal", str(h.id), wanted, *strict)
        assert code == 1 and out == "" and "completed" in err, (code, out, err)


def test_show_places_patch_markers_and_names_the_execution_a_fork_came_from(
    cli: Any, pg_dsn: str, schema: str
) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    h = client.submit(app.three_steps, 4)
    run_worker_until(pg_dsn, config(schema), lambda: client.get(h.id).status.terminal)
    q1(pg_dsn, schema, "INSERT INTO {s}.operation_outputs (execution_id, step_id, step_name, "
       "output, attempt, lease_epoch, started_at, finished_at) "
       "SELECT id, -1, 'kestrel.patch:p1', '{{\"at\": 2}}', 1, 1, finished_at, finished_at "
       "FROM {s}.workflow_history WHERE id = %s RETURNING 1", [h.id])
    _, out, _ = cli("show", str(h.id))
    lines = [line.strip() for line in out.splitlines()]
    marker = next(i for i, line in enumerate(lines) if line.startswith("patch"))
    assert "#-1" not in out and "new code's path from step 2 on" in lines[marker]
    assert lines[marker - 1].startswith("#1") and lines[marker + 1].startswith("#2")
    fork = client.fork(h.id, 2)
    _, out, _ = cli("show", str(fork.id))
    assert f"forked from {h.id} (its steps 0..1 reused)" in out
    copied = [line.strip() for line in out.splitlines() if line.strip().startswith("#")]
    assert copied[0].startswith("#0      reused") and copied[1].startswith("#1      reused")
    assert "-" not in "".join(line.split()[1] for line in copied)  # no negative offsets
    _, out, _ = cli("show", str(fork.id), "--json")
    assert json.loads(out)["forked_from"] == {"id": str(h.id), "from_step": 2}
    _, out, _ = cli("show", str(h.id), "--json")
    assert json.loads(out)["forked_from"] is None


@pytest.fixture
def no_server(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in list(os.environ):
        if var.startswith("KESTREL_") or var.startswith("PG"):
            monkeypatch.delenv(var)


@pytest.mark.usefixtures("no_server")
@pytest.mark.parametrize("command", [["list"], ["show", str(uuid.UUID(int=0x5eed))], ["stats"],
                                     ["dsn"], ["token", "list"], ["partitions"],
                                     ["export-histories", "--out", "-"],
                                     ["replay", "--app", "tests.apps.replay_v1"]])
def test_an_operator_command_from_another_folder_creates_no_database(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    where = tmp_path / "elsewhere" / "pgdata"
    code = main([*command, "--data-dir", str(where)])
    err = capsys.readouterr().err
    assert code == 1 and f"no embedded database in {where}" in err
    assert "--data-dir" in err and "--dsn" in err
    assert not where.exists()  # nothing made there


def test_dsn_prints_what_the_commands_use(cli: Any, pg_dsn: str) -> None:
    code, out, _ = cli("dsn")
    assert code == 0 and out.strip() == pg_dsn
    code, out, _ = cli("dsn", "--json")
    assert json.loads(out) == {"dsn": pg_dsn}


def test_an_option_typo_is_reported_by_its_command_with_the_closest_option(
    capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["submit", "wf", "--qeue", "q"])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert err.startswith("usage: kestrel-runtime submit")
    assert "unrecognized arguments: --qeue q (did you mean --queue?)" in err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["token", "revoke", "x", "--jsn"])
    err = capsys.readouterr().err
    assert err.startswith("usage: kestrel-runtime token revoke")
    assert "did you mean --json or --dsn?" in err


def test_help_is_short_at_the_top_and_shows_examples(capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    top = capsys.readouterr().out
    assert len(top.splitlines()) < 70 and "kestrel-runtime run --help" in top
    assert "examples:" in top and "--batch-size" not in top
    for command in ("submit", "signal", "show", "fork", "retry", "cancel", "list"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([command, "--help"])
        assert "examples:\n  kestrel-runtime " + command in capsys.readouterr().out


def test_a_settings_error_names_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list", "--schema", "Bad-Name"]) == 2
    assert capsys.readouterr().err.startswith("kestrel-runtime list: ")


@pytest.mark.parametrize("given", ["greet.py", "app/greet.py"])
def test_app_given_as_a_file_says_to_name_the_module(given: str) -> None:
    with pytest.raises(ConfigError) as info:
        import_app(given)
    module = given.removesuffix(".py").replace("/", ".")
    assert f"--app takes a module name, as `python -m` does, not a file: --app {module}" \
        in str(info.value)


def test_the_demos_port_probe_takes_a_port_left_in_time_wait() -> None:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    port = srv.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = srv.accept()
    accepted.close()  # the server side closes first: its end of the connection is TIME_WAIT
    client.close()
    srv.close()
    assert demo.http_port("127.0.0.1", port) == port


def test_the_demo_prints_commands_that_run_from_here(monkeypatch: pytest.MonkeyPatch) -> None:
    mine = Path(sys.executable).parent / "kestrel-runtime"
    assert mine.exists()
    monkeypatch.setenv("PATH", "/nonexistent")  # make run: .venv/bin is not on PATH
    shown = demo.command_name()
    assert shown != "kestrel-runtime" and Path(shown).resolve() == mine.resolve()
    monkeypatch.setenv("PATH", str(mine.parent))
    assert demo.command_name() == "kestrel-runtime"


@pytest.mark.usefixtures("no_server")
def test_operator_commands_on_the_embedded_database_answer_without_the_startup_warning(
    pg_dsn: str, schema: str, tmp_path_factory: pytest.TempPathFactory,
    capsys: pytest.CaptureFixture[str],
) -> None:
    if "KESTREL_TEST_DSN" in os.environ:  # CI never sets it: the suite's own embedded server
        pytest.skip("needs the suite's embedded server")
    data = tmp_path_factory.getbasetemp() / "pg0" / "data"  # tests/conftest.py's
    assert main(["stats", "--data-dir", str(data), "--schema", schema]) == 0
    out, err = capsys.readouterr()
    assert "queue" in out and err == ""  # the runtime's start says it; a command does not
    assert main(["dsn", "--data-dir", str(data)]) == 0
    dsn = capsys.readouterr().out.strip()
    with psycopg.connect(dsn) as conn:  # what a script or psql would connect to
        assert conn.execute("SELECT 1").fetchone() == (1,)

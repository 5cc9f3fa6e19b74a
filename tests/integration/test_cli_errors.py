"""The CLI's errors are one line naming the problem and the fix (issue 18), its new options
(fork, submit --delay/--start-at/--dedup-key, show's waits and deadline) work, and the
README's least-privilege grants are enough for every operator command."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from psycopg import sql as pgsql

from kestrel.cli import EXIT_NOT_FINISHED, main
from kestrel.client import SyncClient
from tests.apps import ledger_app as app
from tests.helpers import ROOT, config, finished_count, q1, run_worker_until

Cli = Callable[..., tuple[int, str, str]]


@pytest.fixture
def run(capsys: pytest.CaptureFixture[str]) -> Cli:
    """``run(dsn, schema, *args)``: the CLI in-process; (exit status, stdout, stderr)."""

    def call(dsn: str, schema: str, *args: str) -> tuple[int, str, str]:
        code = main([*args, "--dsn", dsn, "--schema", schema, "--log-level", "error"])
        out, err = capsys.readouterr()
        return code, out, err

    return call


def one_line(err: str, command: str) -> str:
    """The single line on stderr, without the ``kestrel-runtime <command>: `` prefix."""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    prefix = f"kestrel-runtime {command}: "
    assert lines[0].startswith(prefix), lines[0]
    return lines[0].removeprefix(prefix)


@pytest.fixture
def empty_schema(pg_dsn: str) -> Iterator[str]:
    name = f"t_empty_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(pgsql.SQL("CREATE SCHEMA {}").format(pgsql.Identifier(name)))
    yield name
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(pgsql.SQL("DROP SCHEMA {} CASCADE").format(pgsql.Identifier(name)))


OPERATOR_CALLS = [
    ("list",), ("stats",), ("show", str(uuid.UUID(int=1))),
    ("submit", "three_steps", "--args", "[1]"), ("cancel", str(uuid.UUID(int=1))),
    ("retry", str(uuid.UUID(int=1))), ("fork", str(uuid.UUID(int=1)), "--from-step", "1"),
    ("signal", str(uuid.UUID(int=1)), "go"),
]


@pytest.mark.parametrize("call", OPERATOR_CALLS, ids=lambda c: c[0])
def test_an_unmigrated_or_wrong_schema_says_run_migrate(
        run: Cli, pg_dsn: str, empty_schema: str, call: tuple[str, ...]) -> None:
    for schema in (empty_schema, "no_such_schema_here"):
        code, out, err = run(pg_dsn, schema, *call)
        line = one_line(err, call[0])
        assert code == 1 and out == ""
        assert line.startswith(f"schema {schema} has no kestrel tables")
        assert line.endswith(f"run `kestrel-runtime migrate --schema {schema}` as the schema "
                             "owner, or name the right schema with --schema / KESTREL_SCHEMA")
    assert q1(pg_dsn, empty_schema, "SELECT count(*) FROM pg_tables WHERE schemaname = %s",
              [empty_schema]) == 0  # nothing was created on the way


def test_a_schema_from_an_older_version_says_run_migrate(
        run: Cli, pg_dsn: str, schema: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:  # as if before migration 0002
        conn.execute(pgsql.SQL("ALTER TABLE {}.workflow_executions DROP COLUMN waiting_for "
                               "CASCADE").format(pgsql.Identifier(schema)))
    code, _, err = run(pg_dsn, schema, "show", str(uuid.UUID(int=1)))
    line = one_line(err, "show")
    assert code == 1
    assert line.startswith(f"schema {schema} has no kestrel tables or an older version of "
                           "them (column ")
    assert f"run `kestrel-runtime migrate --schema {schema}`" in line


@pytest.mark.parametrize(("dsn", "expect"), [
    ("garbage here", 'invalid --dsn / KESTREL_DSN: missing "=" after "garbage"'),
    ("host=127.0.0.1 port=notaport", "cannot connect to the database: "),
    ("postgresql://me:pw-canary-77@127.0.0.1:1/db", "cannot connect to the database: "),
    ("postgresql://me@127.0.0.1:1/db?sslmode=bogus", "cannot connect to the database: "),
    ("'); DROP TABLE x; --", "invalid --dsn / KESTREL_DSN: "),
])
def test_a_bad_dsn_is_one_line_without_the_password(run: Cli, dsn: str, expect: str) -> None:
    code, out, err = run(dsn, "kestrel", "list")
    line = one_line(err, "list")
    assert code == 1 and out == "" and line.startswith(expect), line
    assert "pw-canary-77" not in err
    assert "--dsn" in line  # names where to fix it


@pytest.fixture
def weak_role(direct_dsn: str) -> Iterator[tuple[str, str]]:
    """A login role with no rights at all: (role, its DSN)."""
    role = f"kestrel_weak_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(direct_dsn, autocommit=True) as conn:
        conn.execute(pgsql.SQL("CREATE ROLE {} LOGIN").format(pgsql.Identifier(role)))
    yield role, as_role(direct_dsn, role)
    with psycopg.connect(direct_dsn, autocommit=True) as conn:
        r = pgsql.Identifier(role)
        conn.execute(pgsql.SQL("DROP OWNED BY {}").format(r))
        conn.execute(pgsql.SQL("DROP ROLE {}").format(r))


def as_role(dsn: str, role: str) -> str:
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(dsn)
    return urlunsplit(parts._replace(netloc=f"{role}@{parts.netloc.rsplit('@', 1)[-1]}"))


def test_migrate_without_privileges_says_run_it_as_the_owner(
        run: Cli, schema: str, weak_role: tuple[str, str]) -> None:
    _, dsn = weak_role
    for target in (f"{schema}_new", schema):  # a new schema, and an existing one
        code, _, err = run(dsn, target, "migrate")
        line = one_line(err, "migrate")
        assert code == 1 and line.startswith("permission denied (permission denied for ")
        assert "run it as the owner of the schema" in line
    code, _, err = run(dsn, schema, "list")
    line = one_line(err, "list")
    assert code == 1 and line.startswith("permission denied (permission denied for schema")
    assert 'README, "Least privilege"' in line


def readme_grants(schema: str, role: str) -> str:
    """The least-privilege block of the manual, for *schema* and *role*: in
    docs/howto/operating.md, where the README's "Least privilege" section (the one the
    error above names) sends the reader."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("\n## Least privilege\n"):]
    assert "(docs/howto/operating.md#least-privilege)" in section.split("\n## ", 2)[1]
    text = (ROOT / "docs" / "howto" / "operating.md").read_text()
    block = text.split("<!-- least-privilege grants: tested verbatim -->", 1)[1]
    sql_text = block.split("```sql\n", 1)[1].split("```", 1)[0]
    sql_text = re.sub(r"\bkestrel_runtime\b", role, sql_text)
    return re.sub(r"\bSCHEMA kestrel\b", f"SCHEMA {schema}", sql_text)


def test_the_readme_grants_are_enough_for_every_command(
        run: Cli, pg_dsn: str, direct_dsn: str, schema: str,
        weak_role: tuple[str, str]) -> None:
    role, dsn = weak_role
    with psycopg.connect(direct_dsn, autocommit=True) as conn:
        for statement in readme_grants(schema, role).split(";"):
            if statement.strip() and not statement.strip().startswith("--"):
                conn.execute(statement)  # type: ignore[call-overload]
    # What the issue found: signal needs USAGE on signals_id_seq.
    assert q1(direct_dsn, schema, "SELECT has_sequence_privilege(%s, %s, 'USAGE')",
              [role, f"{schema}.signals_id_seq"]) is True

    def ok(*args: str) -> str:
        code, out, err = run(dsn, schema, *args)
        assert code == 0 and err == "", (args, err)
        return out.strip()

    waiting = uuid.UUID(ok("submit", "waiter"))
    done = uuid.UUID(ok("submit", "three_steps", "--args", "[3]"))
    failed = uuid.UUID(ok("submit", "raises", "--args", '["boom"]'))
    client = SyncClient(dsn, schema=schema, pool_size=0)
    run_worker_until(dsn, config(schema), lambda: finished_count(dsn, schema) == 2
                     and client.get(waiting).status.value == "waiting")
    assert "waits for signal 'go'" in ok("show", str(waiting))
    assert "delivered" in ok("signal", str(waiting), "go", "--payload", "1")
    assert "queued again" in ok("retry", str(failed))
    assert "cancelled" in ok("cancel", str(failed))
    forked = uuid.UUID(ok("fork", str(done), "--from-step", "2"))
    run_worker_until(dsn, config(schema), lambda: finished_count(dsn, schema) == 4)
    assert client.result(forked, timeout=5) == app.model(3)
    assert client.result(waiting, timeout=5) == 1
    ok("list")
    ok("stats")
    ok("show", str(forked))


def test_submit_wait_that_runs_out_prints_the_id_and_how_to_wait_again(
        run: Cli, pg_dsn: str, schema: str) -> None:
    code, out, err = run(pg_dsn, schema, "submit", "three_steps", "--args", "[5]", "--wait",
                         "0.3")
    eid = uuid.UUID(out.strip())  # the id, on stdout, is the only thing there
    line = one_line(err, "submit")
    assert code == EXIT_NOT_FINISHED == 3
    assert line == (f"execution {eid} has not finished after 0.3s; it goes on: wait again "
                    f"with `kestrel-runtime show {eid} --wait SECONDS`")
    code, out, err = run(pg_dsn, schema, "submit", "three_steps", "--args", "[6]", "--wait",
                         "0.2", "--json")
    data = json.loads(out)
    assert code == 3 and data["finished"] is False and uuid.UUID(data["id"])
    # The way to wait again works: once a worker ran it, show --wait returns it.
    run_worker_until(pg_dsn, config(schema), lambda: finished_count(pg_dsn, schema) == 2)
    code, out, err = run(pg_dsn, schema, "show", str(eid), "--wait", "5")
    assert code == 0 and "status completed" in out and err == ""
    code, out, _ = run(pg_dsn, schema, "submit", "three_steps", "--args", "[5]", "--wait",
                       "1", "--idempotency-key", "k5")
    code2, out2, _ = run(pg_dsn, schema, "submit", "three_steps", "--args", "[5]", "--wait",
                         "0.1", "--idempotency-key", "k5")
    assert code2 == 3 and out2.strip() == out.strip().splitlines()[0]


def test_show_says_what_a_live_execution_waits_for_and_its_deadline(
        run: Cli, pg_dsn: str, schema: str) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    sig = client.submit(app.wait_with_timeout, 3600.0, timeout=7200)
    sleeping = client.submit(app.sleeper, 1, 3600.0)
    child_parent = client.submit(app.parent_of_waiter)
    run_worker_until(pg_dsn, config(schema), lambda: all(
        client.get(h.id).status.value == "waiting" for h in (sig, sleeping, child_parent)))
    code, out, _ = run(pg_dsn, schema, "show", str(sig.id))
    assert code == 0
    assert (f"waits for signal 'never' (kestrel-runtime signal {sig.id} never --payload "
            "'JSON')   until ") in out
    assert "deadline  " in out and "(fails then unless finished)" in out
    data = json.loads(run(pg_dsn, schema, "show", str(sig.id), "--json")[1])
    until = datetime.fromisoformat(data["waits_for"]["until"])
    deadline = datetime.fromisoformat(data["deadline"])
    assert data["waits_for"]["kind"] == "signal"
    # Both in the database's clock: about an hour and two hours after the submit.
    created = datetime.fromisoformat(data["created_at"])
    assert timedelta(minutes=59) < until - created < timedelta(minutes=61)
    assert timedelta(minutes=119) < deadline - created < timedelta(minutes=121)

    out = run(pg_dsn, schema, "show", str(sleeping.id))[1]
    assert "waits for the end of a durable sleep   until " in out
    data = json.loads(run(pg_dsn, schema, "show", str(child_parent.id), "--json")[1])
    assert data["waits_for"]["kind"] == "child"
    assert data["waits_for"]["what"].startswith("child execution ")

    code, out, _ = run(pg_dsn, schema, "submit", "quick", "--args", "[1]", "--queue", "nolimit")
    data = json.loads(run(pg_dsn, schema, "show", out.strip(), "--json")[1])
    assert data["waits_for"] == {"kind": "worker", "what": "a worker claiming queue "
                                 "'nolimit'", "until": None}
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(pgsql.SQL("INSERT INTO {}.queue_limits (queue, concurrency) "
                               "VALUES ('ai', 5)").format(pgsql.Identifier(schema)))
    code, out, _ = run(pg_dsn, schema, "submit", "quick", "--args", "[1]", "--queue=ai")
    data = json.loads(run(pg_dsn, schema, "show", out.strip(), "--json")[1])
    assert data["queue"] == "ai"
    assert data["waits_for"]["kind"] == "slot" and "concurrency 5" in data["waits_for"]["what"]


def test_submit_delay_start_at_and_dedup_key(run: Cli, pg_dsn: str, schema: str) -> None:
    code, out, _ = run(pg_dsn, schema, "submit", "quick", "--args", "[1]", "--delay", "3600")
    data = json.loads(run(pg_dsn, schema, "show", out.strip(), "--json")[1])
    assert code == 0 and data["status"] == "waiting" and data["waits_for"]["kind"] == "start"
    start = datetime.fromisoformat(data["waits_for"]["until"])
    created = datetime.fromisoformat(data["created_at"])
    assert timedelta(minutes=59) < start - created < timedelta(minutes=61)

    at = (datetime.now(UTC) + timedelta(days=2)).replace(microsecond=0)
    code, out, _ = run(pg_dsn, schema, "submit", "quick", "--args", "[2]", "--start-at",
                       at.strftime("%Y-%m-%dT%H:%M:%S"))  # no zone: UTC
    data = json.loads(run(pg_dsn, schema, "show", out.strip(), "--json")[1])
    assert abs(datetime.fromisoformat(data["waits_for"]["until"]) - at) < timedelta(minutes=1)

    first = run(pg_dsn, schema, "submit", "quick", "--args", "[3]", "--dedup-key", "d")[1]
    again = run(pg_dsn, schema, "submit", "quick", "--args", "[4]", "--dedup-key", "d")[1]
    assert first == again
    code, out, err = run(pg_dsn, schema, "submit", "quick", "--args", "[4]", "--dedup-key",
                         "d", "--reject-duplicate")
    assert code == 1 and out == ""
    assert f"already has a live execution {first.strip()}" in one_line(err, "submit")

    for bad, expect in [(["--start-at", "tomorrow"], "--start-at 'tomorrow': use an ISO"),
                        (["--delay", "-1"], "delay must be between 0"),
                        (["--delay", "nan"], "delay must be between 0")]:
        code, out, err = run(pg_dsn, schema, "submit", "quick", *bad)
        assert code == 1 and out == "" and expect in one_line(err, "submit")
    assert q1(pg_dsn, schema, "SELECT count(*) FROM {s}.workflow_executions") == 3


def test_fork_starts_from_the_nth_checkpoint(run: Cli, pg_dsn: str, schema: str) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    h = client.submit(app.three_steps, 8)
    run_worker_until(pg_dsn, config(schema), lambda: finished_count(pg_dsn, schema) == 1)
    code, out, _ = run(pg_dsn, schema, "fork", str(h.id), "--from-step", "2", "--json")
    data = json.loads(out)
    assert code == 0 and data["forked_from"] == str(h.id) and data["from_step"] == 2
    new = uuid.UUID(data["id"])
    run_worker_until(pg_dsn, config(schema), lambda: finished_count(pg_dsn, schema) == 2)
    assert client.result(new, timeout=5) == app.model(8)
    for bad, expect in [((str(h.id), "--from-step", "-1"), "--from-step must be 0 or more"),
                        (("nope", "--from-step", "1"), "'nope' is not an execution id"),
                        ((str(uuid.UUID(int=7)), "--from-step", "1"), "no execution")]:
        code, out, err = run(pg_dsn, schema, "fork", *bad)
        assert code == 1 and out == "" and expect in one_line(err, "fork")


@pytest.mark.parametrize(("args", "expect"), [
    (["submit", "wf\ud800"], "workflow name"),
    (["submit", "quick", "--idempotency-key", "k\ud800"], "idempotency key"),
    (["submit", "quick", "--dedup-key", "x" * 3000], "dedup key"),
    (["submit", "quick", "--queue", "'); DROP TABLE x; --"], "invalid queue name"),
    (["submit", "quick", "--args", "[" * 100_000], "--args is not valid JSON"),
    (["submit", "quick", "--args", "[" * 300 + "]" * 300], "not JSON-serializable"),
    (["submit", "quick", "--args", json.dumps(["x" * (17 * 1024 * 1024)])], "over the cap"),
    (["submit", "quick", "--args", "[1e400]"], "beyond a float64"),
    (["signal", str(uuid.UUID(int=3)), "go\ud800"], "signal name"),
    (["signal", str(uuid.UUID(int=3)), "'); DROP TABLE x; --"], "no execution"),
    (["show", "'); DROP TABLE x; --"], "is not an execution id"),
    (["list", "--status", "'; DROP TABLE x; --"], "unknown status"),
])
def test_hostile_input_is_one_line_and_writes_nothing(
        run: Cli, pg_dsn: str, schema: str, args: list[str], expect: str) -> None:
    code, out, err = run(pg_dsn, schema, *args)
    line = one_line(err, args[0])
    assert code == 1 and out == "", (code, out)
    assert expect.lower() in line.lower(), line
    assert len(line) < 2000
    assert q1(pg_dsn, schema, "SELECT count(*) FROM {s}.workflow_executions") == 0
    assert q1(pg_dsn, schema, "SELECT count(*) FROM {s}.signals") == 0


def test_a_metrics_port_in_use_is_one_line_naming_the_setting(pg_dsn: str,
                                                               schema: str) -> None:
    """Issue 43 item 5: a port already in use gave a raw ``OSError: [Errno 98]`` traceback;
    the README promises one line naming the problem and the fix (exit 2, a setting)."""
    import socket
    import subprocess
    import sys

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        out = subprocess.run(
            [sys.executable, "-m", "kestrel", "--dsn", pg_dsn, "--schema", schema, "--app",
             "tests.apps.ledger_app", "--procs", "1", "--metrics-port", str(port),
             "--log-level", "error"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    finally:
        holder.close()
    assert out.returncode == 2, out
    line = one_line(out.stderr, "run")
    assert f"--metrics-port={port}" in line and f"127.0.0.1:{port}" in line, line
    assert "choose a free port" in line


@pytest.mark.parametrize("queue", ["'); DELETE FROM queue_limits; --", "deploys\x00", "q\ud800",
                                   "x" * 10_000, "", "%", "deploys "])
def test_remove_limits_refuses_a_bad_queue_name_in_one_line_and_removes_nothing(
        run: Cli, pg_dsn: str, schema: str, queue: str) -> None:
    q1(pg_dsn, schema, "INSERT INTO {s}.queue_limits (queue, concurrency) VALUES "
       "('deploys', 1) RETURNING 1")
    code, out, err = run(pg_dsn, schema, "remove-limits", queue)
    line = one_line(err, "remove-limits")
    assert code == 1 and out == "", (code, out)
    assert "invalid queue name" in line and len(line) < 2000, line
    assert q1(pg_dsn, schema, "SELECT count(*) FROM {s}.queue_limits") == 1


def test_remove_limits_says_whether_the_queue_had_any(
        run: Cli, pg_dsn: str, schema: str) -> None:
    q1(pg_dsn, schema, "INSERT INTO {s}.queue_limits (queue, concurrency) VALUES "
       "('deploys', 1) RETURNING 1")
    assert run(pg_dsn, schema, "remove-limits", "nightly", "--json")[:2] == (
        0, '{\n  "queue": "nightly",\n  "removed": false\n}\n')
    code, out, _ = run(pg_dsn, schema, "remove-limits", "deploys")
    assert code == 0 and "limits removed" in out, out
    assert q1(pg_dsn, schema, "SELECT count(*) FROM {s}.queue_limits") == 0
    code, out, _ = run(pg_dsn, schema, "remove-limits", "deploys")
    assert code == 0 and "had no limits" in out, out

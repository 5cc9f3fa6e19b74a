"""Replay before deploy (issue 27): `kestrel-runtime replay`, `export-histories` and
`kestrel.testing.replay`, against histories a real worker recorded.

Release 1 of an app (tests/apps/replay_v1) runs: one execution completes, one parks at its
wait for the signal ``go``. Then the command replays them through release 1 itself (same
path), release 2 (a ``ctx.patched`` branch: the completed one would take the new path) and
release 3 (a step renamed: the completed one diverges at step 2), from the database and
from an exported file, and never writes: every table of the schema, each row with its
``xmin``, hashes the same before and after.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql as pgsql

import tests.apps.replay_v1  # noqa: F401  (registers release 1 in this process)
from kestrel.client import SyncClient
from kestrel.errors import ExecutionNotFound
from kestrel.replay import HistoryFileError, ReplayFailed
from kestrel.testing import replay
from tests.apps import replay_flows
from tests.helpers import ROOT, config, q, run_worker_until

UNREACHABLE = "postgresql://nobody@127.0.0.1:1/nothing?connect_timeout=2"


def cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``kestrel-runtime`` as a user does, from this checkout's sources."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join((str(ROOT / "src"), str(ROOT))))
    return subprocess.run([sys.executable, "-m", "kestrel", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120, input=stdin)


def snapshot(dsn: str, schema: str) -> dict[str, str]:
    """Every table of *schema* (partitions included): a hash of its rows with their xmin,
    so an insert, a delete and even an update that changes no value all show."""
    tables = [r[0] for r in q(dsn, schema, "SELECT table_name FROM information_schema.tables "
                                           "WHERE table_schema = %s AND table_type = "
                                           "'BASE TABLE' ORDER BY 1", [schema])]
    assert "operation_outputs" in tables and "workflow_executions" in tables
    out = {}
    for t in tables:
        out[t] = q(dsn, schema, "SELECT count(*) || ':' || coalesce(md5(string_agg("
                                "x.xmin::text || x::text, ',' ORDER BY x::text)), '') "
                                "FROM {s}." + f'"{t}"' + " AS x")[0][0]
    return out


def line_of(out: str, eid: Any) -> str:
    found = [line for line in out.splitlines() if str(eid) in line]
    assert len(found) == 1, out
    return found[0]


@pytest.fixture
def recorded(pg_dsn: str, schema: str) -> dict[str, Any]:
    """Release 1 ran: ``done`` completed (a, the signal, b), ``parked`` waits for ``go``
    after step a, ``gone`` (a workflow later releases drop) completed."""
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    done = client.submit("replay_app.flow", 1).id
    client.signal(done, "go", 5)
    parked = client.submit("replay_app.flow", 2).id
    gone = client.submit("replay_app.gone", 3).id

    def finished() -> bool:
        st = {r[0]: r[1] for r in q(pg_dsn, schema, "SELECT id, status FROM {s}.executions")}
        return (st.get(done) == "completed" and st.get(gone) == "completed"
                and st.get(parked) == "waiting")

    run_worker_until(pg_dsn, config(schema), finished)
    steps = [r[0] for r in q(pg_dsn, schema, "SELECT step_name FROM {s}.workflow_steps "
                                             "WHERE execution_id = %s ORDER BY step_id",
                             [done])]
    assert steps == ["replay_app.a", "kestrel.signal:go", "replay_app.b"]
    return {"done": done, "parked": parked, "gone": gone}


def replay_db(dsn: str, schema: str, app: str, *more: str) -> subprocess.CompletedProcess[str]:
    return cli("replay", "--app", app, "--dsn", dsn, "--schema", schema, *more)


def test_replay_from_the_database_reports_each_path_and_writes_nothing(
        pg_dsn: str, schema: str, recorded: dict[str, Any]) -> None:
    done, parked = recorded["done"], recorded["parked"]
    before = snapshot(pg_dsn, schema)

    same = replay_db(pg_dsn, schema, "tests.apps.replay_v1", "--workflow", "replay_app.flow")
    assert same.returncode == 0, same.stdout + same.stderr
    assert "same path (3 checkpoints replayed; the workflow returns)" in line_of(
        same.stdout, done)
    assert ("same path (1 checkpoint replayed; the code goes on at step 1 with a wait for "
            "signal 'go')") in line_of(same.stdout, parked)
    assert "replayed 2 executions: 2 same path; 0 failed" in same.stdout

    patched = replay_db(pg_dsn, schema, "tests.apps.replay_v2", "--workflow",
                        "replay_app.flow")
    assert patched.returncode == 0, patched.stdout + patched.stderr
    assert "takes the new path after patch 'audit' (at step 3)" in line_of(
        patched.stdout, done)
    assert "the code goes on at step 3 with replay_app.audit" in line_of(patched.stdout, done)
    assert "same path" in line_of(patched.stdout, parked)

    renamed = replay_db(pg_dsn, schema, "tests.apps.replay_v3", "--workflow",
                        "replay_app.flow")
    assert renamed.returncode == 4, renamed.stdout + renamed.stderr
    assert line_of(renamed.stdout, done).startswith("FAIL")
    assert ("diverges at step 2 (recorded `replay_app.b`, code calls `replay_app.c`)"
            in line_of(renamed.stdout, done))
    assert "same path" in line_of(renamed.stdout, parked)  # it has not reached step 2 yet
    assert "1 diverging; 1 failed" in renamed.stdout

    assert snapshot(pg_dsn, schema) == before


def test_a_workflow_the_app_lacks_fails_only_while_live(
        pg_dsn: str, schema: str, recorded: dict[str, Any]) -> None:
    one = replay_db(pg_dsn, schema, "tests.apps.replay_v2", "--id", str(recorded["gone"]))
    assert one.returncode == 0, one.stdout + one.stderr
    assert ("workflow 'replay_app.gone' is not in the app (finished: nothing left to run)"
            in one.stdout)
    live = SyncClient(pg_dsn, schema=schema, pool_size=0).submit("replay_app.gone", 4).id
    before = snapshot(pg_dsn, schema)
    both = replay_db(pg_dsn, schema, "tests.apps.replay_v2")
    assert both.returncode == 4, both.stdout + both.stderr
    assert "would wait for ever" in line_of(both.stdout, live)
    assert line_of(both.stdout, live).startswith("FAIL")
    assert snapshot(pg_dsn, schema) == before


def test_exported_histories_replay_without_a_database(
        pg_dsn: str, schema: str, recorded: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "histories.jsonl"
    before = snapshot(pg_dsn, schema)
    ex = cli("export-histories", "--dsn", pg_dsn, "--schema", schema, "--workflow",
             "replay_app.flow", "--out", str(out))
    assert ex.returncode == 0, ex.stderr
    assert "wrote 2 histories" in ex.stderr
    assert snapshot(pg_dsn, schema) == before
    assert len(out.read_text().splitlines()) == 2

    # No database: any attempt to connect would fail on the unreachable DSN.
    same = cli("replay", "--app", "tests.apps.replay_v1", "--dsn", UNREACHABLE, "--from",
               str(out))
    assert same.returncode == 0, same.stdout + same.stderr
    assert "same path (3 checkpoints replayed" in line_of(same.stdout, recorded["done"])
    renamed = cli("replay", "--app", "tests.apps.replay_v3", "--dsn", UNREACHABLE, "--from",
                  str(out))
    assert renamed.returncode == 4, renamed.stdout + renamed.stderr
    assert ("diverges at step 2 (recorded `replay_app.b`, code calls `replay_app.c`)"
            in line_of(renamed.stdout, recorded["done"]))
    assert "same path" in line_of(renamed.stdout, recorded["parked"])
    one = cli("replay", "--app", "tests.apps.replay_v2", "--from", str(out), "--id",
              str(recorded["done"]), "--json")
    assert one.returncode == 0, one.stderr
    assert '"outcome": "new_path"' in one.stdout and '"audit"' in one.stdout

    # A pipe: export to stdout, replay from stdin.
    piped = cli("export-histories", "--dsn", pg_dsn, "--schema", schema, "--id",
                str(recorded["done"]), "--id", str(recorded["done"]), "--out", "-")
    assert piped.returncode == 0, piped.stderr
    assert len(piped.stdout.splitlines()) == 1  # the same --id twice is one execution
    again = cli("replay", "--app", "tests.apps.replay_v3", "--dsn", UNREACHABLE, "--from",
                "-", stdin=piped.stdout)
    assert again.returncode == 4, again.stdout + again.stderr
    assert "diverges at step 2" in line_of(again.stdout, recorded["done"])


def test_testing_replay_raises_a_readable_error_on_divergence(
        pg_dsn: str, schema: str, recorded: dict[str, Any], tmp_path: Path) -> None:
    done = recorded["done"]
    before = snapshot(pg_dsn, schema)
    with pytest.raises(ReplayFailed) as caught:
        replay(dsn=pg_dsn, schema=schema, workflows={"replay_app.flow": replay_flows.flow_v3},
               workflow="replay_app.flow")
    message = str(caught.value)
    assert f"FAIL {done}  replay_app.flow (completed): diverges at step 2 (recorded " \
           "`replay_app.b`, code calls `replay_app.c`)" in message
    assert str(recorded["parked"]) not in message  # only what breaks is listed
    assert snapshot(pg_dsn, schema) == before

    results = replay(dsn=pg_dsn, schema=schema,
                     workflows={"replay_app.flow": replay_flows.flow_v2}, ids=[done])
    assert [(r.outcome, r.patches, r.position) for r in results] == [
        ("new_path", ("audit",), 3)]

    # From a file: the same answers, and a reorder is caught at the first position.
    out = tmp_path / "h.jsonl"
    assert cli("export-histories", "--dsn", pg_dsn, "--schema", schema,
               "--out", str(out)).returncode == 0

    async def reordered(ctx: Any, n: int) -> int:
        got = await ctx.wait_for_signal("go")
        return await ctx.step(replay_flows.step_a, n + (got.payload or 0))

    results = replay(out, {"replay_app.flow": reordered, "replay_app.gone": replay_flows.gone},
                     check=False)
    by_id = {r.id: r for r in results}
    assert {r.id for r in results} == set(recorded.values())
    for eid in (done, recorded["parked"]):
        r = by_id[eid]
        assert (r.outcome, r.position, r.recorded, r.called) == (
            "diverges", 0, "replay_app.a", "kestrel.signal:go")
    assert by_id[recorded["gone"]].outcome == "same"

    async def sleeps_instead(ctx: Any, n: int) -> int:
        a = await ctx.step(replay_flows.step_a, n)
        await ctx.sleep(60)  # where the parked execution waits for the signal go
        return await ctx.step(replay_flows.step_b, a)

    (r,) = replay(out, {"replay_app.flow": sleeps_instead}, ids=[recorded["parked"]],
                  check=False)
    assert (r.outcome, r.position, r.recorded, r.called) == (
        "diverges", 1, "kestrel.signal:go", "kestrel.sleep")
    with pytest.raises(ExecutionNotFound):
        replay(out, {"replay_app.flow": replay_flows.flow_v1}, ids=[uuid.uuid4()])


# -- hostile input at the door ---------------------------------------------------------------

HISTORY = ('{"format": "kestrel-history/1", "id": "%s", "workflow": "replay_app.flow", '
           '"status": "completed", "args": [1], "steps": [[0, "replay_app.a", 2, null]]}')

BAD_FILES: dict[str, bytes] = {
    "garbage": b"this is not json\n",
    "nul": b'{"format": "kestrel-history/1",\x00 "id": 1}\n',
    "nul-in-name": (HISTORY % uuid.uuid4()).replace("replay_app.flow", "re\\u0000play")
    .encode() + b"\n",
    "huge": b'{"format": "' + b"x" * 300_000 + b'"}\n',
    "deep": b"[" * 200_000 + b"]" * 200_000 + b"\n",
    "deep-object": b'{"a":' * 5000 + b"1" + b"}" * 5000 + b"\n",
    "not-a-history": b'{"format": "kestrel-history/1", "id": "x"}\n',
    "wrong-format": b'{"format": "something-else"}\n',
    "array": b"[1, 2, 3]\n",
    "bad-steps": (HISTORY % uuid.uuid4()).replace('[[0, "replay_app.a", 2, null]]',
                                                 '[[0, "replay_app.a"]]').encode() + b"\n",
    "twice": (HISTORY % uuid.uuid4()).replace('[[0, "replay_app.a", 2, null]]',
                                             '[[0, "a", 2, null], [0, "a", 2, null]]')
    .encode() + b"\n",
    "bad-status": (HISTORY % uuid.uuid4()).replace('"completed"', '"done"').encode() + b"\n",
    "invalid-utf8": b'{"format": "\xff\xfe"}\n',
    "huge-number": (HISTORY % uuid.uuid4()).replace('"args": [1]', '"args": [1e400]')
    .encode() + b"\n",
}


@pytest.mark.parametrize("kind", sorted(BAD_FILES))
def test_a_bad_histories_file_is_one_typed_line(kind: str, tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    good = (HISTORY % uuid.uuid4()).encode() + b"\n"
    path.write_bytes(good + BAD_FILES[kind])
    got = cli("replay", "--app", "tests.apps.replay_v1", "--dsn", UNREACHABLE,
              "--max-history-bytes", "100000", "--max-payload-bytes", "100000",
              "--from", str(path))
    assert got.returncode == 1, got.stdout + got.stderr
    assert "Traceback" not in got.stderr
    lines = got.stderr.strip().splitlines()
    assert len(lines) == 1, got.stderr
    assert lines[0].startswith(f"kestrel-runtime replay: {path} line 2: "), lines[0]
    with pytest.raises(HistoryFileError, match="line 2"):
        replay(path, {"replay_app.flow": replay_flows.flow_v1},
               max_history_bytes=100_000)


def test_bad_selections_are_one_typed_line_and_write_nothing(
        pg_dsn: str, schema: str, recorded: dict[str, Any], tmp_path: Path) -> None:
    before = snapshot(pg_dsn, schema)
    missing = uuid.uuid4()
    cases = {
        ("--id", "not-a-uuid"): "'not-a-uuid' is not an execution id",
        ("--id", str(missing)): f"no execution {missing} in schema {schema}",
        ("--limit", "0"): "--limit 0: must be 1-100000",
        ("--status", "bogus"): "--status 'bogus': must be one of",
        ("--since", "yesterday-ish"): "--since 'yesterday-ish'",
        ("--from", str(tmp_path / "absent.jsonl")): "cannot read it",
        ("--timeout", "0"): "--timeout 0",
    }
    for args, expected in cases.items():
        got = replay_db(pg_dsn, schema, "tests.apps.replay_v1", *args)
        assert got.returncode == 1, (args, got.stdout, got.stderr)
        assert "Traceback" not in got.stderr
        assert len(got.stderr.strip().splitlines()) == 1, got.stderr
        assert expected in got.stderr, (args, got.stderr)
    nothing = replay_db(pg_dsn, schema, "tests.apps.replay_v1", "--workflow", "no.such")
    assert nothing.returncode == 0
    assert "replayed 0 executions" in nothing.stdout
    no_app = cli("replay", "--dsn", pg_dsn, "--schema", schema)
    assert no_app.returncode == 1 and "--app" in no_app.stderr
    assert snapshot(pg_dsn, schema) == before


@pytest.fixture
def read_only_role(direct_dsn: str, schema: str) -> Iterator[str]:
    """A login role that may only read *schema* (USAGE, SELECT): its DSN."""
    from urllib.parse import urlsplit, urlunsplit

    role = f"kestrel_ro_{uuid.uuid4().hex[:8]}"
    r, s = pgsql.Identifier(role), pgsql.Identifier(schema)
    with psycopg.connect(direct_dsn, autocommit=True) as conn:
        conn.execute(pgsql.SQL("CREATE ROLE {} LOGIN").format(r))
        conn.execute(pgsql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(s, r))
        conn.execute(pgsql.SQL("GRANT SELECT ON ALL TABLES IN SCHEMA {} TO {}").format(s, r))
    parts = urlsplit(direct_dsn)
    yield urlunsplit(parts._replace(netloc=f"{role}@{parts.netloc.rsplit('@', 1)[-1]}"))
    with psycopg.connect(direct_dsn, autocommit=True) as conn:
        conn.execute(pgsql.SQL("DROP OWNED BY {}").format(r))
        conn.execute(pgsql.SQL("DROP ROLE {}").format(r))


def test_a_role_that_may_only_read_can_export_and_replay(
        schema: str, recorded: dict[str, Any], read_only_role: str, tmp_path: Path) -> None:
    """What the manual's CI recipe asks for (docs/tutorials/deploying.md): export and
    replay as a role with SELECT only."""
    out = tmp_path / "h.jsonl"
    ex = cli("export-histories", "--dsn", read_only_role, "--schema", schema,
             "--out", str(out))
    assert ex.returncode == 0, ex.stderr
    assert "wrote 3 histories" in ex.stderr
    got = replay_db(read_only_role, schema, "tests.apps.replay_v3", "--workflow",
                    "replay_app.flow")
    assert got.returncode == 4, got.stdout + got.stderr
    assert "diverges at step 2" in line_of(got.stdout, recorded["done"])

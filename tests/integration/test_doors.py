"""Every door takes hostile input and keeps one set of rules (bug 17, FAULTS P2); children
cannot outlive a cancel and retry replays deterministically (FAULTS X7).

The doors: the SQL functions called directly, the Python client (sync and async) and the
CLI as a subprocess. On refusal every test counts rows: nothing may have been written.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import orjson
import psycopg
import pytest
from psycopg import sql as pgsql

import kestrel
from kestrel import codec, db, statements
from kestrel.client import Client, SyncClient
from kestrel.config import QUEUE_NAME
from kestrel.sql import queries
from tests.apps import doors_app
from tests.helpers import ROOT, config, q, q1, run_worker_until, wait_until

MIB16 = 16 * 1024 * 1024
SQL_LOOKING = ["'); DROP TABLE x; --", "$$ $tag$ \\ $1", 'say "hi"\nand\r\n\ttab',
               "ünï 😀 -- /* */ ;"]
# Nothing listens there: a client that reached the database would fail with
# OperationalError, so a typed error proves the refusal came before any round trip.
NOWHERE = "postgresql://kestrel@127.0.0.1:1/nowhere?connect_timeout=1"


def written(dsn: str, schema: str) -> tuple[int, ...]:
    """Rows in every table a door can write to."""
    row = q(dsn, schema, """
        SELECT (SELECT count(*) FROM {s}.workflow_executions),
               (SELECT count(*) FROM {s}.workflow_history),
               (SELECT count(*) FROM {s}.signals),
               (SELECT count(*) FROM {s}.idempotency_keys),
               (SELECT coalesce(sum(signal_seq), 0) FROM {s}.workflow_executions)""")[0]
    return tuple(int(v) for v in row)


def sql_refusal(dsn: str, schema: str, text: str, params: Any = None) -> psycopg.Error:
    with pytest.raises(psycopg.Error) as info:
        q(dsn, schema, text, params)
    return info.value


def deep(levels: int, *, obj: bool = False) -> Any:
    """A value nested *levels* deep (arrays, or objects), the outermost counted."""
    value: Any = {} if obj else []
    for _ in range(levels - 1):
        value = {"a": value} if obj else [value]
    return value


# -- one rule for queue names and for names and keys -----------------------------------------

QUEUE_NAMES = ["default", "a", "A-Z_0.9:x", "x" * 128, "x" * 129, "", " ", "bad queue",
               "q\n", "\nq", "é", "q/1", "q;", "ｑ", "١", "K", *SQL_LOOKING]


def test_queue_rule_is_the_clients_in_sql(pg_dsn: str, schema: str) -> None:
    """Bug 17: the SQL function accepted a queue name the client refuses."""
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    accepted = 0
    for name in QUEUE_NAMES:
        ok = QUEUE_NAME.fullmatch(name) is not None
        if ok:
            q(pg_dsn, schema, "SELECT {s}.submit('wf', '[]', %s)", [name])
            client.submit("wf", queue=name)
            accepted += 2
        else:
            err = sql_refusal(pg_dsn, schema, "SELECT {s}.submit('wf', '[]', %s)", [name])
            assert err.sqlstate == "KS002" and "queue name" in str(err), name
            with pytest.raises(kestrel.ConfigError):
                client.submit("wf", queue=name)
        assert written(pg_dsn, schema)[0] == accepted, name
    assert sql_refusal(pg_dsn, schema, "SELECT {s}.submit('wf', '[]', NULL)").sqlstate == "KS002"


NAMES = ["w", "x" * 1024, "x" * 1025, "é" * 1024, "😀" * 512, "😀" * 513, "", *SQL_LOOKING]


def door_calls(field: str, name: str, client: SyncClient, target: object,
               ) -> tuple[str, list[Any], Callable[[], object]]:
    """The SQL call and the client call that pass *name* as *field*."""
    return {
        "workflow": ("SELECT {s}.submit(%s)", [name], lambda: client.submit(name)),
        "idempotency_key": ("SELECT {s}.submit('wf', '[]', p_idempotency_key => %s)", [name],
                            lambda: client.submit("wf", idempotency_key=name)),
        "dedup_key": ("SELECT {s}.submit('wf', '[]', p_dedup_key => %s)", [name],
                      lambda: client.submit("wf", queue="other", dedup_key=name)),
        "signal": ("SELECT {s}.signal(%s, %s)", [target, name],
                   lambda: client.signal(str(target), name)),
        "signal_key": ("SELECT {s}.signal(%s, 's', 'null', %s)", [target, name],
                       lambda: client.signal(str(target), "s", idempotency_key=name)),
    }[field]


@pytest.mark.parametrize("field", ["workflow", "idempotency_key", "dedup_key", "signal",
                                   "signal_key"])
def test_name_and_key_rules_are_one_rule(pg_dsn: str, schema: str, field: str) -> None:
    """codec.check_text and the SQL functions accept exactly the same names and keys."""
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    target = client.submit("target", queue="nobody").id
    for name in NAMES:
        try:
            codec.check_text(name, what=field)
            ok = True
        except kestrel.SerializationError:
            ok = False
        before = written(pg_dsn, schema)
        text, params, via_client = door_calls(field, name, client, target)
        if ok:
            q(pg_dsn, schema, text, params)
            via_client()
            assert written(pg_dsn, schema) != before, name
        else:
            err = sql_refusal(pg_dsn, schema, text, params)
            assert err.sqlstate == "KS007", (name, err)
            with pytest.raises(kestrel.SerializationError):
                via_client()
            assert written(pg_dsn, schema) == before, name
    if field == "workflow":  # stored verbatim, hostile or not
        stored = {r[0] for r in q(pg_dsn, schema, "SELECT workflow FROM {s}.workflow_executions")}
        assert set(SQL_LOOKING) <= stored


def test_sql_submit_refuses_args_over_the_clients_cap(pg_dsn: str, schema: str) -> None:
    """Bug 17: a 20 MB argument went in through SQL, over the client's 16 MiB cap."""
    err = sql_refusal(pg_dsn, schema, "SELECT {s}.submit('wf', jsonb_build_array(%s::text))",
                      ["x" * 20_000_000])
    assert err.sqlstate == "KS008" and "16777216" in str(err)
    # The cap itself is allowed, one byte more is not (jsonb text of ["xxx…"]).
    over = '["' + "x" * (MIB16 - 3) + '"]'
    err = sql_refusal(pg_dsn, schema, "SELECT {s}.submit('wf', %s::jsonb)", [over])
    assert err.sqlstate == "KS008"
    with pytest.raises(kestrel.PayloadTooLarge):
        SyncClient(NOWHERE, schema=schema, pool_size=0).submit("wf", "x" * MIB16)
    assert written(pg_dsn, schema) == (0, 0, 0, 0, 0)
    q(pg_dsn, schema, "SELECT {s}.submit('wf', %s::jsonb)", ['["' + "x" * (MIB16 - 4) + '"]'])
    assert written(pg_dsn, schema)[0] == 1


def test_oversized_signal_payload_is_refused_in_sql(pg_dsn: str, schema: str) -> None:
    target = q1(pg_dsn, schema, "SELECT {s}.submit('wf', '[]', 'nobody')")
    before = written(pg_dsn, schema)
    err = sql_refusal(pg_dsn, schema, "SELECT {s}.signal(%s, 's', jsonb_build_array(%s::text))",
                      [target, "x" * (MIB16 + 1)])
    assert err.sqlstate == "KS008" and "payload" in str(err)
    assert written(pg_dsn, schema) == before


# -- numbers and depth the runtime could not read back (FAULTS P2) ---------------------------

NUMBERS = {  # JSON text: does orjson read back the same number?
    "1": True, "-0": True, "1.0": True, "0.1": True, "1e20": True, "1E2": True,
    "123.4560": True, "5e-324": True, "2.5e-310": True, "1.7976931348623157e308": True,
    "18446744073709551615": True, "-9223372036854775808": True, "6.02214076e23": True,
    "1e400": False, "-1e400": False, "1e-400": False, "1.7976931348623159e308": False,
    "18446744073709551616": False, "-9223372036854775809": False,
    str(2**70): False, str(-(2**70)): False, "0.12345678901234567890": False,
    "100000000000000000001": False, "2e-324": False,
    # Issue 26: a point makes it a float64 (9007199254740993.0 read as ...992.0); 2^64's
    # float64 in its shortest form is exact, 2^64 itself is not.
    "9007199254740993.0": False, "1.0000000000000000000001": False,
    "18446744073709552000": True, "1e23": True, "6.27448e21": True,
}


def reads_back(number_text: str) -> bool:
    """The oracle: orjson decodes the stored number and encodes the same number again."""
    try:
        value = orjson.loads(number_text)
    except orjson.JSONDecodeError:
        return False
    return Decimal(orjson.dumps(value).decode()) == Decimal(number_text)


def test_sql_submit_refuses_numbers_the_runtime_cannot_read_back(
    pg_dsn: str, schema: str
) -> None:
    """FAULTS P2: '[1e400]' and 2**70 were valid jsonb the runtime could not decode, or
    decoded to another number."""
    accepted = 0
    for text, expected in NUMBERS.items():
        stored = q1(pg_dsn, schema, "SELECT (%s::jsonb)::text", [text])
        assert reads_back(stored) is expected, text  # the table is right
        for args in (f"[{text}]", f'[{{"deep": [[{text}]]}}, "x"]'):
            if expected:
                eid = q1(pg_dsn, schema, "SELECT {s}.submit('wf', %s::jsonb)", [args])
                raw = q1(pg_dsn, schema, "SELECT args::text FROM {s}.workflow_executions "
                         "WHERE id = %s", [eid])
                got = codec.decode_exact(raw)  # what a worker does with it
                number = got[0] if args.startswith(f"[{text}") else got[0]["deep"][0][0]
                assert Decimal(json.dumps(number)) == Decimal(text), text  # the same number
                accepted += 1
            else:
                err = sql_refusal(pg_dsn, schema, "SELECT {s}.submit('wf', %s::jsonb)", [args])
                assert err.sqlstate == "KS007" and "number" in str(err), text
            assert written(pg_dsn, schema)[0] == accepted
    target = q1(pg_dsn, schema, "SELECT {s}.submit('wf', '[]', 'nobody')")
    before = written(pg_dsn, schema)
    err = sql_refusal(pg_dsn, schema, "SELECT {s}.signal(%s, 's', '[1e400]')", [target])
    assert err.sqlstate == "KS007"
    assert written(pg_dsn, schema) == before


def test_number_rule_is_exactly_the_orjson_round_trip(pg_dsn: str, schema: str) -> None:
    """A seeded sample of numbers of every shape: the SQL rule agrees with the oracle."""
    rng = random.Random(17)
    texts = []
    for _ in range(600):
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 25)))
        digits = digits.lstrip("0") or "0"
        point = rng.randint(0, len(digits))
        mantissa = digits[:point] + ("." + digits[point:] if point < len(digits) else "")
        if mantissa.startswith("."):
            mantissa = "0" + mantissa
        exponent = rng.choice(["", "", f"e{rng.randint(-330, 330)}", f"e{rng.randint(-5, 25)}"])
        texts.append(rng.choice(["", "-"]) + mantissa + exponent)
    texts += [repr(rng.uniform(-1e300, 1e300)) for _ in range(100)]
    texts += [str(rng.randint(-(2**66), 2**66)) for _ in range(100)]
    rows = q(pg_dsn, schema, "SELECT (v ->> 0), {s}.undecodable_number(v) IS NULL "
             "FROM unnest(%s::jsonb[]) AS v", [[f"[{t}]" for t in texts]])
    disagree = [(stored, ok) for stored, ok in rows if reads_back(stored) is not ok]
    assert not disagree
    assert {ok for _, ok in rows} == {True, False}  # the sample has both kinds


@pytest.mark.parametrize("obj", [False, True])
def test_depth_rule_is_the_codecs(pg_dsn: str, schema: str, obj: bool) -> None:
    """Args nested deeper than codec.encode (orjson) can write are refused in SQL too."""
    accepted = 0
    for levels in (253, 254, 255, 300, 10_000):
        args = [deep(levels - 1, obj=obj)]  # the args array is the outermost level
        text = ("[" + '{"a": ' * (levels - 2) + "{}" + "}" * (levels - 2) + "]" if obj
                else "[" * levels + "]" * levels)
        try:
            ok = codec.encode(args, what="args") == text.replace(" ", "")
        except kestrel.SerializationError:
            ok = False
        assert ok is (levels <= 254)
        if ok:
            q(pg_dsn, schema, "SELECT {s}.submit('wf', %s::jsonb)", [text])
            accepted += 1
        else:
            err = sql_refusal(pg_dsn, schema, "SELECT {s}.submit('wf', %s::jsonb)", [text])
            assert err.sqlstate == "KS007" and "254 levels" in str(err), levels
        assert written(pg_dsn, schema)[0] == accepted


# -- the Python client: refused before any round trip ---------------------------------------

BAD_SUBMITS: list[tuple[str, dict[str, Any], type[Exception]]] = [
    ("nul\x00name", {}, kestrel.SerializationError),
    ("lone\ud800", {}, kestrel.SerializationError),
    ("", {}, kestrel.SerializationError),
    ("x" * 1025, {}, kestrel.SerializationError),
    ("wf", {"queue": "q\x00"}, kestrel.ConfigError),
    ("wf", {"queue": "bad queue"}, kestrel.ConfigError),
    ("wf", {"idempotency_key": "k\x00"}, kestrel.SerializationError),
    ("wf", {"idempotency_key": "k\udc80"}, kestrel.SerializationError),
    ("wf", {"dedup_key": "d\x00"}, kestrel.SerializationError),
    ("wf", {"priority": 2**31}, kestrel.ConfigError),
    ("wf", {"timeout": float("inf")}, kestrel.ConfigError),
    ("wf", {"delay": float("nan")}, kestrel.ConfigError),
    ("wf", {"args": ("a\x00b",)}, kestrel.SerializationError),
    ("wf", {"args": ("\ud800",)}, kestrel.SerializationError),
    ("wf", {"args": (2**70,)}, kestrel.SerializationError),
    ("wf", {"args": (float("inf"),)}, kestrel.SerializationError),
    ("wf", {"args": (deep(300),)}, kestrel.SerializationError),
    ("wf", {"args": ("x" * MIB16,)}, kestrel.PayloadTooLarge),
]


@pytest.mark.parametrize(("name", "kw", "error"), BAD_SUBMITS,
                         ids=[f"{i}-{e.__name__}" for i, (_, _, e) in enumerate(BAD_SUBMITS)])
def test_client_refuses_before_any_round_trip(
    name: str, kw: dict[str, Any], error: type[Exception]
) -> None:
    kw = dict(kw)
    args = kw.pop("args", ())
    with pytest.raises(error):
        SyncClient(NOWHERE, pool_size=0).submit(name, *args, **kw)
    with pytest.raises(error):
        asyncio.run(Client(NOWHERE, pool_size=0).submit(name, *args, **kw))


@pytest.mark.parametrize(("name", "payload", "key"), [
    ("nul\x00", None, None), ("\udfff", None, None), ("", None, None), ("s", None, "k\x00"),
    ("s", ["\x00"], None), ("s", [1e400], None), ("s", deep(300), None),
])
def test_client_signal_refuses_before_any_round_trip(name: str, payload: Any,
                                                     key: str | None) -> None:
    eid = uuid.uuid4()
    with pytest.raises(kestrel.SerializationError):
        SyncClient(NOWHERE, pool_size=0).signal(eid, name, payload, idempotency_key=key)
    with pytest.raises(kestrel.SerializationError):
        asyncio.run(Client(NOWHERE, pool_size=0).signal(eid, name, payload,
                                                        idempotency_key=key))


def test_hostile_text_round_trips_at_every_door(pg_dsn: str, schema: str) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    aclient = Client(pg_dsn, schema=schema, pool_size=0)
    for text in SQL_LOOKING:
        ids = [
            q1(pg_dsn, schema, "SELECT {s}.submit(%s, jsonb_build_array(%s::text), "
               "p_idempotency_key => %s::text || '.sql', p_dedup_key => %s)", [text] * 4),
            client.submit(text, text, idempotency_key=text + ".sync", dedup_key=text,
                          queue="sync").id,
            asyncio.run(aclient.submit(text, text, idempotency_key=text + ".async",
                                       dedup_key=text, queue="async")).id,
        ]
        for eid in ids:
            ex = client.get(eid)
            assert (ex.workflow, ex.args) == (text, [text])
            q(pg_dsn, schema, "SELECT {s}.signal(%s, %s, jsonb_build_array(%s::text))",
              [eid, text, text])
            assert client.signal(eid, text, text, idempotency_key=text)
            assert asyncio.run(aclient.signal(eid, text, [text]))
        assert {r[0] for r in q(pg_dsn, schema, "SELECT name FROM {s}.signals")} == {text}
        assert {k for (k,) in q(pg_dsn, schema, "SELECT idempotency_key FROM "
                                "{s}.idempotency_keys")} >= {text + ".sql", text + ".sync"}
        q(pg_dsn, schema, "DELETE FROM {s}.signals")


def test_unknown_names_wait_and_unknown_ids_are_typed(pg_dsn: str, schema: str) -> None:
    """An unknown workflow name is legal (it waits for a worker that knows it, FAULTS P4);
    a signal to an unknown execution is a typed error that writes nothing."""
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    h = client.submit("no.such.workflow", 1)
    assert client.get(h.id).status is kestrel.Status.QUEUED
    before = written(pg_dsn, schema)
    with pytest.raises(kestrel.ExecutionNotFound):
        client.signal(uuid.uuid4(), "s")
    err = sql_refusal(pg_dsn, schema, "SELECT {s}.signal(%s, 's')", [uuid.uuid4()])
    assert err.sqlstate == "KS003"
    assert written(pg_dsn, schema) == before


# -- the CLI as a subprocess ------------------------------------------------------------------

def run_cli(pg_dsn: str, schema: str, *args: str | bytes) -> subprocess.CompletedProcess[str]:
    cmd: list[str | bytes] = [sys.executable, "-m", "kestrel", *args, "--dsn", pg_dsn,
                              "--schema", schema, "--log-level", "error"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join((str(ROOT / "src"), str(ROOT))))
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True,
                          errors="backslashreplace", timeout=120)


def test_cli_refuses_hostile_input_in_one_line(pg_dsn: str, schema: str) -> None:
    target = str(q1(pg_dsn, schema, "SELECT {s}.submit('target', '[]', 'nobody')"))
    before = written(pg_dsn, schema)
    cases: list[list[str | bytes]] = [
        ["submit", b"wf\xff"],                                  # a lone surrogate
        ["submit", "wf", "--queue", "bad queue"],
        ["submit", "wf", "--queue", "x" * 129],
        ["submit", "wf", "--args", '["a\\u0000b"]'],
        ["submit", "wf", "--args", '["\\ud800"]'],
        ["submit", "wf", "--args", "[1e400]"],
        ["submit", "wf", "--args", f"[{2**70}]"],
        ["submit", "wf", "--args", json.dumps([deep(300)])],
        ["submit", "wf", "--args", json.dumps(["x" * 4096]), "--max-payload-bytes", "1024"],
        ["submit", "wf", "--idempotency-key", b"k\xfe"],
        ["submit", "x" * 1025],
        ["signal", target, b"s\xff"],
        ["signal", target, ""],
        ["signal", target, "s", "--payload", "[1e400]"],
        ["signal", target, "s", "--idempotency-key", b"\xff"],
        ["signal", str(uuid.uuid4()), "s"],
    ]
    for case in cases:
        done = run_cli(pg_dsn, schema, *case)
        lines = done.stderr.strip().splitlines()
        assert done.returncode != 0, (case, done.stdout)
        assert len(lines) == 1 and "Traceback" not in done.stderr, (case, done.stderr)
        assert lines[0].startswith("kestrel-runtime "), (case, done.stderr)
        assert written(pg_dsn, schema) == before, case
    for text in SQL_LOOKING:
        done = run_cli(pg_dsn, schema, "submit", text, "--args", json.dumps([text]),
                       "--queue", "cli", "--idempotency-key", text, "--json")
        assert done.returncode == 0, done.stderr
        eid = json.loads(done.stdout)["id"]
        assert q(pg_dsn, schema, "SELECT workflow, args, idempotency_key FROM "
                 "{s}.workflow_executions WHERE id = %s", [eid]) == [(text, [text], text)]
        done = run_cli(pg_dsn, schema, "signal", eid, text, "--payload", json.dumps(text))
        assert done.returncode == 0, done.stderr
        assert q(pg_dsn, schema, "SELECT name, payload FROM {s}.signals "
                 "WHERE execution_id = %s", [eid]) == [(text, text)]


# -- X7: no child started concurrently with a cancel survives it ------------------------------

SURVIVORS = """
    SELECT count(*) FROM {s}.workflow_executions AS c
     WHERE c.parent_id IS NOT NULL AND NOT c.cancel_requested
       AND (EXISTS (SELECT 1 FROM {s}.workflow_history AS h
                     WHERE h.id = c.parent_id AND h.status = 'cancelled')
            OR EXISTS (SELECT 1 FROM {s}.workflow_executions AS p
                        WHERE p.id = c.parent_id AND p.cancel_requested))"""


def new_execution(dsn: str, schema: str, state: str, parent: Any = None) -> Any:
    eid = q1(dsn, schema, "SELECT {s}.submit('node', '[]', 'nobody', p_parent => %s)",
             [parent])
    if state == "running":  # as a worker's claim leaves it
        q(dsn, schema, "UPDATE {s}.workflow_executions SET status = 'running', "
          "lease_epoch = 1, attempts = 1, lease_owner = 'test', "
          "lease_expires_at = now() + interval '1 hour' WHERE id = %s", [eid])
    return eid


def blocked_or_done(dsn: str, schema: str, done: threading.Event) -> bool:
    """Wait until the other connection waits for a row lock, or has finished (the old
    code never waited). Found by its text (its statement names *schema*), not by backend
    pid: behind PgBouncer the pid a client sees is not the server's."""
    def check() -> bool:
        if done.is_set():
            return True
        with psycopg.connect(dsn, autocommit=True, prepare_threshold=None) as conn:
            row = conn.execute("SELECT count(*) FROM pg_stat_activity "
                               "WHERE wait_event_type = 'Lock' AND query LIKE %s",
                               [f"%{schema}%"]).fetchone()
        return row is not None and row[0] > 0
    return bool(wait_until(check, timeout=30, what="the other transaction to block"))


def in_thread(dsn: str, schema: str, text: str, params: list[Any],
              ) -> tuple[threading.Thread, threading.Event, list[Any]]:
    """Run *text* on its own autocommit connection in a thread; return what it got."""
    done = threading.Event()
    got: list[Any] = []

    def run() -> None:
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:
                stmt = pgsql.SQL(text).format(s=pgsql.Identifier(schema))  # type: ignore[arg-type]
                got.append(conn.execute(stmt, params).fetchone())
        except psycopg.Error as exc:
            got.append(exc)
        finally:
            done.set()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, done, got


@pytest.mark.parametrize("parent_state", ["queued", "running"])
def test_child_submitted_while_cancel_runs_is_cancelled_too(
    pg_dsn: str, schema: str, parent_state: str
) -> None:
    """The child's transaction commits while cancel() waits: cancel must see it."""
    parent = new_execution(pg_dsn, schema, parent_state)
    with psycopg.connect(pg_dsn) as tx:
        child = tx.execute(pgsql.SQL("SELECT {}.submit('child', '[]', 'nobody', "
                                     "p_parent => %s)").format(pgsql.Identifier(schema)),
                           [parent]).fetchone()
        thread, done, got = in_thread(pg_dsn, schema, "SELECT {s}.cancel(%s)", [parent])
        blocked_or_done(pg_dsn, schema, done)
        tx.commit()
    thread.join(30)
    assert child is not None and not isinstance(got[0], Exception), got
    assert q1(pg_dsn, schema, SURVIVORS) == 0
    assert q1(pg_dsn, schema, "SELECT status FROM {s}.workflow_history WHERE id = %s",
              [child[0]]) == "cancelled"


@pytest.mark.parametrize("parent_state", ["queued", "running"])
def test_child_submitted_against_an_open_cancel_is_refused(
    pg_dsn: str, schema: str, parent_state: str
) -> None:
    """cancel() commits while the child's submit waits: the submit must see the cancel."""
    parent = new_execution(pg_dsn, schema, parent_state)
    with psycopg.connect(pg_dsn) as tx:
        tx.execute(pgsql.SQL("SELECT {}.cancel(%s)").format(pgsql.Identifier(schema)),
                   [parent])
        thread, done, got = in_thread(
            pg_dsn, schema, "SELECT {s}.submit('child', '[]', 'nobody', p_parent => %s)",
            [parent])
        blocked_or_done(pg_dsn, schema, done)
        tx.commit()
    thread.join(30)
    assert q1(pg_dsn, schema, SURVIVORS) == 0
    assert isinstance(got[0], psycopg.Error) and got[0].sqlstate == "KS009", got
    # Submitting later is refused the same way, as the typed error through the client code.
    with psycopg.connect(pg_dsn, autocommit=True) as conn, \
            pytest.raises(kestrel.ParentCancelled):
        db.run_sync(conn, statements.value(queries(schema).submit, statements.client.submit_params(
            workflow="child", args="[]", queue="nobody", priority=0, idempotency_key=None,
            parent=parent)))
    assert q1(pg_dsn, schema, "SELECT count(*) FROM {s}.executions "
              "WHERE workflow = 'child'") == 0


def test_grandchild_submitted_while_cancel_runs_is_cancelled_too(
    pg_dsn: str, schema: str
) -> None:
    parent = new_execution(pg_dsn, schema, "running")
    child = new_execution(pg_dsn, schema, "running", parent)
    with psycopg.connect(pg_dsn) as tx:
        grandchild = tx.execute(pgsql.SQL("SELECT {}.submit('grandchild', '[]', 'nobody', "
                                          "p_parent => %s)").format(pgsql.Identifier(schema)),
                                [child]).fetchone()
        thread, done, got = in_thread(pg_dsn, schema, "SELECT {s}.cancel(%s)", [parent])
        blocked_or_done(pg_dsn, schema, done)
        tx.commit()
    thread.join(30)
    assert got == [("cancelling",)]
    assert q1(pg_dsn, schema, SURVIVORS) == 0
    assert grandchild is not None
    assert q1(pg_dsn, schema, "SELECT status FROM {s}.workflow_history WHERE id = %s",
              [grandchild[0]]) == "cancelled"


def test_children_of_finished_or_unknown_parents_are_refused(pg_dsn: str, schema: str) -> None:
    finished = new_execution(pg_dsn, schema, "queued")
    q(pg_dsn, schema, "UPDATE {s}.workflow_executions SET status = 'running' WHERE id = %s",
      [finished])
    q(pg_dsn, schema, "WITH d AS (DELETE FROM {s}.workflow_executions WHERE id = %s "
      "RETURNING *) INSERT INTO {s}.workflow_history (id, workflow, queue, priority, status, "
      "args, lease_epoch, attempts, created_at, finished_at) SELECT id, workflow, queue, "
      "priority, 'completed', args, lease_epoch, attempts, created_at, now() FROM d",
      [finished])
    before = written(pg_dsn, schema)
    for parent, state in ((finished, "KS004"), (uuid.uuid4(), "KS003")):
        err = sql_refusal(pg_dsn, schema, "SELECT {s}.submit('child', '[]', p_parent => %s)",
                          [parent])
        assert err.sqlstate == state and "parent" in str(err)
    assert written(pg_dsn, schema) == before


# -- X7: retry brings back only the checkpoints before the first failed step ----------------

def test_retry_drops_the_checkpoints_after_the_first_failed_step(
    pg_dsn: str, schema: str
) -> None:
    eid = q1(pg_dsn, schema, "SELECT {s}.submit('wf', '[]', 'nobody')")
    q(pg_dsn, schema, """
        INSERT INTO {s}.operation_outputs
               (execution_id, step_id, step_name, output, error, attempt, lease_epoch, started_at)
        SELECT %s, s, 'step' || s, CASE WHEN s = 2 THEN NULL ELSE to_jsonb(s) END,
               CASE WHEN s = 2 THEN '{{"type": "E", "message": "m"}}'::jsonb END, 1, 1, now()
          FROM generate_series(0, 4) AS s""", [eid])
    assert q1(pg_dsn, schema, "SELECT {s}.cancel(%s)", [eid]) == "cancelled"
    q(pg_dsn, schema, "UPDATE {s}.workflow_history SET status = 'failed' WHERE id = %s", [eid])
    q(pg_dsn, schema, "SELECT {s}.retry(%s)", [eid])
    assert q(pg_dsn, schema, "SELECT step_id, output FROM {s}.operation_outputs "
             "WHERE execution_id = %s ORDER BY step_id", [eid]) == [(0, 0), (1, 1)]
    assert q1(pg_dsn, schema, "SELECT count(*) FROM {s}.operation_outputs") == 2


def test_retry_after_a_caught_step_failure_replays_deterministically(
    pg_dsn: str, schema: str
) -> None:
    """The workflow caught StepFailed, ran a fallback step, then failed; the retry must
    not find the fallback's checkpoint where its first branch goes on."""
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    cfg = config(schema)
    doors_app.service["up"] = False
    h = client.submit(doors_app.branching)
    run_worker_until(pg_dsn, cfg, lambda: client.get(h.id).status.terminal)
    assert client.get(h.id).status is kestrel.Status.FAILED
    doors_app.service["up"] = True
    client.retry(h.id)
    run_worker_until(pg_dsn, cfg, lambda: client.get(h.id).status.terminal)
    ex = client.get(h.id)
    assert ex.status is kestrel.Status.COMPLETED, ex.error
    assert ex.result == "finished after served"


def test_retry_of_a_child_of_a_cancelled_parent_is_refused(pg_dsn: str, schema: str) -> None:
    parent = new_execution(pg_dsn, schema, "running")
    child = new_execution(pg_dsn, schema, "queued", parent)
    assert q1(pg_dsn, schema, "SELECT {s}.cancel(%s)", [parent]) == "cancelling"
    assert q1(pg_dsn, schema, "SELECT status FROM {s}.workflow_history WHERE id = %s",
              [child]) == "cancelled"
    before = written(pg_dsn, schema)
    with pytest.raises(kestrel.InvalidState) as info:
        SyncClient(pg_dsn, schema=schema, pool_size=0).retry(child)
    assert isinstance(info.value, kestrel.ParentCancelled)
    assert written(pg_dsn, schema) == before
    assert q1(pg_dsn, schema, SURVIVORS) == 0

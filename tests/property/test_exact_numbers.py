"""Exact numbers at every door (issue 26, finding 3): the same hostile numbers go in through
the Python client, SQL submit(), the CLI, HTTP submit and two webhooks (GitHub and HMAC),
against one real runtime (workers and the HTTP door) on PostgreSQL.

Each door either refuses a number before anything is written (a typed error: SQLSTATE KS007,
HTTP 400, SerializationError, a one-line CLI error) or the workflow receives exactly that
number. The text doors (SQL, CLI, HTTP, webhooks) hold one rule, so they all accept or all
refuse the same text. Before the fix the HTTP door answered 200 for 2^64 and 2^70 and the
execution then failed in the worker (UndecodableInput); 0.12345678901234567890, 1e-400 and
1.0000000000000000000001 reached the workflow rounded (0.0 for 1e-400); SQL accepted
9007199254740993.0, which the workflow received as 9007199254740992.0; the client stored
-0.0 as 0.0.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import random
import struct
import subprocess
import sys
import uuid
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from psycopg import sql as pgsql

import kestrel
from kestrel import codec
from kestrel.client import SyncClient
from tests.helpers import ROOT, q, q1, wait_until
from tests.http_helpers import Api, free_port, http_runtime, make_token

SECRET = "num-secret-" + uuid.uuid4().hex
CONFIG = """
[hooks.num-gh]
workflow = "http.number"
format = "github"
secret_env = "T_NUM_SECRET"

[hooks.num-hmac]
workflow = "http.number"
format = "hmac"
secret_env = "T_NUM_SECRET"
"""
WORKFLOW = "http.number"
TEXT_DOORS = ("sql", "http", "github", "hmac", "cli")


@pytest.fixture(scope="module")
def server(pg_dsn: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from kestrel.migrate import migrate

    schema = f"t_{uuid.uuid4().hex[:12]}"
    migrate(pg_dsn, schema)
    folder = tmp_path_factory.mktemp("numbers")
    config = folder / "kestrel.toml"
    config.write_text(CONFIG)
    with http_runtime(pg_dsn, schema, port=free_port(), log=folder / "rt.log", procs=2,
                      env={"T_NUM_SECRET": SECRET}, args=["--config", str(config)]) as api:
        api.token = make_token(pg_dsn, schema, "numbers", "submit")
        client = SyncClient(pg_dsn, schema=schema, pool_size=1)
        yield {"api": api, "schema": schema, "dsn": pg_dsn, "client": client}
        client.close()
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(pgsql.SQL("DROP SCHEMA {} CASCADE").format(pgsql.Identifier(schema)))


def _written(srv: dict[str, Any]) -> int:
    return int(q1(srv["dsn"], srv["schema"], "SELECT count(*) FROM {s}.executions"))


def _sign(body: bytes) -> str:
    return "sha256=" + hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()


def _door(srv: dict[str, Any], door: str, text: str) -> str | None:
    """Submit the JSON number *text* through *door*: the execution's id, or None when the
    door refused it (checked to be that door's typed refusal)."""
    api: Api = srv["api"]
    if door == "sql":
        try:
            return str(q1(srv["dsn"], srv["schema"], "SELECT {s}.submit(%s, %s::jsonb)",
                          [WORKFLOW, f"[{text}]"]))
        except psycopg.Error as exc:
            assert exc.sqlstate == "KS007" and "number" in str(exc), (text, exc)
            return None
    if door == "http":
        reply = api.post(f"/api/v1/workflows/{WORKFLOW}/submit", f'{{"args": [{text}]}}',
                         headers={"Content-Type": "application/json"})
    elif door == "github":
        # A delivery is known by its signed body (a replay under a new delivery id is the
        # same one): a nonce makes each example's a delivery of its own, as hmac's below.
        body = f'{{"n": {text}, "nonce": "{uuid.uuid4()}"}}'.encode()
        reply = api.post("/hooks/num-gh", body, token=None, headers={
            "X-Hub-Signature-256": _sign(body), "X-GitHub-Delivery": str(uuid.uuid4()),
            "X-GitHub-Event": "push", "Content-Type": "application/json"})
    elif door == "hmac":
        body = f'{{"n": {text}, "nonce": "{uuid.uuid4()}"}}'.encode()
        reply = api.post("/hooks/num-hmac", body, token=None, headers={
            "X-Signature-256": _sign(body), "Content-Type": "application/json"})
    else:
        assert door == "cli"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join((str(ROOT / "src"), str(ROOT))))
        out = subprocess.run(
            [sys.executable, "-m", "kestrel", "submit", WORKFLOW, "--args", f"[{text}]",
             "--dsn", srv["dsn"], "--schema", srv["schema"], "--json", "--log-level",
             "error"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
        if out.returncode == 0:
            return str(json.loads(out.stdout)["id"])
        assert out.returncode == 1 and "--args is not valid JSON" in out.stderr, (
            text, out.returncode, out.stderr)
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
        return None
    if reply.status == 400:
        assert "number" in reply.json()["error"], (door, text, reply.body)
        return None
    assert reply.status in (200, 201), (door, text, reply.status, reply.body)
    return str(reply.json()["id"])


def _received(srv: dict[str, Any], eid: str) -> dict[str, str]:
    """What the workflow was given: the repr and type of the number (it must complete)."""

    def done() -> Any:
        return q(srv["dsn"], srv["schema"],
                 "SELECT status, result, error FROM {s}.workflow_history WHERE id = %s", [eid])

    status, result, error = wait_until(done, timeout=60, what=f"{eid} finished")[0]
    assert status == "completed", (eid, status, error)
    return dict(result)


# Hostile numbers as JSON text: integers around the 64-bit bounds and past them, many-digit
# decimals, subnormals, values past a double's range, negative zero, exponent forms, and the
# shortest form of random doubles and of the points halfway between two doubles.
_BOUNDS = [2**53, 2**63, 2**64, 2**70, -(2**63), -(2**64)]
_halfway = st.floats(allow_nan=False, allow_infinity=False).map(
    lambda x: str((Decimal(x) + Decimal(math.nextafter(x, math.inf))) / 2)
    if math.isfinite(math.nextafter(x, math.inf)) else repr(x))
NUMBERS = st.one_of(
    st.sampled_from(_BOUNDS).flatmap(lambda b: st.integers(b - 3, b + 3)).map(str),
    st.integers(-(2**80), 2**80).map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.floats(allow_nan=False, allow_infinity=False).map(lambda x: f"{x:.25g}"),
    st.floats(min_value=-1e-300, max_value=1e-300).map(repr),
    _halfway,
    st.from_regex(r"-?(0|[1-9][0-9]{0,24})(\.[0-9]{1,25})?([eE][-+]?[0-9]{1,3})?",
                  fullmatch=True),
    st.sampled_from(["-0", "-0.0", "0.0", "1e400", "-1e400", "1e-400", "5e-324", "2e-324",
                     "1.7976931348623157e308", "1.7976931348623159e308", "1e23", "1E2"]),
)


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(text=NUMBERS)
@example(text=str(2**64))
@example(text=str(2**70))
@example(text="0.12345678901234567890")
@example(text="1e-400")
@example(text="1.0000000000000000000001")
@example(text="18446744073709552000")
@example(text="9007199254740993.0")
@example(text="1e400")
@example(text="-0.0")
@example(text="6.27448e21")
def test_every_door_refuses_before_writing_or_delivers_the_number_exactly(
        server: dict[str, Any], text: str) -> None:
    before = _written(server)
    ids = {door: _door(server, door, text) for door in TEXT_DOORS}
    accepted = {door for door, eid in ids.items() if eid is not None}
    assert accepted in (set(), set(TEXT_DOORS)), (text, accepted)  # one rule at every door
    assert _written(server) == before + len(accepted)  # a refusal wrote nothing
    for door in accepted:
        got = _received(server, str(ids[door]))
        assert Decimal(got["repr"]) == Decimal(text), (door, text, got)
    # The Python client passes the Python number the text reads as (Python's own parse).
    value = json.loads(text)
    before = _written(server)
    try:
        handle = server["client"].submit(WORKFLOW, value)
    except kestrel.SerializationError:
        assert _written(server) == before
        assert (isinstance(value, int) and not -(2**63) <= value < 2**64) or (
            isinstance(value, float) and (not math.isfinite(value) or (
                value == 0 and math.copysign(1.0, value) < 0))), text
        return
    got = _received(server, str(handle.id))
    assert Decimal(got["repr"]) == Decimal(repr(value)), (text, value, got)
    if isinstance(value, float) and value == 0:
        assert got["repr"] == repr(value), (text, got)  # the sign of a zero too


def test_the_rule_at_the_sql_door_is_the_decoders(server: dict[str, Any]) -> None:
    """SQL's number_reads_back and codec.decode_exact agree on thousands of numbers: random
    doubles (their shortest form, one digit more, and the points halfway to each neighbour),
    integers past 64 bits and random decimal strings."""
    rng = random.Random(26)
    texts = []
    for _ in range(1500):
        x = struct.unpack("<d", rng.getrandbits(64).to_bytes(8, "little"))[0]
        if not math.isfinite(x):
            continue
        texts += [repr(x), f"{x:.17g}"]
        for y in (math.nextafter(x, math.inf), math.nextafter(x, -math.inf)):
            if math.isfinite(y):
                texts.append(str((Decimal(x) + Decimal(y)) / 2))
    texts += [str(2**rng.randint(53, 80) + rng.randint(-2, 2)) for _ in range(200)]
    texts += [f"{rng.randint(1, 10**17)}.0" for _ in range(200)]
    rows = q(server["dsn"], server["schema"],
             "SELECT {s}.undecodable_number(v) IS NULL FROM unnest(%s::jsonb[]) AS v",
             [[f"[{t}]" for t in texts]])

    def decodes(text: str) -> bool:
        try:
            codec.decode_exact(f"[{text}]")
            return True
        except ValueError:
            return False

    disagree = [t for t, (ok,) in zip(texts, rows, strict=True) if ok is not decodes(t)]
    assert not disagree, disagree[:10]
    assert {ok for (ok,) in rows} == {True, False}


"""Checkpoints are written by a plain INSERT first, ON CONFLICT only when needed (issue 16).

``statements.steps.save_steps`` sends ``save_new_steps_batch`` (no speculative insertion, one
WAL record less per checkpoint); a batch holding a step that is already recorded (a retry
after a lost reply, FAULTS F3) fails whole with unique_violation and is sent again with
``ON CONFLICT DO NOTHING``. These tests hold the guarantees across that fallback: the first
committed output is returned, the batch's other checkpoints are recorded exactly once, and a
superseded epoch still writes nothing.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import orjson
import psycopg
import pytest

from kestrel import codec, connections, db, statements
from kestrel.client import SyncClient
from kestrel.sql import queries
from kestrel.types import StepWrite
from tests.apps import ledger_app as app
from tests.helpers import q


@pytest.fixture(params=[False, True], ids=["statement", "citus-form"])
def form(request: pytest.FixtureRequest) -> bool:
    """Each test runs on both forms of the checkpoint batch: the statement, and the call of
    save_steps() a Citus distributed schema gets (the same function runs here)."""
    return bool(request.param)


def save(qs: Any, form: bool, writes: Any) -> Any:
    return statements.steps.save_steps(qs, writes, delegated=form)

HOSTILE_NAMES = ["x'); DROP TABLE operation_outputs; --", "ünïcödé 🚀", "$$;--\n", "a" * 300]


def test_a_batch_with_a_recorded_step_keeps_it_and_records_the_rest(
    pg_dsn: str, schema: str, form: bool
) -> None:
    qs = queries(schema)
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    ids = [client.submit(app.three_steps, i).id for i in range(3)]

    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True,
                                                         prepare_threshold=None) as conn:
            connections.configure_connection(conn)
            claimed = await db.run(
                conn,
                statements.executions.claim_batch(
                    qs, owner="w", queues=["default"], limit=3, lease_s=30
                ),
            )
            epoch = {c.id: c.epoch for c in claimed}
            first = ids[0]
            (was,) = await db.run(
                conn,
                save(qs, form, [StepWrite(first, epoch[first], 0, "add", "10", None, 1, 0.0)]
                ),
            )
            # Written by this statement: it comes back without its value (the writer knows
            # it), on both statements; a position not written comes back with the row
            # recorded first.
            assert was.inserted and was.recorded is None
            # One batch: the recorded step again (a lost reply's retry, another output),
            # and new steps of every execution, with names that look like SQL.
            batch = [StepWrite(first, epoch[first], 0, "add", "77", None, 1, 0.0)]
            batch += [StepWrite(e, epoch[e], 1, HOSTILE_NAMES[i], f'{{"n": {i}}}', None, 1,
                                0.0) for i, e in enumerate(ids)]
            saved = await db.run(conn, save(qs, form, batch))
            assert saved[0].owned and not saved[0].inserted
            assert saved[0].recorded is not None and saved[0].recorded.output == 10
            for s in saved[1:]:
                assert s.owned and s.inserted and s.recorded is None
            for i, e in enumerate(ids):
                rec = await db.run(conn, statements.steps.load_step(qs, execution_id=e,
                                                                    step_id=1))
                assert rec is not None and rec.output == {"n": i}
                assert rec.name == HOSTILE_NAMES[i]
            # The same batch once more (every step now recorded): nothing changes.
            again = await db.run(conn, save(qs, form, batch))
            assert [s.inserted for s in again] == [False] * len(batch)
            assert [s.recorded.output for s in again if s.recorded] == [
                10, {"n": 0}, {"n": 1}, {"n": 2}]

    asyncio.run(main())
    rows = q(pg_dsn, schema, "SELECT execution_id, step_id, step_name, output "
             "FROM {s}.operation_outputs ORDER BY step_id, step_name")
    assert len(rows) == 4
    assert sorted((r[1], str(r[3])) for r in rows) == sorted(
        (k, str(v)) for k, v in [(0, 10), (1, {"n": 0}), (1, {"n": 1}), (1, {"n": 2})])
    assert {r[2] for r in rows if r[1] == 1} == set(HOSTILE_NAMES[:3])


def test_several_steps_of_one_execution_in_a_batch_are_written_by_the_plain_insert(
    pg_dsn: str, schema: str, form: bool
) -> None:
    """Parallel steps (ctx.gather) checkpoint in one batch: one row per step, and no fallback.
    The ownership lock once joined the batch, so an execution with two steps in it was
    counted twice, each step offered twice to the INSERT, and the plain statement always
    failed over to ON CONFLICT (a second round trip for every such batch)."""
    qs = queries(schema)
    h = SyncClient(pg_dsn, schema=schema, pool_size=0).submit(app.three_steps, 1)

    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True,
                                                         prepare_threshold=None) as conn:
            connections.configure_connection(conn)
            (c,) = await db.run(conn, statements.executions.claim_batch(
                qs, owner="w", queues=["default"], limit=1, lease_s=30))
            batch = [StepWrite(h.id, c.epoch, i, f"s{i}", str(i), None, 1, 0.0)
                     for i in range(3)]
            plain = dataclasses.replace(save(qs, form, batch),
                                        if_recorded=None)  # no fallback to hide behind
            saved = await db.run(conn, plain)
            assert [(s.owned, s.inserted, s.recorded) for s in saved] == [
                (True, True, None)] * 3

    asyncio.run(main())
    assert q(pg_dsn, schema, "SELECT step_id, output FROM {s}.operation_outputs "
             "ORDER BY step_id") == [(0, 0), (1, 1), (2, 2)]


def test_a_superseded_epoch_records_nothing_on_either_statement(
    pg_dsn: str, schema: str, form: bool
) -> None:
    qs = queries(schema)
    h = SyncClient(pg_dsn, schema=schema, pool_size=0).submit(app.three_steps, 1)

    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True,
                                                         prepare_threshold=None) as conn:
            connections.configure_connection(conn)
            (c,) = await db.run(
                conn,
                statements.executions.claim_batch(
                    qs, owner="w", queues=["default"], limit=1, lease_s=30
                ),
            )
            (ok,) = await db.run(
                conn,
                save(qs, form, [StepWrite(h.id, c.epoch, 0, "add", "1", None, 1, 0.0)]
                ),
            )
            assert ok.inserted
            # Fenced on the plain statement (a new step) and on the fallback (a recorded one
            # in the same batch makes the plain statement fail over to ON CONFLICT).
            stale = [StepWrite(h.id, c.epoch - 1, 1, "add", "2", None, 1, 0.0)]
            (fenced,) = await db.run(conn, save(qs, form, stale))
            assert not fenced.owned and not fenced.inserted
            mixed = [StepWrite(h.id, c.epoch, 0, "add", "5", None, 1, 0.0), *stale]
            kept, fenced = await db.run(conn, save(qs, form, mixed))
            assert kept.owned and not kept.inserted
            assert kept.recorded is not None and kept.recorded.output == 1
            assert not fenced.owned and not fenced.inserted

    asyncio.run(main())
    assert q(pg_dsn, schema, "SELECT step_id, output FROM {s}.operation_outputs") == [(0, 1)]


# -- the batch as one JSON parameter (jsonb_array_elements), hostile values through it ---------

OUTPUTS = ["null", '"a\\"b\\\\c\'d $$ ; --"', '{"k": [1, 2.5, "ü🚀"], "": {}}', "[]",
           "[" * 200 + "]" * 200, '"' + "x" * 200_000 + '"', "-0.0", "12345678901234567890"]


def test_values_cross_the_json_batch_exactly_and_none_stays_apart_from_null(
    pg_dsn: str, schema: str, form: bool
) -> None:
    qs = queries(schema)
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    hs = [client.submit(app.three_steps, i) for i in range(len(OUTPUTS) + 1)]

    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True,
                                                         prepare_threshold=None) as conn:
            connections.configure_connection(conn)
            claimed = await db.run(
                conn,
                statements.executions.claim_batch(
                    qs, owner="w", queues=["default"], limit=len(hs), lease_s=30
                ),
            )
            epoch = {c.id: c.epoch for c in claimed}
            batch = [StepWrite(h.id, epoch[h.id], 0, "s", out, None, 1, 0.0)
                     for h, out in zip(hs, OUTPUTS, strict=False)]
            failed = hs[-1].id  # an error and no output: SQL NULL, not JSON null
            batch.append(StepWrite(failed, epoch[failed], 0, "s", None,
                                   '{"type": "E", "message": "\\u00e9 \' \\""}', 1, 0.0))
            saved = await db.run(conn, save(qs, form, batch))
            assert all(s.owned and s.inserted and s.recorded is None for s in saved)
            # What jsonb stored is the value itself, exactly, and what codec.stored (the
            # value the workflow is handed) says it is.
            for h, out in zip(hs, OUTPUTS, strict=False):
                rec = await db.run(conn, statements.steps.load_step(
                    qs, execution_id=h.id, step_id=0))
                assert rec is not None
                assert rec.output == orjson.loads(out) == codec.stored(out), out[:40]
            rec = await db.run(conn, statements.steps.load_step(qs, execution_id=failed,
                                                                step_id=0))
            assert rec is not None and rec.output is None
            assert rec.error == {"type": "E", "message": "é ' \""}

    asyncio.run(main())
    rows = dict(q(pg_dsn, schema, "SELECT execution_id, output IS NULL "
                  "FROM {s}.operation_outputs"))
    assert rows[hs[0].id] is False  # JSON null is a value
    assert rows[hs[-1].id] is True  # no output at all


def test_text_the_database_cannot_store_is_a_data_error_of_its_batch(
    pg_dsn: str, schema: str, form: bool
) -> None:
    """A NUL (PostgreSQL refuses it) or a lone surrogate (it cannot be encoded) in a name:
    the statement fails with an error connections.is_data_error recognises, so the group commit
    isolates the item and fails only its execution (FAULTS P1); nothing is written."""
    qs = queries(schema)
    h = SyncClient(pg_dsn, schema=schema, pool_size=0).submit(app.three_steps, 1)

    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True,
                                                         prepare_threshold=None) as conn:
            connections.configure_connection(conn)
            (c,) = await db.run(
                conn,
                statements.executions.claim_batch(
                    qs, owner="w", queues=["default"], limit=1, lease_s=30
                ),
            )
            for name in ("nul\x00name", "lone\ud800surrogate"):
                try:
                    await db.run(
                        conn,
                        save(qs, form, [StepWrite(h.id, c.epoch, 0, name, "1", None, 1, 0.0)]
                        ),
                    )
                except Exception as exc:
                    assert connections.is_data_error(exc), repr(exc)
                else:
                    raise AssertionError(f"{name!r} was accepted")

    asyncio.run(main())
    assert q(pg_dsn, schema, "SELECT * FROM {s}.operation_outputs") == []

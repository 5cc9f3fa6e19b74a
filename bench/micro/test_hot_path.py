"""pytest-benchmark micro-benchmarks of the hot-path pieces.

    make bench-micro                          # timed
    pytest bench/micro --benchmark-disable    # one iteration each: the CI smoke test

Each benchmark drives the real statement against a real PostgreSQL; the assertions check
that the operation did its work, so the smoke run fails if it breaks.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from kestrel import codec, connections, db, statements
from kestrel.sql import queries
from kestrel.types import StepWrite

OUTPUT = {"cause": "OOMKilled", "confidence": 0.93, "evidence": ["a" * 40] * 20,
          "pods": [{"name": f"api-{i}", "restarts": i} for i in range(20)]}


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


@pytest.fixture
def conn(pg_dsn: str, loop: asyncio.AbstractEventLoop) -> Iterator[psycopg.AsyncConnection[Any]]:
    c = loop.run_until_complete(psycopg.AsyncConnection.connect(pg_dsn, autocommit=True))
    connections.configure_connection(c)
    yield c
    loop.run_until_complete(c.close())


def _submit(pg_dsn: str, schema: str, n: int) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(f'SELECT "{schema}".submit(\'bench\', jsonb_build_array(i)) '
                  "FROM generate_series(1, %s) AS i", [n])


def test_codec_encode_decode(benchmark: Any) -> None:
    def roundtrip() -> Any:
        return codec.decode(codec.encode(OUTPUT, what="output"))

    assert benchmark(roundtrip) == OUTPUT


def test_step_body_failpoint_when_nothing_is_armed(benchmark: Any) -> None:
    """What every step body pays for kestrel.testing's injected failures: one call that
    finds nothing armed."""
    import uuid

    from kestrel import failpoints
    from kestrel.definitions import StepInfo

    info = StepInfo(uuid.uuid4(), 0, "step", 1, 1)
    failpoints.disarm()
    assert benchmark(failpoints.failpoint, "step_body", info) is None


def test_checkpoint_batch_parameter_of_64(benchmark: Any) -> None:
    """Building a 64-row checkpoint batch's statement and its one JSON parameter (psycopg
    dumping nine arrays instead cost ~10 µs a row, BENCHMARKS.md)."""
    import uuid

    output = codec.encode(OUTPUT, what="bench")
    writes = [StepWrite(uuid.uuid4(), 1, k, "bench.step", output, None, 1, 0.0)
              for k in range(64)]
    q = queries("kestrel")
    stmt = benchmark(statements.steps.save_steps, q, writes)
    assert stmt.if_recorded == q.save_steps_batch
    assert stmt.params is not None
    rows = __import__("orjson").loads(stmt.params["rows"])
    assert len(rows) == 64 and rows[5][4] == [OUTPUT]


def test_claim_batch_of_32(benchmark: Any, pg_dsn: str, schema: str, conn: Any,
                           loop: asyncio.AbstractEventLoop) -> None:
    _submit(pg_dsn, schema, 5000)
    q = queries(schema)

    def claim() -> int:
        return len(loop.run_until_complete(db.run(conn, statements.executions.claim_batch(
            q, owner="bench", queues=["default"], limit=32, lease_s=30))))

    assert benchmark.pedantic(claim, rounds=50, iterations=1) == 32


def test_checkpoint_flush_of_64(benchmark: Any, pg_dsn: str, schema: str, conn: Any,
                                loop: asyncio.AbstractEventLoop) -> None:
    _submit(pg_dsn, schema, 64)
    q = queries(schema)
    claimed = loop.run_until_complete(
        db.run(
            conn,
            statements.executions.claim_batch(
                q, owner="bench", queues=["default"], limit=64, lease_s=300
            ),
        )
    )
    step = itertools.count()
    output = codec.encode(OUTPUT, what="output")

    def flush() -> int:
        k = next(step)
        writes = [StepWrite(c.id, c.epoch, k, "s", output, None, 1, 0.001) for c in claimed]
        saved = loop.run_until_complete(db.run(conn, statements.steps.save_steps(q, writes)))
        return sum(s.inserted for s in saved)

    assert benchmark.pedantic(flush, rounds=50, iterations=1) == 64


def test_heartbeat_of_1000_leases(benchmark: Any, pg_dsn: str, schema: str, conn: Any,
                                  loop: asyncio.AbstractEventLoop) -> None:
    _submit(pg_dsn, schema, 1000)
    q = queries(schema)
    claimed = loop.run_until_complete(
        db.run(
            conn,
            statements.executions.claim_batch(
                q, owner="bench", queues=["default"], limit=1000, lease_s=300
            ),
        )
    )
    held = [(c.id, c.epoch) for c in claimed]

    def beat() -> int:
        return len(
            loop.run_until_complete(
                db.run_script(conn, statements.executions.heartbeat(q, owner="bench", held=held,
                                                             lease_s=300))
            ).owned
        )

    assert benchmark.pedantic(beat, rounds=30, iterations=1) == 1000

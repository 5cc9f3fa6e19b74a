"""What one transaction holds in each floor (bench/floor.py): a duplicate key in the 5th of
8 rows rolls back the group floor's whole batch, and only its own row in the per-step floor.
No timing: the two floors' statements against the test suite's PostgreSQL."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import psycopg
import pytest
from psycopg import sql as pgsql

from bench import floor

ROWS = [[1], [2], [3], [4], [1], [6], [7], [8]]  # the 5th repeats the 1st


def _committed(pg_dsn: str, schema: str,
               send: Callable[..., Coroutine[Any, Any, None]]) -> list[int]:
    table = pgsql.Identifier(schema, "t")
    insert = pgsql.SQL("INSERT INTO {} (id) VALUES (%s)").format(table)

    async def go() -> list[int]:
        async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
            await conn.execute(pgsql.SQL("CREATE TABLE {} (id int PRIMARY KEY)").format(table))
            with pytest.raises(psycopg.errors.UniqueViolation):
                await send(conn, insert, ROWS)
            # The connection is usable after the failure (no transaction left aborted).
            cur = await conn.execute(pgsql.SQL("SELECT id FROM {} ORDER BY id").format(table))
            return [r[0] for r in await cur.fetchall()]

    return asyncio.run(go())


def test_the_group_floor_commits_a_pipeline_as_one_transaction(pg_dsn: str,
                                                                schema: str) -> None:
    assert _committed(pg_dsn, schema, floor.send_group) == []


def test_the_per_step_floor_commits_each_row_on_its_own(pg_dsn: str, schema: str) -> None:
    assert _committed(pg_dsn, schema, floor.send_per_step) == [1, 2, 3, 4]

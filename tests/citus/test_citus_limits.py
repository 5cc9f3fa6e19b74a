"""What the cluster itself still refuses or gets wrong, each in a few lines of plain SQL on
a scratch distributed schema: the blockers of issue 24's step 1, kept as strict xfails so the
tier says when a Citus build no longer has them."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest

from tests.citus.conftest import sharding_dsn


@pytest.fixture
def scratch(citus_dsn: str) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    name = f"x_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(sharding_dsn(citus_dsn), autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {name}")
        conn.execute(f"CREATE TABLE {name}.a (id int PRIMARY KEY)")
        conn.execute(f"CREATE TABLE {name}.b (id int PRIMARY KEY)")
        conn.execute(f"INSERT INTO {name}.a SELECT generate_series(1, 9)")
        conn.execute(f"SET search_path = {name}")
        try:
            yield conn
        finally:
            conn.execute(f"DROP SCHEMA {name} CASCADE")


@pytest.mark.xfail(strict=True, raises=psycopg.errors.InvalidTextRepresentation,
                   reason="Citus 13.2.2 on PostgreSQL 15.20: a statement with an INSERT CTE "
                          "runs its CTEs as subplans, and a locking CTE's (FOR UPDATE) result "
                          "is written binary and read back as text (citus.log_remote_commands:"
                          " read_intermediate_result(..., 'text')): 'invalid input syntax for "
                          "type integer: \"PGCOPY\"' (save_steps_batch, complete_batch and "
                          "the sweeper's statements have this shape)")
def test_rows_in_a_cte_locked_then_moved_by_an_insert_cte(
        scratch: psycopg.Connection[tuple[object, ...]]) -> None:
    rows = scratch.execute("""
        WITH f AS (SELECT (r->>0)::int AS id FROM jsonb_array_elements('[[4]]'::jsonb) r),
             l AS (SELECT a.id FROM a WHERE a.id IN (SELECT id FROM f) ORDER BY a.id
                   FOR UPDATE OF a),
             d AS (DELETE FROM a USING f WHERE a.id = f.id AND a.id IN (SELECT id FROM l)
                   RETURNING a.id),
             i AS (INSERT INTO b SELECT id FROM d RETURNING id)
        SELECT id FROM i""").fetchall()
    assert rows == [(4,)]


def test_the_same_lock_taken_inside_the_modifying_cte_is_planned_right(
        scratch: psycopg.Connection[tuple[object, ...]]) -> None:
    """The way around the xfail above, for the write path's statements: the rows locked by a
    subquery of the DELETE itself (ordered, FOR UPDATE) instead of by a CTE of their own.
    Citus then ships no locking subplan's result between nodes, and the rows move once."""
    rows = scratch.execute("""
        WITH f AS (SELECT (r->>0)::int AS id FROM jsonb_array_elements('[[4], [6]]'::jsonb) r),
             d AS (DELETE FROM a USING f WHERE a.id = f.id
                      AND a.id IN (SELECT l.id FROM a AS l WHERE l.id IN (SELECT id FROM f)
                                    ORDER BY l.id FOR UPDATE OF l)
                   RETURNING a.id),
             i AS (INSERT INTO b SELECT id FROM d RETURNING id)
        SELECT id FROM i ORDER BY id""").fetchall()
    assert rows == [(4,), (6,)]
    assert scratch.execute("SELECT count(*) FROM a").fetchone() == (7,)
    assert scratch.execute("SELECT id FROM b ORDER BY id").fetchall() == [(4,), (6,)]

"""kestrel.sql: the named statements, schema rendering and migrations."""

from __future__ import annotations

import dataclasses
import re

import pytest

from kestrel import sql
from kestrel.errors import ConfigError


def test_queries_fields_match_named_statements() -> None:
    fields = {f.name for f in dataclasses.fields(sql.Queries)}
    named = set(sql.named_statements())
    assert fields - named == set(), "Queries fields without a -- name: statement"
    assert named - fields == set(), "-- name: statements that are not Queries fields"


def test_named_statements_are_not_empty() -> None:
    for name, body in sql.named_statements().items():
        assert body.strip(), name


def test_render_quotes_schema() -> None:
    text = 'SELECT * FROM __schema__.t; LISTEN "kestrel.__schema_name__";'
    assert sql.render(text, "my_schema") == (
        'SELECT * FROM "my_schema".t; LISTEN "kestrel.my_schema";'
    )


@pytest.mark.parametrize(
    "bad", ["", "Public", "1abc", 'x"; DROP TABLE t; --', "a-b", "a.b", "x" * 64, "x" * 49]
)
def test_render_rejects_invalid_schema(bad: str) -> None:
    with pytest.raises(ConfigError):
        sql.render("SELECT 1 FROM __schema__.t", bad)


def test_queries_are_rendered_for_schema() -> None:
    q = sql.queries("unit_schema")
    for f in dataclasses.fields(q):
        text = getattr(q, f.name)
        assert "__schema" not in text, f.name
    assert '"unit_schema".' in q.claim_batch
    assert "kestrel.unit_schema" in q.listen


def test_migrations_numbered_and_rendered() -> None:
    found = sql.migrations("unit_schema")
    assert found, "no migrations found"
    assert [m.version for m in found] == list(range(1, len(found) + 1))
    for m in found:
        assert m.name
        assert "__schema" not in m.text
    assert sum('"unit_schema".' in m.text for m in found) >= 5  # the ones that touch tables
    for text in sql.functions("unit_schema"):  # every function, rendered for the schema
        assert "__schema" not in text and '"unit_schema".' in text


def test_migrations_reject_invalid_schema() -> None:
    with pytest.raises(ConfigError):
        sql.migrations("Bad-Schema")


def test_the_claim_spells_the_suspect_threshold_as_db_says() -> None:
    """claim_batch writes SUSPECT_AFTER as a constant (a partial index needs one)."""
    from kestrel import statements
    from kestrel.sql import named_statements

    claim = named_statements()["claim_batch"]
    assert f"e.attempts >= {statements.executions.SUSPECT_AFTER}" in claim
    assert f"e.attempts < {statements.executions.SUSPECT_AFTER}" in claim


def test_the_claims_change_and_result_are_written_once() -> None:
    """Issue 25: claim_batch and claim_limited wrote the flip to running and their result
    list twice, and db decoded both by column position. Both now include one fragment, and
    the result's columns are Claimed's field names."""
    texts = {p.name: p.read_text() for p in (sql.sql_dir() / "queries").glob("*.sql")}
    flips = [n for n, t in texts.items() if "SET status = 'running'" in t]
    assert flips == [], flips  # only sql/fragments/claim.sql says it
    statements = sql.named_statements()
    parts = sql.fragments()
    for name in ("claim_batch", "claim_limited"):
        assert sql.strip_comments(parts["claim_flip"]) in statements[name]
        assert sql.strip_comments(parts["claim_result"]) in statements[name]
        assert "-- include:" not in statements[name]
    from kestrel.statements.executions import _CLAIMED
    from kestrel.types import Claimed

    columns = set(_CLAIMED) | {"args", "steps"}
    assert columns <= {f.name for f in dataclasses.fields(Claimed)}
    selected = parts["claim_result"].partition("FROM claimed")[0]
    for column in columns:  # selected under that name (c.name, or … AS name)
        assert re.search(rf"(\bc\.|\bAS ){column}\b", selected), column


def test_a_claim_row_is_decoded_by_name_in_any_order() -> None:
    import uuid

    from kestrel.statements.executions import claimed as _claimed

    row = {"tracestate": None, "steps": '[[0, "a", 1, null]]', "epoch": 3, "attempt": 2,
           "args": "[1]", "workflow": "w", "id": uuid.UUID(int=1), "wait_step": None,
           "traceparent": None, "waiting_for": None}
    got = _claimed(dict(reversed(list(row.items()))))
    assert (got.workflow, got.args, got.epoch, got.attempt, got.broken) == ("w", [1], 3, 2,
                                                                             None)
    assert got.steps[0].output == 1


def test_an_include_of_an_unknown_fragment_is_refused(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "queries").mkdir()
    (tmp_path / "fragments").mkdir()
    (tmp_path / "queries" / "x.sql").write_text("-- name: x\nSELECT\n-- include: nope\n;")
    monkeypatch.setattr(sql, "sql_dir", lambda: tmp_path)
    with pytest.raises(RuntimeError, match="includes 'nope'"):
        sql.named_statements()


# -- one statement at a time (issue 24: Citus propagates DDL with the text the client sent) --

def test_split_statements_cuts_at_top_level_semicolons_only() -> None:
    text = """
    -- a comment; with a semicolon
    CREATE TABLE t (a text DEFAULT 'x;y', "b;c" int);  /* a /* nested; */ comment; */
    CREATE FUNCTION f() RETURNS int LANGUAGE plpgsql AS $$ BEGIN RETURN 1; END $$;
    CREATE FUNCTION g() RETURNS text LANGUAGE sql AS $body$ SELECT 'a;$$;b' $body$;
    SELECT E'it\\'s; fine', 'it''s; fine', $1::text, a$b;
    DO $x$ BEGIN PERFORM 1; END $x$
    -- only a comment after the last statement;
    """
    parts = sql.split_statements(text)
    assert len(parts) == 5
    assert parts[0].startswith("-- a comment") and parts[0].endswith('"b;c" int)')
    assert parts[1].startswith("/* a /* nested; */ comment; */")
    assert parts[1].endswith("END $$")
    assert parts[2].endswith("$body$")
    assert parts[3] == "SELECT E'it\\'s; fine', 'it''s; fine', $1::text, a$b"
    assert parts[4].startswith("DO $x$") and parts[4].endswith("END $x$\n    -- only a "
                                                                "comment after the last "
                                                                "statement;")


def test_every_migration_splits_into_whole_statements() -> None:
    """Each part starts with a comment or a keyword and is no comment alone; no migration
    uses BEGIN ATOMIC bodies, whose inner semicolons the splitter would cut."""
    for m in sql.migrations("unit_schema"):
        assert "begin atomic" not in m.text.lower(), m.name
        parts = m.statements
        assert parts, m.name
        for part in parts:
            code = "\n".join(line for line in part.splitlines()
                             if not line.strip().startswith("--")).strip()
            assert re.match(r"(CREATE|ALTER|DROP|INSERT|UPDATE|DELETE|COMMENT|DO|SELECT|WITH)\b",
                            code), (m.name, part[:200])
    # The functions are one statement each, the test clock's statements split like these.
    for text in sql.functions("unit_schema"):
        assert len(sql.split_statements(text)) == 1
    assert len(sql.movable_clock("unit_schema")) == 4


# -- what a statement sends: its SQL, not its comments ---------------------------------------

def test_strip_comments_drops_comments_and_keeps_every_quoted_byte() -> None:
    text = """-- a header line
    SELECT 'a -- not a comment', "b /* not */ c",  -- after code
           E'it\\'s -- still text', 'x''--y',
           $q$ -- kept
    /* kept too */ $q$,
      /* a /* nested */ block */ 1
    -- a line of its own;
    FROM t /* inline */ WHERE a = '
    -- a line inside a string
    '"""
    # The code's indentation goes too; a quoted byte never does.
    assert sql.strip_comments(text) == """SELECT 'a -- not a comment', "b /* not */ c",
E'it\\'s -- still text', 'x''--y',
$q$ -- kept
    /* kept too */ $q$,
1
FROM t  WHERE a = '
    -- a line inside a string
    '"""
    # Stripping is idempotent, and the statements split as before.
    assert sql.strip_comments(sql.strip_comments(text)) == sql.strip_comments(text)
    assert len(sql.split_statements(text)) == 1


def test_statements_send_only_their_name_and_the_hot_ones_fit_psycopgs_query_cache() -> None:
    from psycopg import _queries

    named = sql.named_statements()
    for name, text in named.items():
        comments = [text[a:b] for kind, a, b in sql._lex(text) if kind == "comment"]
        assert comments == [f"/* kestrel {name} */"], name
        assert text.startswith(comments[0])
    q = sql.queries("kestrel")
    # psycopg converts a text longer than this for its placeholders at every execution.
    for text in (q.claim_batch, q.complete_batch, q.save_steps_batch,
                 q.save_new_steps_batch, q.heartbeat):
        assert len(text.encode()) <= _queries.MAX_CACHED_STATEMENT_LENGTH

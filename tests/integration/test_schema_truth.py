"""sql/schema.sql is the schema the migrations build (issue 25): a schema migrated from zero
dumps to exactly that file, so the file a reader looks up cannot drift from the migrations."""

from __future__ import annotations

import difflib

from tools import schema as truth


def test_migrating_from_zero_builds_exactly_sql_schema_sql(direct_dsn: str,
                                                          production_schema: str) -> None:
    built = truth.dump(direct_dsn, production_schema)  # pg_dump talks to the server direct
    written = truth.SCHEMA_SQL.read_text()
    diff = "".join(difflib.unified_diff(written.splitlines(keepends=True),
                                        built.splitlines(keepends=True),
                                        "sql/schema.sql", "migrated from zero"))
    assert built == written, (f"sql/schema.sql is stale: regenerate it with `python -m "
                              f"tools.schema` and commit it\n{diff}")


def test_the_truth_has_every_table_and_no_function_or_dated_partition() -> None:
    text = truth.SCHEMA_SQL.read_text()
    for table in ("workflow_executions", "workflow_history", "operation_outputs",
                  "signals", "signal_history", "events", "event_history",
                  "idempotency_keys", "workers", "forks", "ui_sessions"):
        assert f"CREATE TABLE __schema__.{table} (" in text, table
    # Checkpoints are written once (migration 0019): step_history is a view of them.
    assert "CREATE VIEW __schema__.step_history AS" in text
    assert "CREATE FUNCTION" not in text and "_p20" not in text and "\nSET " not in text

"""One schema truth: every SQL function is defined once, in sql/functions or sql/partitions,
and a migrated schema holds exactly those definitions."""

from __future__ import annotations

import re

from kestrel.migrate import migrate
from kestrel.sql import function_definitions, movable_clock_definitions, render
from tests.helpers import q

BODY = re.compile(r"\$\$(.*)\$\$", re.S)


def _installed(pg_dsn: str, schema: str) -> list[tuple[str, str]]:
    return [(r[0], r[1]) for r in q(
        pg_dsn, schema, "SELECT p.proname, p.prosrc FROM pg_proc AS p "
        "JOIN pg_namespace AS n ON n.oid = p.pronamespace WHERE n.nspname = %s", [schema])]


def test_the_schema_holds_exactly_the_functions_defined_in_one_place(
    pg_dsn: str, schema: str, production_schema: str
) -> None:
    """A production schema holds exactly sql/functions and sql/partitions; a schema made for
    tests (the fixture's) those and sql/testclock's, its kestrel_now() rewritten by the
    clock trigger to now() plus the offset (zero after migrate)."""
    defined = function_definitions()
    testclock = {k: v for k, v in movable_clock_definitions().items()
                 if "CREATE OR REPLACE FUNCTION" in v}
    for name_, wanted in ((production_schema, defined), (schema, {**defined, **testclock})):
        rows = _installed(pg_dsn, name_)
        # No function a migration created and the files no longer define; no stale overload.
        assert sorted(r[0] for r in rows) == sorted(wanted)
        for name, source in rows:
            if name == "kestrel_now" and name_ == schema:
                assert source == "SELECT now() + 'PT0S'::interval"
                continue
            body = BODY.search(render(wanted[name], name_))
            assert body is not None, name
            assert source == body.group(1), f"{name} differs from its definition in sql/"


def test_migrate_again_reapplies_the_definitions(pg_dsn: str, schema: str) -> None:
    """A function changed in the database (or by an old migration) is put back to the
    file's definition by the next migrate, with no new migration."""
    q(pg_dsn, schema, "CREATE OR REPLACE FUNCTION {s}.valid_queue_name(p_queue text) "
      "RETURNS boolean LANGUAGE sql IMMUTABLE AS $$ SELECT true $$")
    assert q(pg_dsn, schema, "SELECT {s}.valid_queue_name('no spaces allowed')") == [(True,)]
    assert migrate(pg_dsn, schema) == []  # nothing pending
    assert q(pg_dsn, schema, "SELECT {s}.valid_queue_name('no spaces allowed')") == [(False,)]

"""One schema truth: every SQL function is defined once, in sql/functions or sql/partitions,
and a migrated schema holds exactly those definitions."""

from __future__ import annotations

import re

from kestrel.migrate import migrate
from kestrel.sql import function_definitions, render
from tests.helpers import q

BODY = re.compile(r"\$\$(.*)\$\$", re.S)


def test_the_schema_holds_exactly_the_functions_defined_in_one_place(
    pg_dsn: str, schema: str
) -> None:
    rows = q(pg_dsn, schema, "SELECT p.proname, p.prosrc FROM pg_proc AS p "
             "JOIN pg_namespace AS n ON n.oid = p.pronamespace WHERE n.nspname = %s",
             [schema])
    installed = [r[0] for r in rows]
    defined = function_definitions()
    # No function a migration created and the files no longer define; no stale overload.
    assert sorted(installed) == sorted(defined)
    for name, source in rows:
        body = BODY.search(render(defined[name], schema))
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

"""Moving from one PostgreSQL to the cluster (issue 24; docs/howto/scaling.md, "Moving
from one PostgreSQL"): a kestrel schema made and used on a plain PostgreSQL that becomes a Citus
coordinator is distributed where it is, with its work in flight, and goes on."""

from __future__ import annotations

import uuid
from pathlib import Path

from kestrel.client import SyncClient
from kestrel.migrate import migrate
from tests.apps import ledger_app as app
from tests.citus.test_tenants import node_of
from tests.helpers import drop_schemas, q, q1, runtime, wait_until


def test_a_schema_in_use_is_distributed_and_its_work_goes_on(citus_dsn: str,
                                                            tmp_path: Path) -> None:
    """The schema of a one-PostgreSQL install (migrated without schema-based sharding, on
    the coordinator): finished, queued and waiting executions. citus_schema_distribute
    makes it a distributed schema on a worker node; migrate again installs the delegated
    write path; a runtime finishes what was queued and waiting, and new work, and the old
    history is still there."""
    name = f"mi_{uuid.uuid4().hex[:10]}"
    migrate(citus_dsn, name)  # as on one PostgreSQL: nothing distributed
    client = SyncClient(citus_dsn, schema=name, pool_size=1)
    try:
        done = [client.submit("three_steps", i) for i in range(3)]
        waiting = client.submit("approval", 7)
        with runtime(citus_dsn, name, procs=1, log=tmp_path / "before.log"):
            assert [h.result(timeout=60) for h in done] == [app.model(i) for i in range(3)]
            wait_until(lambda: client.get(waiting.id).status.value == "waiting", timeout=30,
                       what="the approval waiting")
        queued = [client.submit("three_steps", 10 + i) for i in range(3)]
        assert q1(citus_dsn, name, "SELECT count(*) FROM citus_schemas "
                  "WHERE schema_name::text = %s", [name]) == 0

        q(citus_dsn, name, "SELECT citus_schema_distribute(%s::regnamespace)", [name])
        assert node_of(citus_dsn, name) != 5440  # on a worker node, every table of it
        assert migrate(citus_dsn, name) == []  # nothing to apply; delegation installed
        assert q1(citus_dsn, name, "SELECT {s}.distributed_schema()") is True

        with runtime(citus_dsn, name, procs=1, log=tmp_path / "after.log"):
            assert [h.result(timeout=60) for h in queued] == [app.model(10 + i)
                                                              for i in range(3)]
            client.signal(waiting.id, "approve", {"ok": True})
            assert waiting.result(timeout=60)["payload"] == {"ok": True}
            new = client.submit("three_steps", 20)
            assert new.result(timeout=60) == app.model(20)
        assert [client.get(h.id).result for h in done] == [app.model(i) for i in range(3)]
        assert q1(citus_dsn, name, "SELECT count(*) FROM (SELECT 1 FROM {s}.workflow_steps "
                  "GROUP BY execution_id, step_id HAVING count(*) > 1) d") == 0
    finally:
        client.close()
        drop_schemas(citus_dsn, [name])

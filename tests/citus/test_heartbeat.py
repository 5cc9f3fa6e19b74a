"""The heartbeat on a distributed schema (FAULTS C2/C3/O4): rows held on their worker node,
FOR SHARE as a checkpoint batch holds them and by a client's open UPDATE, do not delay a
beat; the process's lease (its own row, migration 0026) is extended and every row trusted.
"""

from __future__ import annotations

from tests.integration.test_lock_timeout import beat_against_locks


def test_no_lock_on_a_distributed_schema_delays_the_heartbeat(
    citus_dsn: str, tenant: str
) -> None:
    beat_against_locks(citus_dsn, citus_dsn, tenant, session=True)

"""The heartbeat on a distributed schema (FAULTS C2/O4): a row locked for a moment on its
worker node is waited out and extended at the same beat; a row a client keeps is counted
busy and never trusted longer. The waits happen on the node: ``citus_lock_waits`` sees them.
"""

from __future__ import annotations

from tests.integration.test_lock_timeout import beat_against_locks


def test_the_heartbeat_waits_out_a_short_lock_on_a_distributed_schema(
    citus_dsn: str, tenant: str
) -> None:
    beat_against_locks(citus_dsn, citus_dsn, tenant, session=True,
                       waits="SELECT count(*) FROM citus_lock_waits")

"""D16: the primary dies (SIGKILL of the postmaster and its backends) and its synchronous
streaming replica, a second cluster on another port, is promoted. The runtime runs on a
multi-host DSN with target_session_attrs=read-write, so libpq skips the dead primary and
the standby until it is promoted, then lands on it.

Asserted: every checkpoint and finished execution the old primary had committed (with
synchronous replication) is on the new primary byte for byte; every execution completes
with the model's result; no step is recorded twice (bodies cut short by the failover may
run again). The old primary stays down: fencing it off (STONITH) is the HA manager's job,
since libpq would accept any server that says it is read-write.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from kestrel.migrate import migrate
from tests.helpers import audit, finished_count, q, runtime, submit_many, wait_until
from tests.pgcluster import Cluster

SCHEMA = "failover"
COMMITTED = "SELECT execution_id::text, step_id, output::text FROM {s}.operation_outputs"


@pytest.fixture
def pair() -> Iterator[tuple[Cluster, Cluster]]:
    primary = Cluster("kestrel-primary", conf={
        "wal_level": "replica", "max_wal_senders": "5", "synchronous_commit": "on",
        "synchronous_standby_names": "'replica'"})
    replica: Cluster | None = None
    try:
        primary.start()
        replica = primary.replica()
        replica.start()
        wait_until(lambda: q(primary.dsn, SCHEMA, "SELECT sync_state FROM "
                             "pg_stat_replication") == [("sync",)],
                   timeout=30, what="the replica to stream synchronously")
        yield primary, replica
    finally:
        primary.destroy()
        if replica is not None:
            replica.destroy()


def test_d16_failover_to_a_promoted_synchronous_replica(
    pair: tuple[Cluster, Cluster], ledger_path: Path, tmp_path: Path
) -> None:
    primary, replica = pair
    migrate(primary.dsn, SCHEMA)
    dsn = (f"host=127.0.0.1,127.0.0.1 port={primary.port},{replica.port} user=postgres "
           "dbname=postgres target_session_attrs=read-write connect_timeout=3")
    n = 600
    submit_many(primary.dsn, SCHEMA, "slow_middle", "jsonb_build_array(i, 0.2)", n)
    log = tmp_path / "rt.log"
    with runtime(dsn, SCHEMA, procs=2, log=log):
        wait_until(lambda: finished_count(primary.dsn, SCHEMA) >= 150, timeout=60,
                   what="progress on the primary")
        # What the primary has committed by now, read from the primary itself.
        committed = set(q(primary.dsn, SCHEMA, COMMITTED))
        finished = {r[0] for r in q(primary.dsn, SCHEMA,
                                    "SELECT id::text FROM {s}.workflow_history")}
        primary.kill9()
        assert not primary.running()
        time.sleep(1.0)  # the failover takes a moment: the runtime sees no writable server
        replica.promote()

        def done() -> bool:
            try:
                return finished_count(replica.dsn, SCHEMA) == n
            except psycopg.OperationalError:
                return False

        wait_until(done, timeout=120, interval=0.5, what="every workflow on the new primary")
    assert not primary.running()  # nothing could have been written to the old primary
    survived = set(q(replica.dsn, SCHEMA, COMMITTED))
    assert committed <= survived, f"{len(committed - survived)} committed checkpoints lost"
    assert finished <= {r[0] for r in q(replica.dsn, SCHEMA,
                                        "SELECT id::text FROM {s}.workflow_history")}
    assert len(committed) > 3 * 150 - 1  # the snapshot was taken mid-run, not empty
    audit(replica.dsn, SCHEMA, n, ledger_path)  # all complete, model results, C(s) = 1
    text = log.read_text()
    assert "restarting in" not in text  # workers rode it out

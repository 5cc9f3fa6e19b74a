"""What a process gives back (kestrel.lease.Leases): the rows that run under its lease,
which its heartbeat keeps alive, but that nothing in the process runs any more. The sweeper
never takes those (migration 0026), so the heartbeat ends their lease for it to; these rules
say which, and when.
The end-to-end checks are D10 (a lock past the lease) and the lost claim reply in
tests/chaos/test_process_faults.py, both of which hung for ever without them."""

from __future__ import annotations

import uuid

from kestrel.lease import Lease, Leases
from kestrel.types import Claimed


def lease(eid: uuid.UUID, epoch: int = 1) -> Lease:
    return Lease(Claimed(eid, "w", [], epoch, 1, {}), trusted_until=0.0, claimed_at=0.0)


def test_a_dropped_claim_is_given_back_once() -> None:
    leases = Leases()
    held = lease(uuid.uuid4())
    leases.add(held)
    leases.remove(held)
    leases.drop(held)
    assert leases.take_dropped() == [held.key]
    assert leases.take_dropped() == []  # handed over: the next beat sends nothing again


def test_after_a_lost_claim_reply_only_what_is_not_held_is_given_back() -> None:
    leases = Leases()
    mine, older, stray = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    leases.add(lease(mine, 3))
    leases.add(lease(older, 2))
    leases.audit = True
    running = [(mine, 3), (older, 1), (stray, 5)]  # older: held here under a newer epoch
    assert leases.adopt(running) == 2
    assert sorted(leases.take_dropped()) == sorted([(older, 1), (stray, 5)])
    assert leases.audit is False  # answered


def test_no_row_is_given_back_while_a_claim_is_on_its_way() -> None:
    """A claim whose rows committed but whose reply is still on its way: they run under the
    lease and are not held yet. Giving them back then would let another process run them
    beside this one; the audit waits for the next beat."""
    leases = Leases()
    leases.audit = True
    leases.claiming = 1
    assert leases.adopt([(uuid.uuid4(), 1)]) == 0
    assert leases.take_dropped() == []
    assert leases.audit is True  # still asked for
    leases.claiming = 0
    assert leases.adopt([(uuid.uuid4(), 1)]) == 1

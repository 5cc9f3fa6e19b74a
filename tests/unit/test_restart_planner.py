"""The supervisor's restart policy, decided without processes or clocks (RestartPlanner).

Jitter is pinned to 1.0 (the longest wait) unless a test says otherwise, so every delay is
exact: 0.25, 0.5, 1, 2, 4, 8 s, then the 10 s cap.
"""

from __future__ import annotations

import pytest

from kestrel.supervisor import RestartPlanner, RestartPolicy

POLICY = RestartPolicy()  # base 0.25 s, cap 10 s, healthy after 10 s, prompt 1 s


def planner(procs: int) -> RestartPlanner:
    return RestartPlanner(procs, jitter=lambda: 1.0)


def test_the_default_floor_is_half_the_workers_rounded_up() -> None:
    assert [RestartPolicy.for_procs(n).floor for n in (1, 2, 3, 4, 16)] == [1, 1, 2, 2, 8]


def test_jitter_only_shortens_a_wait_and_at_most_by_half() -> None:
    assert POLICY.backoff(3, 1.0) == 1.0
    assert POLICY.backoff(3, 0.0) == 0.5
    assert POLICY.backoff(100, 1.0) == POLICY.cap_s


def test_a_slot_whose_children_die_young_backs_off_up_to_the_cap() -> None:
    p = planner(2)
    now = 0.0
    p.started(0, now)
    p.started(1, now)  # slot 1 stays healthy: the floor is met without slot 0
    delays = []
    for _ in range(9):
        now += 0.5  # the child dies half a second after it started
        (restart,) = p.exited(0, now)
        assert not restart.early
        delays.append(restart.delay)
        assert p.due(now + restart.delay - 0.01) == []
        now += restart.delay
        assert p.due(now) == [0]
        p.started(0, now)
    assert delays == [0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0]
    assert p.failures(0) == 9


def test_a_child_that_lived_past_the_healthy_threshold_resets_its_slot() -> None:
    p = planner(2)
    p.started(1, 0.0)
    now = 0.0
    for _ in range(5):  # five quick deaths: the slot is at a 4 s wait
        p.started(0, now)
        now += 0.5
        (restart,) = p.exited(0, now)
        now += restart.delay
    assert (p.failures(0), restart.delay) == (5, 4.0)
    p.started(0, now)
    (restart,) = p.exited(0, now + POLICY.healthy_after_s - 0.1)  # not quite long enough
    assert (restart.failures, restart.delay) == (6, 8.0)
    now += POLICY.healthy_after_s - 0.1 + restart.delay
    p.started(0, now)
    (restart,) = p.exited(0, now + POLICY.healthy_after_s)
    assert (restart.failures, restart.delay, restart.early) == (0, 0.0, False)
    assert p.due(now + POLICY.healthy_after_s) == [0]  # back at once


def test_when_the_last_worker_dies_the_slot_due_first_comes_back_early() -> None:
    p = planner(2)
    p.started(1, 0.0)  # slot 1 runs; slot 0 crash loops up to an 8 s wait
    t = 0.0
    for _ in range(6):
        p.started(0, t)
        t += 0.5
        (r0,) = p.exited(0, t)
        t += r0.delay
    t0 = t - r0.delay  # slot 0 died at t0 and waits until t0 + 8
    assert (r0.delay, r0.early) == (8.0, False)
    t = t0 + 0.1
    waits = []
    for _ in range(5):  # now slot 1 is killed young, again and again
        (r1,) = p.exited(1, t)
        waits.append((r1.failures, r1.delay, r1.early))
        t += r1.delay
        p.started(1, t)
        t += 0.1
    # Its first death ended a long life (a reset); while its own wait is at most prompt_s
    # it is the prompt one; past that, it is still due before slot 0, so the floor (one
    # worker) pulls it in to prompt_s after its death.
    assert waits == [(0, 0.0, False), (1, 0.25, False), (2, 0.5, False), (3, 1.0, False),
                     (4, 1.0, True)]
    (r1,) = p.exited(1, t)
    assert (r1.failures, r1.delay, r1.early) == (5, 1.0, True)
    t += 1.0
    p.started(1, t)
    t += 0.1
    assert t < t0 + 8.0
    # Slot 1's own wait (8 s) now ends after slot 0's: slot 0 is pulled in instead, within
    # prompt_s, and slot 1 backs off.
    decisions = p.exited(1, t)
    assert [(d.slot, d.early) for d in decisions] == [(1, False), (0, True)]
    assert [d.delay for d in decisions] == pytest.approx([8.0, 1.0])
    assert p.due(t + 0.99) == []
    assert p.due(t + 1.01) == [0]


@pytest.mark.parametrize("procs", [1, 2, 3, 4, 8, 16])
def test_with_every_slot_crash_looping_the_floor_still_restarts_promptly(procs: int) -> None:
    """Every child dies 0.3 s after it starts, forever (a kill storm, or a fleet-wide crash
    loop). At every moment at least the floor of slots is running or due within prompt_s,
    the fleet is never empty for longer than prompt_s, and the fork rate stays bounded: the
    floor's slots about once per prompt_s + life each, the others at the cap."""
    p = RestartPlanner(procs, jitter=lambda: 0.5)
    floor, prompt, cap = p.policy.floor, p.policy.prompt_s, p.policy.cap_s
    tick, life, horizon = 0.05, 0.3, 300.0
    started_at: dict[int, float] = {}
    for slot in range(procs):
        p.started(slot, 0.0)
        started_at[slot] = 0.0
    starts = procs
    empty_since: float | None = None
    longest_empty = 0.0
    now = 0.0
    while now < horizon:
        now = round(now + tick, 6)
        for slot, t0 in list(started_at.items()):
            if now - t0 >= life:
                del started_at[slot]
                p.exited(slot, now)
        waits = [p.restart_at(slot) for slot in range(procs)]
        assert sum(1 for w in waits if w is None or w - now <= prompt + 1e-9) >= floor
        for slot in p.due(now):
            p.started(slot, now)
            started_at[slot] = now
            starts += 1
        if started_at:
            empty_since = None
        else:
            empty_since = now if empty_since is None else empty_since
            longest_empty = max(longest_empty, now - empty_since)
    assert longest_empty <= prompt + tick + 1e-9
    assert all(p.failures(slot) > 0 for slot in range(procs))
    least = horizon * floor / (life + prompt + tick)
    most = 8 * procs + horizon * (floor / (life + prompt) + (procs - floor) / (life + cap / 2))
    assert least <= starts <= most

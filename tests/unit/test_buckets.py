"""kestrel.buckets without a database: names, ids, the submit's choice and the merges."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest

from kestrel import buckets, ids
from kestrel.config import Config
from kestrel.errors import ConfigError
from kestrel.types import ExecutionSummary, PatchUse, QueueStat, Stats, Status, Unclaimable


def test_ids_made_for_a_bucket_name_it_and_stay_uuidv7_of_their_time() -> None:
    for k in (0, 1, 7, 255):
        made = ids.new_id(1_700_000_000_000, bucket=k)
        assert made.version == 7 and made.variant == uuid.RFC_4122
        assert ids.created_ms(made) == 1_700_000_000_000
        assert buckets.bucket_of(made, 256) == k
        assert buckets.bucket_of(made, 16) == k % 16
    plain = ids.new_id()
    assert buckets.with_bucket(plain, 9).bytes[7] == 9
    assert buckets.bucket_of(buckets.with_bucket(plain, 9), 4) == 1


def test_schemas_are_the_namespace_then_suffixed_and_refused_past_the_name_rule() -> None:
    assert buckets.schemas("acme", 3) == ["acme", "acme_b1", "acme_b2"]
    assert buckets.schema_of("acme", 255) == "acme_b255"
    with pytest.raises(ConfigError):
        buckets.schema_of("acme", 256)
    with pytest.raises(ConfigError, match="cannot have a bucket"):
        buckets.schemas("a" * 46, 2)
    for bad in (0, 1, 257, True, 2.5, "4", None):
        with pytest.raises(ConfigError, match="bucket count"):
            buckets.check_count(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [-1, 257, 10_000])
def test_the_buckets_setting_is_checked(value: int) -> None:
    with pytest.raises(ConfigError, match="buckets"):
        Config(buckets=value)


def test_the_choice_is_stable_for_keys_and_spread_without_one() -> None:
    hostile = ["", "x" * 5000, "'; DROP TABLE x; --", "\ud800", "\x00", "ü" * 10]
    for key in hostile:
        first = buckets.choose(7, queue="q", idempotency_key=key)
        assert 0 <= first < 7
        assert all(buckets.choose(7, queue="other", idempotency_key=key) == first
                   for _ in range(5))
        assert buckets.choose(7, queue="q", dedup_key=key) == buckets.choose(
            7, queue="q", dedup_key=key)
    # A key's bucket is a function of the key alone, whatever the queue and its limits.
    assert buckets.choose(16, queue="ai", idempotency_key="k") == \
        buckets.choose(16, queue="other", idempotency_key="k")
    for key in hostile:
        with pytest.raises(ConfigError, match="not both"):
            buckets.choose(7, queue="q", idempotency_key="k", dedup_key=key)
    assert 0 <= buckets.home("ai", 16) < 16
    assert len({buckets.home(f"q{i}", 4) for i in range(40)}) == 4  # homes spread
    seen = {buckets.choose(4, queue="q") for _ in range(400)}
    assert seen == {0, 1, 2, 3}


def _summary(minutes: int) -> ExecutionSummary:
    at = datetime(2026, 1, 1, tzinfo=UTC) + timedelta(minutes=minutes)
    return ExecutionSummary(id=uuid.uuid4(), workflow="w", queue="q", status=Status.COMPLETED,
                            attempts=1, created_at=at, finished_at=at)


def test_merges_give_what_one_schema_would() -> None:
    assert buckets.merge_counts([{"completed": 2}, {"completed": 3, "failed": 1}, {}]) == {
        "completed": 5, "failed": 1}
    a, b = [_summary(9), _summary(5), _summary(1)], [_summary(8), _summary(2)]
    page = buckets.merge_list([a, b], 3)
    assert [r.created_at.minute for r in page] == [9, 8, 5]
    s1 = Stats(queues=[QueueStat(queue="q", status="pending", count=2, oldest_age_s=5.0)],
               running_by_worker={"w1": 1}, totals={"pending": 2})
    s2 = Stats(queues=[QueueStat(queue="q", status="pending", count=3, oldest_age_s=9.0),
                       QueueStat(queue="a", status="running", count=1, oldest_age_s=None)],
               running_by_worker={"w2": 4}, totals={"pending": 3, "running": 1})
    merged = buckets.merge_stats([s1, s2])
    assert merged.queues == [QueueStat(queue="a", status="running", count=1, oldest_age_s=None),
                             QueueStat(queue="q", status="pending", count=5, oldest_age_s=9.0)]
    assert merged.running_by_worker == {"w1": 1, "w2": 4}
    assert merged.totals == {"pending": 5, "running": 1}
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    u = buckets.merge_unclaimable([
        [Unclaimable(workflow="w", queue="q", count=2, oldest_created_at=t0,
                     given_back_by=["v1"])],
        [Unclaimable(workflow="w", queue="q", count=1, oldest_created_at=t0 - timedelta(1),
                     given_back_by=["v2"]),
         Unclaimable(workflow="x", queue="q", count=9, oldest_created_at=t0)]], 10)
    assert [(x.workflow, x.count) for x in u] == [("x", 9), ("w", 3)]
    assert u[1].oldest_created_at == t0 - timedelta(1) and u[1].given_back_by == ["v1", "v2"]
    p = buckets.merge_patches([
        [PatchUse(workflow="w", patch="p", at_step=2, total_with=1, live_with=1,
                  live_without=0)],
        [PatchUse(workflow="w", patch="p", at_step=2, total_with=2, live_with=0,
                  live_without=3)]])
    assert [(x.total_with, x.live_with, x.live_without) for x in p] == [(3, 1, 3)]

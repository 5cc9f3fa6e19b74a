"""Buckets: one kestrel namespace spread over several schemas (issue 24, step 2).

A namespace of *n* buckets is *n* ordinary kestrel schemas: bucket 0 is the namespace's own
name, bucket *k* is ``<name>_b<k>``. Each is a whole kestrel schema (its own executions,
checkpoints, signals, events, idempotency keys and history), so every statement of an
execution runs in its bucket's schema alone, and on Citus with schema-based sharding each
bucket is one colocation group that lives on one node and moves as one (docs/citus.md).

An execution's bucket is fixed when it is submitted and is written into its id: the eighth
byte of every id kestrel makes for bucket *k* is *k*, so any id says where its execution is
(:func:`bucket_of`; an id made elsewhere goes where its eighth byte says). A child is
submitted by its parent's worker, in its parent's bucket. The submit of a top-level
execution chooses by :func:`choose`.

The bucket count is fixed when the namespace is made (each bucket's ``bucket`` table records
it with the bucket's number): ids already made name their bucket modulo the count.
"""

from __future__ import annotations

import hashlib
import secrets
import uuid
from datetime import datetime
from typing import Any

from kestrel.errors import ConfigError
from kestrel.sql import SCHEMA_NAME, SCHEMA_RULE
from kestrel.types import ExecutionSummary, PatchUse, QueueStat, Stats, Unclaimable

MAX_BUCKETS = 256
"""Most buckets one namespace has: the bucket is one byte of the id."""

ID_BYTE = 7
"""The byte of an id that names its bucket: the low byte of UUIDv7's ``rand_a``, after the
48 bits of time (which partition the checkpoints) and the version."""


def check_count(buckets: int) -> int:
    """*buckets*, if a namespace can have that many (2 to :data:`MAX_BUCKETS`)."""
    if isinstance(buckets, bool) or not isinstance(buckets, int) or not (
            2 <= buckets <= MAX_BUCKETS):
        raise ConfigError(f"invalid bucket count {buckets!r}: 2 to {MAX_BUCKETS} (one schema "
                          "of a namespace is one bucket; 1 is an ordinary schema)")
    return buckets


def schema_of(namespace: str, bucket: int) -> str:
    """The schema of *namespace*'s *bucket*: the namespace's own name for bucket 0,
    ``<namespace>_b<bucket>`` for the others."""
    if not 0 <= bucket < MAX_BUCKETS:
        raise ConfigError(f"invalid bucket {bucket!r}: 0 to {MAX_BUCKETS - 1}")
    name = namespace if bucket == 0 else f"{namespace}_b{bucket}"
    if not SCHEMA_NAME.fullmatch(name):
        raise ConfigError(f"namespace {namespace[:100]!r} cannot have a bucket {bucket}: its "
                          f"schema {name[:100]!r} must be {SCHEMA_RULE}")
    return name


def schemas(namespace: str, buckets: int) -> list[str]:
    """Every schema of *namespace*, bucket 0 first."""
    return [schema_of(namespace, k) for k in range(check_count(buckets))]


def served_by(schema: str, made: tuple[int, int] | None) -> list[str]:
    """The schemas a tool given *schema* reads, from what its bucket table says (*made*,
    ``(bucket, buckets)`` or None): a namespace's bucket 0 names every bucket's schema; any
    other schema (an ordinary one, or one bucket's, read on its own) is itself alone."""
    if made is None or made[0] != 0:
        return [schema]
    return schemas(schema, made[1])


def bucket_of(execution_id: uuid.UUID, buckets: int) -> int:
    """The bucket *execution_id* is in, in a namespace of *buckets*."""
    return execution_id.bytes[ID_BYTE] % buckets


def with_bucket(execution_id: uuid.UUID, bucket: int) -> uuid.UUID:
    """*execution_id* with its bucket byte set to *bucket*."""
    raw = bytearray(execution_id.bytes)
    raw[ID_BYTE] = bucket
    return uuid.UUID(bytes=bytes(raw))


def _hash(*parts: str) -> int:
    digest = hashlib.blake2b("\x00".join(parts).encode("utf-8", "surrogatepass"),
                             digest_size=8).digest()
    return int.from_bytes(digest, "big")


def choose(buckets: int, *, queue: str, idempotency_key: str | None = None,
           dedup_key: str | None = None) -> int:
    """The bucket of a new top-level execution, from the submit's keys alone, so that each
    submit of a key meets the first wherever and whenever it is sent (FAULTS C4):

    1. an *idempotency_key* goes to ``hash(key)``;
    2. a *dedup_key* to ``hash(queue, key)``, so a queue's live duplicates meet;
    3. anything else to a random bucket.

    A queue's limits do not move its executions: they hold across the namespace wherever
    its executions are (:func:`home`).

    Raises:
        ConfigError: both keys at once: the idempotency key's bucket and the dedup key's
            differ, and neither key could then keep its promise (one execution per
            idempotency key, one live execution per dedup key); nothing is written.
    """
    if idempotency_key is not None and dedup_key is not None:
        raise ConfigError(
            "a submit to a namespace of buckets takes an idempotency key or a dedup (or "
            "debounce) key, not both: each decides the bucket, and both could not be kept (a "
            "dedup or debounce key alone is already safe to send again while its execution "
            "is pending)")
    if idempotency_key is not None:
        return _hash("key", idempotency_key) % buckets
    if dedup_key is not None:
        return _hash("dedup", queue, dedup_key) % buckets
    return secrets.randbelow(buckets)


def home(queue: str, buckets: int) -> int:
    """The bucket holding *queue*'s limits for the whole namespace: every claim of a limited
    queue, in any bucket, takes the queue's row there first, counts what runs in every
    bucket under it and records its starts there (``queues.claim_limited``)."""
    return _hash("queue", queue) % buckets


# What a namespace's buckets answer, merged into what one schema would have answered (the
# client's calls that read every bucket: counts, list, stats, workers, unclaimable, patches).

def merge_counts(parts: list[dict[str, int]]) -> dict[str, int]:
    """Counts by status, summed over the buckets."""
    total: dict[str, int] = {}
    for part in parts:
        for status, count in part.items():
            total[status] = total.get(status, 0) + count
    return total


def merge_list(parts: list[list[ExecutionSummary]], limit: int) -> list[ExecutionSummary]:
    """The newest *limit* of the buckets' pages (each newest first, at most *limit* long)."""
    rows = [row for part in parts for row in part]
    rows.sort(key=lambda r: r.created_at, reverse=True)
    return rows[:limit]


def merge_pages(parts: list[list[tuple[dict[str, Any], datetime]]],
                limit: int) -> list[tuple[dict[str, Any], datetime]]:
    """The first *limit* of the buckets' keyset pages (each newest first by creation time,
    then id, after one cursor): the HTTP door's list and the web UI's."""
    rows = [row for part in parts for row in part]
    rows.sort(key=lambda r: (r[1], r[0]["id"]), reverse=True)
    return rows[:limit]


def merge_finished(parts: list[list[dict[str, Any]]], limit: int) -> list[dict[str, Any]]:
    """The first *limit* of the buckets' finished executions (each newest finished first,
    then id): the web UI's search."""
    rows = [row for part in parts for row in part]
    rows.sort(key=lambda r: (r["finished_at"], r["id"]), reverse=True)
    return rows[:limit]


def merge_stats(parts: list[Stats]) -> Stats:
    """Live work by queue and status (counts summed, the oldest age the largest), running by
    worker and totals, over the buckets."""
    queues: dict[tuple[str, str], QueueStat] = {}
    for part in parts:
        for qs in part.queues:
            have = queues.get((qs.queue, qs.status))
            if have is None:
                queues[(qs.queue, qs.status)] = qs
                continue
            ages = [a for a in (have.oldest_age_s, qs.oldest_age_s) if a is not None]
            queues[(qs.queue, qs.status)] = QueueStat(
                queue=qs.queue, status=qs.status, count=have.count + qs.count,
                oldest_age_s=max(ages) if ages else None)
    return Stats(queues=sorted(queues.values(), key=lambda s: (s.queue, s.status)),
                 running_by_worker=merge_counts([p.running_by_worker for p in parts]),
                 totals=merge_counts([p.totals for p in parts]))


def merge_unclaimable(parts: list[list[Unclaimable]], limit: int) -> list[Unclaimable]:
    """Unclaimable executions by workflow and queue over the buckets, the most first."""
    lines: dict[tuple[str, str], Unclaimable] = {}
    for part in parts:
        for u in part:
            have = lines.get((u.workflow, u.queue))
            if have is None:
                lines[(u.workflow, u.queue)] = u
                continue
            by = sorted(set(have.given_back_by or []) | set(u.given_back_by or [])) or None
            lines[(u.workflow, u.queue)] = Unclaimable(
                workflow=u.workflow, queue=u.queue, count=have.count + u.count,
                oldest_created_at=min(have.oldest_created_at, u.oldest_created_at),
                given_back_by=by)
    return sorted(lines.values(), key=lambda u: (-u.count, u.workflow, u.queue))[:limit]


def merge_patches(parts: list[list[PatchUse]]) -> list[PatchUse]:
    """Patch use by workflow, patch and step, summed over the buckets."""
    uses: dict[tuple[str, str, int | None], PatchUse] = {}
    for part in parts:
        for p in part:
            key = (p.workflow, p.patch, p.at_step)
            have = uses.get(key)
            uses[key] = p if have is None else PatchUse(
                workflow=p.workflow, patch=p.patch, at_step=p.at_step,
                total_with=have.total_with + p.total_with,
                live_with=have.live_with + p.live_with,
                live_without=have.live_without + p.live_without)
    return sorted(uses.values(), key=lambda p: (p.workflow, p.patch))

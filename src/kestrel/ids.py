"""Execution ids: UUIDv7 (RFC 9562), the first 48 bits the milliseconds since 1970, then the
version, 74 random bits and the variant.

Checkpoints are range-partitioned by execution id (migration 0019), so an id's time decides
which period's partition holds the execution's checkpoints; ids made by the database
(``new_execution_id()``) and by a client that chooses one (a fork, an HTTP submit) are made
the same way.
"""

from __future__ import annotations

import os
import time
import uuid


def new_id(now_ms: int | None = None, *, bucket: int | None = None) -> uuid.UUID:
    """A new UUIDv7 of *now_ms* (default: the wall clock); for a *bucket* of a namespace
    (:mod:`kestrel.buckets`), its eighth byte is the bucket."""
    ms = time.time_ns() // 1_000_000 if now_ms is None else now_ms
    rand = int.from_bytes(os.urandom(10), "big")
    value = (ms & 0xFFFF_FFFF_FFFF) << 80 | rand
    value = (value & ~(0xF << 76)) | (0x7 << 76)  # version 7
    value = (value & ~(0x3 << 62)) | (0x2 << 62)  # variant 10
    if bucket is not None:
        value = (value & ~(0xFF << 64)) | (bucket & 0xFF) << 64  # byte 7
    return uuid.UUID(int=value)


def created_ms(execution_id: uuid.UUID) -> int | None:
    """The milliseconds since 1970 a UUIDv7 was made at; None for any other version."""
    if execution_id.version != 7:
        return None
    return execution_id.int >> 80

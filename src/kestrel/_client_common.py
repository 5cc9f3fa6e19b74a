"""What the async and the sync client share: argument checks, error mapping, helpers.

Submit executions and talk to them: :class:`~kestrel.client.Client` (async) and
:class:`~kestrel.client.SyncClient`.

``submit`` calls the SQL function ``<schema>.submit`` in one statement. Pass ``conn=`` to run
it inside your own psycopg transaction: the execution then commits or rolls back with your
data. Without ``conn`` it commits before ``submit`` returns. ``signal``, ``cancel``,
``retry`` and ``fork`` call the SQL functions of the same names, so SQL, the CLI and Python
behave alike. ``result`` and ``get_event`` wait on LISTEN/NOTIFY with a polling fallback.
A submit made while an OpenTelemetry span is current carries that span's trace context, so
the execution's spans continue the caller's trace (:mod:`kestrel.tracing`).

A namespace spread over buckets (:mod:`kestrel.buckets`) is one client's too: its first call
reads the namespace's bucket count, a submit goes to the bucket :func:`kestrel.buckets.choose`
picks, a call about one execution to the bucket its id names, and the calls that read
everything (counts, list, stats, workers, unclaimable, patches) read every bucket and merge.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from kestrel import buckets, codec, metrics, statements, tracing
from kestrel.codec import DEFAULT_MAX_PAYLOAD_BYTES, QUEUE_NAME
from kestrel.definitions import WorkflowFn, workflow_name
from kestrel.errors import ConfigError, WorkflowFailed
from kestrel.sql import SCHEMA_NAME, SCHEMA_RULE, Queries, queries
from kestrel.types import Execution, Match, Status
from kestrel.versions import check_app_version

log = logging.getLogger("kestrel.client")

MAX_SECONDS = 3_155_760_000
"""Longest timeout or delay accepted (100 years), as in the SQL function."""

POLL_CAP_S = 1.0
"""Longest gap between checks while waiting, in case a notification is lost."""

RECONNECT_FIRST_S = 0.1
"""First pause before a wait reconnects after losing its connection (doubling to
:data:`POLL_CAP_S`)."""


def ident(execution_id: uuid.UUID | str) -> uuid.UUID:
    """Return *execution_id* as a UUID.

    Raises:
        ConfigError: it is not a UUID.
    """
    try:
        return uuid.UUID(str(execution_id))
    except ValueError:
        raise ConfigError(f"{execution_id!r} is not an execution id (a UUID)") from None


class ClientBase:
    """Shared set-up. Behind PgBouncer in transaction mode pass
    ``connection_mode="pgbouncer"`` (or set ``KESTREL_CONNECTION_MODE``): no prepared
    statements, and waits LISTEN only on ``listen_dsn`` (``KESTREL_LISTEN_DSN``), a direct
    connection, polling when there is none."""

    def __init__(self, dsn: str, *, schema: str = "kestrel",
                 max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES, pool_size: int = 4,
                 connection_mode: str | None = None, listen_dsn: str | None = None) -> None:
        if not SCHEMA_NAME.fullmatch(schema):
            raise ConfigError(f"invalid schema name {schema[:100]!r}: {SCHEMA_RULE}")
        if pool_size < 0:
            raise ConfigError("pool_size must not be negative")
        mode = connection_mode or os.environ.get("KESTREL_CONNECTION_MODE") or "direct"
        if mode not in ("direct", "pgbouncer"):
            raise ConfigError(f"connection_mode must be direct or pgbouncer, not {mode!r}")
        self.dsn = dsn
        self.schema = schema
        self._q = queries(schema)
        # The schemas of the namespace, by bucket (kestrel.buckets): [self._q] for an
        # ordinary schema; None until the first call reads it.
        self._qs: list[Queries] | None = None
        self._max_bytes = max_payload_bytes
        self._pool_size = pool_size
        self._pooler = mode == "pgbouncer"
        self._listen_dsn = (listen_dsn or os.environ.get("KESTREL_LISTEN_DSN")
                            or (None if self._pooler else dsn))
        # psycopg prepares a statement after 5 runs; a transaction-mode pooler can't route it.
        self._conn_kwargs: dict[str, Any] = {"autocommit": True}
        if self._pooler:
            self._conn_kwargs["prepare_threshold"] = None

    def _namespace_of(self, made: tuple[int, int] | None) -> list[Queries]:
        """The schemas by bucket, from what the schema's bucket table says (*made*): a
        namespace's bucket 0 names them all; any other schema (a bucket's own, addressed
        directly, or an ordinary one) is one schema."""
        names = buckets.served_by(self.schema, made)
        return [self._q] if len(names) == 1 else [queries(name) for name in names]

    @staticmethod
    def _by_id(qs: list[Queries], execution_id: uuid.UUID) -> Queries:
        """The schema of *execution_id*'s bucket."""
        return qs[buckets.bucket_of(execution_id, len(qs))] if len(qs) > 1 else qs[0]

    def _for_submit(self, qs: list[Queries], params: dict[str, Any]) -> int:
        """The bucket a top-level submit with *params* goes to (:func:`buckets.choose`); 0
        for an ordinary schema."""
        if len(qs) == 1:
            return 0
        return buckets.choose(len(qs), queue=params["queue"],
                              idempotency_key=params["idempotency_key"],
                              dedup_key=params["dedup_key"] or params["debounce_key"])

    @staticmethod
    def _queue_name(queue: object) -> str:
        """*queue*, checked as the SQL functions check a queue's name.

        Raises:
            ConfigError: not 1-128 of A-Z a-z 0-9 ``_ . : -``."""
        if not isinstance(queue, str) or not QUEUE_NAME.fullmatch(queue):
            raise ConfigError(f"invalid queue name {_shown(queue)}: 1-128 of A-Z a-z 0-9 "
                              "_ . : -")
        return queue

    def _submit_params(self, wf: WorkflowFn | str, args: tuple[Any, ...], queue: str,
                       priority: int, key: str | None, timeout: float | None,
                       delay: float | None = None, start_at: datetime | None = None,
                       dedup_key: str | None = None, on_duplicate: str = "return",
                       debounce: Debounce | None = None, *,
                       concurrency_key: str | None = None,
                       tags: dict[str, str] | None = None) -> dict[str, Any]:
        # The rules of the SQL function (sql/functions), checked here before a round trip.
        name = codec.check_text(workflow_name(wf), what="workflow name")
        self._queue_name(queue)
        if (isinstance(priority, bool) or not isinstance(priority, int)
                or not -(2**31) <= priority < 2**31):
            raise ConfigError(f"priority must be an integer in [-2^31, 2^31 - 1], got "
                              f"{_shown(priority)}")
        if timeout is not None and not 0 < timeout <= MAX_SECONDS:
            raise ConfigError(f"timeout must be positive and at most {MAX_SECONDS} seconds "
                              f"(100 years), got {timeout}")
        if delay is not None and start_at is not None:
            raise ConfigError("give delay or start_at, not both")
        if start_at is not None:
            if start_at.tzinfo is None:
                raise ConfigError("start_at must be timezone-aware")
            # Sent as it is (an idempotency key covers it as sent) and read by the database
            # clock; checked here against this machine's clock for the 100-year bound.
            ahead = (start_at - datetime.now(start_at.tzinfo)).total_seconds()
            if ahead > MAX_SECONDS:
                raise ConfigError(f"start_at must be at most {MAX_SECONDS} seconds (100 "
                                  f"years) ahead, got {start_at.isoformat()}")
        if delay is not None and not 0 <= delay <= MAX_SECONDS:
            raise ConfigError(f"delay must be between 0 and {MAX_SECONDS} seconds (100 "
                              f"years), got {delay}")
        if on_duplicate not in ("return", "reject"):
            raise ConfigError(f"on_duplicate must be return or reject, not "
                              f"{_shown(on_duplicate)}")
        if key is not None:
            codec.check_text(key, what="idempotency key")
        if dedup_key is not None:
            codec.check_text(dedup_key, what="dedup key")
        if debounce is not None:
            debounce.check(dedup_key=dedup_key, delay=delay, start_at=start_at)
        if concurrency_key is not None:
            codec.check_text(concurrency_key, what="concurrency key")
        if tags is not None:
            codec.check_tags(tags)
        encoded = codec.encode(list(args), what=f"arguments of workflow {name!r}",
                               max_bytes=self._max_bytes)
        # The current span's trace context, if any: the execution's spans continue it.
        trace = tracing.current()
        return statements.client.submit_params(
            workflow=name, args=encoded, queue=queue, priority=priority, idempotency_key=key,
            timeout_s=timeout, delay_s=delay, dedup_key=dedup_key, on_duplicate=on_duplicate,
            start_at=start_at, traceparent=trace[0] if trace else None,
            tracestate=trace[1] if trace else None,
            debounce_key=debounce.key if debounce else None,
            debounce_s=debounce.window if debounce else None,
            debounce_max_s=debounce.max_wait if debounce else None,
            concurrency_key=concurrency_key,
            tags=None if tags is None else codec.encode(tags, what="tags"))

    def _signal_params(self, execution_id: uuid.UUID | str, name: str, payload: Any,
                       key: str | None) -> dict[str, Any]:
        codec.check_text(name, what="signal name")
        if key is not None:
            codec.check_text(key, what="idempotency key")
        return {"id": ident(execution_id), "name": name, "idempotency_key": key,
                "payload": codec.encode(payload, what=f"payload of signal {name!r}",
                                        max_bytes=self._max_bytes)}


DEBOUNCE_MAX_S = 31_536_000
"""The longest debounce window or maximum wait: a year."""


@dataclass(frozen=True, slots=True)
class Debounce:
    """A debounced submit's key, window and maximum wait (seconds), as ``submit`` takes
    them (migration 0024: what debounce does)."""

    key: str | None
    window: float | None
    max_wait: float | None = None

    @classmethod
    def of(cls, key: str | None, window: float | None,
           max_wait: float | None) -> Debounce | None:
        """The debounce of a submit's arguments, or None when it gives none of them."""
        if key is None and window is None and max_wait is None:
            return None
        return cls(key, window, max_wait)

    def check(self, *, dedup_key: str | None, delay: float | None,
              start_at: datetime | None) -> None:
        """The rules of the SQL function, before a round trip.

        Raises:
            ConfigError: a key without a window or the other way round, a window or maximum
                wait out of range, or a dedup key, delay or start time as well.
            SerializationError: the key is empty, too long, or holds NUL or a lone surrogate.
        """
        if self.key is None or self.window is None:
            raise ConfigError("debounce takes a debounce key and a window (debounce "
                              "seconds), both")
        codec.check_text(self.key, what="debounce key")
        if (isinstance(self.window, bool) or not isinstance(self.window, int | float)
                or not 0 < self.window <= DEBOUNCE_MAX_S):
            raise ConfigError(f"debounce must be positive and at most {DEBOUNCE_MAX_S} "
                              f"seconds (a year), got {_shown(self.window)}")
        if self.max_wait is not None and (
                isinstance(self.max_wait, bool) or not isinstance(self.max_wait, int | float)
                or not self.window <= self.max_wait <= DEBOUNCE_MAX_S):
            raise ConfigError(f"debounce_max must be at least debounce and at most "
                              f"{DEBOUNCE_MAX_S} seconds, got {_shown(self.max_wait)}")
        if dedup_key is not None or delay is not None or start_at is not None:
            raise ConfigError("a debounced submit takes no dedup key, delay or start time: "
                              "its window is its delay")


def _shown(value: object) -> str:
    """*value* for an error message: printable whatever it holds, and short."""
    text = ascii(value)
    return text if len(text) <= 200 else text[:199] + "…"


def count_submitted(workflow: str) -> None:
    """Count a submission. Runs after the row committed, so it must never raise: a caller
    that retried on the error would submit the work twice (bug 18)."""
    try:
        metrics.get().submitted.labels(workflow).inc()
    except Exception:
        log.exception("could not count a submission of %r in the metrics", workflow)


def outcome(ex: Execution) -> Any:
    """Return the result of *ex*, a finished execution.

    Raises:
        WorkflowFailed: it ended failed, cancelled or quarantined.
    """
    if ex.status is Status.COMPLETED:
        return ex.result
    raise WorkflowFailed(ex.id, ex.status.value, (ex.error or {}).get("message", ex.error))


def remaining(deadline: float | None) -> float:
    """Return how long the next wait may last, in seconds.

    The time left until *deadline* (a ``time.monotonic()`` value; None: no deadline), at most
    :data:`POLL_CAP_S` and never negative.
    """
    if deadline is None:
        return POLL_CAP_S
    return max(0.0, min(POLL_CAP_S, deadline - time.monotonic()))




BULK_ACTIONS = ("cancel", "retry", "signal")
BULK_KEY_CHARS = 200
RETRYABLE = frozenset({"failed", "cancelled", "quarantined"})


def check_bulk(action: str, match: Match, key: str | None) -> str:
    """Refuse a bulk action that cannot run, before anything is read or written; return its
    key (*key*, or a new one to print: a run again with it acts on nothing twice).

    Raises:
        ConfigError: an unknown action or status, no filter at all, a filter or key that
            cannot be stored (NUL, lone surrogates, too long), or *since* after *until*.
    """
    if action not in BULK_ACTIONS:
        raise ConfigError(f"unknown bulk action {_shown(action)}; one of "
                          f"{', '.join(BULK_ACTIONS)}")
    if not match.given():
        raise ConfigError("a bulk action needs at least one filter (status, workflow, queue, "
                          "since, until, app version, patch or tag): it would act on every "
                          "execution")
    tag_filter(match.tags)
    if match.status is not None and match.status not in {s.value for s in Status}:
        raise ConfigError(f"unknown status {_shown(match.status)}; one of "
                          f"{', '.join(s.value for s in Status)}")
    for text, what in ((match.workflow, "workflow name"), (match.queue, "queue name"),
                       (match.patch, "patch id")):
        if text is not None:
            codec.check_text(text, what=what)
    if match.app_version is not None:
        check_app_version(match.app_version)
    if match.since is not None and match.until is not None and match.since >= match.until:
        raise ConfigError(f"since ({match.since.isoformat()}) must come before until "
                          f"({match.until.isoformat()})")
    if key is None:
        return uuid.uuid4().hex[:16]
    codec.check_text(key, what="bulk action key")
    if not key or len(key) > BULK_KEY_CHARS:
        raise ConfigError(f"a bulk action key has 1 to {BULK_KEY_CHARS} characters, not "
                          f"{len(key)}")
    return key


def match_params(match: Match) -> dict[str, Any]:
    """*match* as the list statements' filters (statements.http.page_executions)."""
    return {"status": match.status, "workflow": match.workflow, "queue": match.queue,
            "since": match.since, "until": match.until, "app_version": match.app_version,
            "patch": match.patch, "with_patch": match.with_patch,
            "tags": tag_filter(match.tags)}


def tag_filter(tags: object) -> str | None:
    """A tag filter (names to text: every one must match) as the list statements take it,
    JSON text, or None when there is none (None or empty).

    Raises:
        ConfigError, SerializationError: tags an execution could not carry
            (:func:`kestrel.codec.check_tags`), so none matches them.
    """
    if tags is None or tags == {}:
        return None
    return codec.encode(codec.check_tags(tags), what="tags")


def bulk_skip(action: str, status: str) -> str | None:
    """Why a bulk *action* passes over an execution in *status* without a call, or None."""
    if action == "cancel" and status in ("completed", "failed", "cancelled", "quarantined"):
        return f"already {status}"
    if action == "retry" and status not in RETRYABLE:
        return "not failed, cancelled or quarantined"
    if action == "signal" and status in ("completed", "failed", "cancelled", "quarantined"):
        return "finished"
    return None


def bulk_item_key(key: str, execution_id: uuid.UUID) -> str:
    """The idempotency key of one execution's retry or signal in the bulk action *key*."""
    return f"bulk:{key}:{execution_id}"

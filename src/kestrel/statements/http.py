"""The HTTP door's statements (``sql/queries/http.sql``): tokens, UI sessions, the reads
the API and the UI share, a fork's source, and webhook submits.

The server runs these with :func:`kestrel.db.run` on a pooled connection and the ``token``
commands with :func:`kestrel.db.run_sync`. Each read returns plain JSON-ready dicts, so the
API and the web UI render the same shapes.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from psycopg.types.json import Jsonb

from kestrel.sql import Queries
from kestrel.statements.stmt import Script, Stmt, first, nothing, tagged

Row = dict[str, Any]


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def create_token(q: Queries, *, id: str, name: str, scopes: Sequence[str],
                 secret_hash: bytes) -> Stmt[datetime | None]:
    """Store a new token (its secret only as a hash); its creation time. Sent again after a
    lost reply, it returns the stored token's time; None if *id* belongs to another token."""
    return Stmt(q.create_token, {"id": id, "name": name, "scopes": list(scopes),
                                 "secret_hash": secret_hash},
                lambda rows: rows[0][0] if rows else None)


def list_tokens(q: Queries) -> Stmt[list[Row]]:
    """Every token, revoked ones included, oldest first (never a secret or its hash)."""
    return Stmt(q.list_tokens, None, lambda rows: [
        {"id": r[0], "name": r[1], "scopes": list(r[2]), "created_at": _iso(r[3]),
         "revoked_at": _iso(r[4])} for r in rows])


def revoke_token(q: Queries, *, key: str) -> Stmt[list[str]]:
    """Revoke the live token whose id or name is *key*; the ids revoked."""
    return Stmt(q.revoke_token, {"key": key}, lambda rows: [r[0] for r in rows])


def get_token(q: Queries, *, id: str) -> Stmt[tuple[str, list[str], bytes] | None]:
    """A live token by public id: (name, scopes, secret hash), or None."""
    return Stmt(q.get_token, {"id": id},
                lambda rows: (rows[0][0], list(rows[0][1]), bytes(rows[0][2])) if rows
                else None)


def create_session(q: Queries, *, secret_hash: bytes, token_id: str,
                   ttl_s: float) -> Script[datetime | None]:
    """Store a UI session of live token *token_id* (its secret only as a hash) lasting
    *ttl_s* seconds; when it expires, or None when the token is no longer live."""
    live = yield Stmt(q.live_token, {"token_id": token_id}, lambda rows: bool(rows))
    if not live:
        return None
    expires: datetime = yield Stmt(q.create_session, {
        "secret_hash": secret_hash, "token_id": token_id, "ttl_s": ttl_s}, first)
    return expires


def get_session(q: Queries, *, secret_hash: bytes,
                ) -> Stmt[tuple[str, str, list[str]] | None]:
    """A live session by the hash of its secret: its token's (id, name, scopes), or None
    (no such session, expired, logged out, or its token revoked)."""
    return Stmt(q.get_session, {"secret_hash": secret_hash},
                lambda rows: (rows[0][0], rows[0][1], list(rows[0][2])) if rows else None)


def end_session(q: Queries, *, secret_hash: bytes) -> Stmt[None]:
    """Delete a UI session (logout); nothing when it is already gone."""
    return Stmt(q.end_session, {"secret_hash": secret_hash}, nothing)


def end_token_sessions(q: Queries, *, token_id: str) -> Stmt[None]:
    """Delete every UI session of token *token_id* (log out everywhere)."""
    return Stmt(q.end_token_sessions, {"token_id": token_id}, nothing)


def _summary(r: Sequence[Any]) -> Row:
    # claims: every time a worker took it (its lease epoch); attempts: the claims since it
    # last parked, which --max-attempts counts (0 for one that ran and now waits).
    return {"id": str(r[0]), "workflow": r[1], "queue": r[2], "status": r[3],
            "claims": r[9], "attempts": r[4], "created_at": _iso(r[5]),
            "finished_at": _iso(r[6]), "parent_id": str(r[7]) if r[7] else None,
            "app_version": r[8], "tags": r[10] or {}}


def page_executions(q: Queries, *, status: str | None, workflow: str | None,
                    queue: str | None, since: datetime | None, until: datetime | None,
                    after: tuple[datetime, uuid.UUID] | None, limit: int,
                    app_version: str | None = None, patch: str | None = None,
                    with_patch: bool = True, tags: str | None = None,
                    ) -> Stmt[list[tuple[Row, datetime]]]:
    """One page of executions, newest first, after the keyset *after*: each row with its
    exact ``created_at`` (the next cursor is made of the last one's). *app_version*,
    *patch* / *with_patch* and *tags* (a JSON object as text: every tag must match) filter
    as ``list`` does."""
    return Stmt(tagged(q.page_executions, tags), {
        **_filters(status, workflow, queue, since, until, app_version, patch, with_patch,
                   tags),
        "after_at": after[0] if after else None,
        "after_id": after[1] if after else None, "limit": limit,
    }, lambda rows: [(_summary(r), r[5]) for r in rows])


def count_executions(q: Queries, *, status: str | None, workflow: str | None,
                     queue: str | None, since: datetime | None, until: datetime | None,
                     app_version: str | None = None, patch: str | None = None,
                     with_patch: bool = True, tags: str | None = None) -> Stmt[int]:
    """How many executions, live and finished, :func:`page_executions`' filters match."""
    return Stmt(tagged(q.count_executions, tags), {
        **_filters(status, workflow, queue, since, until, app_version, patch, with_patch,
                   tags),
        "after_at": None, "after_id": None,
    }, lambda rows: int(rows[0][0]))


def _filters(status: str | None, workflow: str | None, queue: str | None,
             since: datetime | None, until: datetime | None, app_version: str | None,
             patch: str | None, with_patch: bool, tags: str | None) -> dict[str, Any]:
    return {"status": status, "workflow": workflow, "queue": queue, "since": since,
            "until": until, "app_version": app_version, "patch": patch,
            "with_patch": with_patch, "tags": tags}


def get_wait(q: Queries, *, id: uuid.UUID) -> Stmt[Row | None]:
    """What an execution waits for, its deadline, its parent, whether a cancel is pending
    and the app version that claimed it; None when there is no such execution."""

    def decode(rows: list[tuple[Any, ...]]) -> Row | None:
        if not rows:
            return None
        status, waiting_for, wait_deadline, wake_at, deadline, parent, cancel, version = rows[0]
        waiting = None
        if status == "waiting" and waiting_for is not None:
            kind, _, name = str(waiting_for).partition(":")
            if kind == "kestrel.child":
                waiting = {"kind": "child", "child_id": name, "until": _iso(wait_deadline)}
            elif waiting_for == "kestrel.sleep":
                waiting = {"kind": "sleep", "until": _iso(wake_at)}
            else:
                waiting = {"kind": "signal", "signal": waiting_for,
                           "until": _iso(wait_deadline)}
        elif status == "waiting":
            waiting = {"kind": "sleep", "until": _iso(wake_at)}
        return {"waiting": waiting, "deadline": _iso(deadline),
                "parent_id": str(parent) if parent else None,
                "cancel_requested": bool(cancel), "app_version": version}

    return Stmt(q.get_wait, {"id": id}, decode)


def list_events(q: Queries, *, id: uuid.UUID) -> Stmt[list[Row]]:
    """The events an execution published (latest value of each key)."""
    return Stmt(q.list_events, {"id": id}, lambda rows: [
        {"key": r[0], "value": r[1], "updated_at": _iso(r[2])} for r in rows])


def pending_signals(q: Queries, *, id: uuid.UUID) -> Stmt[list[Row]]:
    """Signals sent to an execution and not consumed yet, oldest first."""
    return Stmt(q.pending_signals, {"id": id}, lambda rows: [
        {"seq": r[0], "name": r[1], "payload": r[2], "sent_at": _iso(r[3])} for r in rows])


def list_children(q: Queries, *, id: uuid.UUID) -> Stmt[list[Row]]:
    """An execution's child executions, live and finished, oldest first."""
    return Stmt(q.list_children, {"id": id}, lambda rows: [
        {"id": str(r[0]), "workflow": r[1], "status": r[2], "created_at": _iso(r[3]),
         "finished_at": _iso(r[4])} for r in rows])


def list_queue_limits(q: Queries) -> Stmt[dict[str, Row]]:
    """The declared limits of each limited queue."""
    return Stmt(q.list_queue_limits, None, lambda rows: {
        r[0]: {"concurrency": r[1], "rate": r[2],
               "period_s": float(r[3]) if r[3] is not None else None, "per_key": r[4]}
        for r in rows})


def list_schedules(q: Queries) -> Stmt[list[Row]]:
    """Every registered cron schedule with its last tick."""
    return Stmt(q.list_schedules, None, lambda rows: [
        {"name": r[0], "cron": r[1], "workflow": r[2], "last_tick": _iso(r[3]),
         "updated_at": _iso(r[4])} for r in rows])


def signal_sent(q: Queries, *, id: uuid.UUID, key: str) -> Stmt[bool]:
    """Whether a signal with idempotency key *key* reached execution *id*."""
    return Stmt(q.signal_sent, {"id": id, "key": key}, lambda rows: bool(rows[0][0]))


def hook_submit(q: Queries, *, workflow: str, body: bytes, envelope: str | None,
                queue: str, key: str, max_bytes: int,
                trace: tuple[str, str | None] | None = None) -> Stmt[uuid.UUID]:
    """Start a webhook's execution, idempotent by *key*; its id. Its one argument is
    *body* (JSON text, sent as is and parsed by PostgreSQL, so no Python object tree is
    built for it) or, with *envelope* (a JSON object, as text), that object with *body* as
    its ``payload``. The SQL cap on the arguments is *max_bytes* for this statement only.
    *trace* is the request's checked W3C trace context (traceparent, tracestate), if any.

    Raises (from :func:`kestrel.db.run`):
        IdempotencyConflict: *key* started an execution with other arguments.
        PayloadTooLarge, SerializationError: the arguments break the rules of ``submit``.
        psycopg.errors.DataError: *body* is not one JSON value PostgreSQL can store.
    """
    return Stmt(q.hook_submit, {"workflow": workflow, "arg": Jsonb(body, dumps=_as_is),
                                "envelope": envelope, "queue": queue,
                                "idempotency_key": key, "max_bytes": str(max_bytes),
                                "traceparent": trace[0] if trace else None,
                                "tracestate": trace[1] if trace else None},
                lambda rows: rows[0][0], key)


def _as_is(data: Any) -> Any:
    return data

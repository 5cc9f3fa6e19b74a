"""What a statement is: :class:`Stmt` and :class:`Script` values, and what builders share.

A Stmt is one named statement of ``sql/queries`` with its parameters and the function that
turns its rows into a result. It does no I/O: :func:`kestrel.db.run` executes it on an async
connection and :func:`kestrel.db.run_sync` on a blocking one, so every caller (the worker's
hot path, both clients, the HTTP door, the CLI, the test kit) shares one definition of each
statement. A Script is several statements in one transaction.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import orjson

if TYPE_CHECKING:
    from kestrel.types import StepWrite

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


@dataclass(frozen=True, slots=True)
class Stmt(Generic[T_co]):
    """A statement, its parameters and how its rows become a result.

    *decode* is given the rows as tuples, or as dicts by column name when *by_name* is set.
    *key* is the idempotency key, for IdempotencyConflict's message. *if_recorded* is the
    statement sent instead, with the same parameters, when this one fails with
    unique_violation (a plain INSERT that met a row a lost reply had already written).
    """

    query: str
    params: Mapping[str, Any] | None
    decode: Callable[[list[Any]], T_co]
    key: str | None = None
    by_name: bool = False
    if_recorded: str | None = None


Script = Generator[Stmt[Any], Any, T]
"""Several statements in one transaction: a generator that yields each Stmt and is sent its
result, so one definition serves both sides (see :func:`kestrel.db.run_script`)."""


ANY_TAGS = "(%(tags)s::jsonb IS NULL OR tags @> %(tags)s::jsonb)"
"""How the list statements say their tag filter (sql/fragments/list.sql, client.sql)."""


def tagged(query: str, tags: str | None) -> str:
    """*query*, saying only ``tags @> …`` when *tags* filters: its text is then its own, and
    a prepared statement's generic plan, which has to serve every value, can still read
    the tags' GIN index (it cannot through ``… IS NULL OR``)."""
    if tags is None:
        return query
    if ANY_TAGS not in query:
        raise AssertionError("a list statement without the tag filter's text")
    return query.replace(ANY_TAGS, "(tags @> %(tags)s::jsonb)")


def first(rows: list[tuple[Any, ...]]) -> Any:
    """The first column of the first row, or None when there is no row."""
    return rows[0][0] if rows else None


def nothing(_rows: list[Any]) -> None:
    """A result nobody needs."""
    return None


def command(query: str, params: Mapping[str, Any] | None = None) -> Stmt[None]:
    """A statement whose rows, if any, are not needed (LISTEN, an upsert, DDL)."""
    return Stmt(query, params, nothing)


def value(query: str, params: Mapping[str, Any], *, key: str | None = None) -> Stmt[Any]:
    """One call of a kestrel SQL function (submit, signal, cancel, retry, fork): its value."""
    return Stmt(query, params, first, key)


def wrapped(encoded: str | None) -> list[orjson.Fragment] | None:
    """An output or error already encoded as JSON, embedded as is, in a one-element array
    (None stays SQL NULL; a step that returned None is ``[null]``)."""
    return None if encoded is None else [orjson.Fragment(encoded)]


def checkpoint_fields(w: StepWrite, now: float) -> list[Any]:
    """A checkpoint as the batched writes carry it after its execution and epoch: position,
    step name, output and error (:func:`wrapped`), attempt, the seconds since its body
    started and ended at *now* (``time.monotonic()``), which the database subtracts from its
    own clock, and the failed tries before the outcome (a JSON array, or null). One layout
    for a checkpoint batch's rows (``save_steps``) and a completion's tail
    (``complete_batch``)."""
    waited = max(0.0, now - w.ended_at)
    return [w.step_id, w.name, wrapped(w.output), wrapped(w.error), w.attempt,
            w.ran_s + waited, waited, None if w.tries is None else orjson.Fragment(w.tries)]


def json_rows(rows: Iterable[list[Any]]) -> str:
    """Rows of a batch as one JSON array, the single parameter of the batched writes
    (``jsonb_array_elements`` unpacks it): orjson builds it in a few µs where psycopg took
    ~10 µs a row to dump one array per column. Text that cannot be encoded (a lone
    surrogate) is a UnicodeError, as psycopg's own refusal was, so a group commit isolates
    the item that holds it (:func:`kestrel.connections.is_data_error`)."""
    try:
        return orjson.dumps(list(rows)).decode()
    except orjson.JSONEncodeError as exc:
        raise UnicodeError(f"a value of this batch cannot be sent: {exc}") from exc

"""JSON encoding of arguments, step outputs and results.

Values are stored as ``jsonb``. A value is accepted only if it survives the trip: orjson
rejects sets, arbitrary objects, lone surrogates, integers beyond 64 bits and nesting deeper
than its limit; this module also rejects what orjson would silently change (``NaN`` and
``±Infinity`` become ``null``) and what ``jsonb`` refuses (``\\u0000`` in a string), and
anything over the size cap. The check happens before anything is written.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import orjson

from kestrel.errors import PayloadTooLarge, SerializationError

DEFAULT_MAX_PAYLOAD_BYTES = 16 * 1024 * 1024
"""Largest encoded argument list, step output or result accepted (16 MiB)."""

MAX_HISTORY_BYTES = 128 * 1024 * 1024
"""Default bound on the recorded checkpoints one claim loads per execution (128 MiB)."""

# orjson writes U+0000 as \u0000; a literal backslash before "u0000" is written as \\u0000.
# A NUL is an escape preceded by an even number (zero included) of backslashes.
_NUL = re.compile(rb"(?<!\\)(?:\\\\)*\\u0000")
# Refuse instead of silently converting: a datetime or dataclass would come back as a string
# or a dict, so a replay would not return what the live run was given.
_STRICT = (
    orjson.OPT_PASSTHROUGH_DATETIME
    | orjson.OPT_PASSTHROUGH_DATACLASS
    | orjson.OPT_PASSTHROUGH_SUBCLASS
)


def encode(value: Any, *, what: str, max_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> str:
    """Return *value* as JSON text ready for a ``jsonb`` parameter.

    *what* names the value in errors ("arguments of workflow 'x'", "output of step 'y'").

    Raises:
        SerializationError: the value would not read back unchanged.
        PayloadTooLarge: the encoding is longer than *max_bytes*.
    """
    try:
        data = orjson.dumps(value, option=_STRICT)
    except (TypeError, orjson.JSONEncodeError) as exc:
        raise SerializationError(f"{what} is not JSON-serializable: {exc}") from None
    if len(data) > max_bytes:
        raise PayloadTooLarge(
            f"{what} is {len(data)} bytes encoded, over the cap of {max_bytes} bytes"
        )
    if b"u0000" in data and _NUL.search(data):
        raise SerializationError(
            f"{what} contains a NUL character (\\u0000), which PostgreSQL jsonb cannot store"
        )
    # orjson writes NaN and ±Infinity as null: a value that changes on the way in must be
    # refused, not stored. Only floats can do that, so only look when a null was written.
    if b"null" in data:
        bad = _find_non_finite(value)
        if bad is not None:
            raise SerializationError(f"{what} contains {bad}, which JSON cannot represent")
    return data.decode()


QUEUE_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
"""Every queue name, at every door: the SQL function submit() holds the same rule
(``valid_queue_name`` in sql/functions)."""

MAX_NAME_CHARS = 1024
"""Longest name (signal, event key, step, workflow) or key accepted at any door."""

MAX_NAME_BYTES = 2048
"""Most UTF-8 bytes in a name or key: several are indexed, and a btree entry holds at most
2704 bytes, so a longer one would be accepted at the door and fail later in a batch."""


def check_text(text: object, *, what: str, max_chars: int = MAX_NAME_CHARS) -> str:
    """Return *text* if PostgreSQL can store it as ``text`` unchanged; raise otherwise.

    Every door (client, SQL, CLI, ``ctx`` calls) checks names with this before anything is
    sent, so one bad name fails only its own call, never a batch it would have shared. The
    SQL functions apply the same rule (``check_name`` in sql/functions).

    Raises:
        SerializationError: not a string, empty, too long (characters, or bytes of UTF-8
            beyond :data:`MAX_NAME_BYTES`), a NUL character or a lone surrogate (neither
            can be stored in a UTF-8 database).
    """
    if not isinstance(text, str):
        raise SerializationError(f"{what} must be a string, got {type(text).__name__}")
    if not text:
        raise SerializationError(f"{what} must not be empty")
    if len(text) > max_chars:
        raise SerializationError(f"{what} is {len(text)} characters, over the limit of "
                                 f"{max_chars}")
    if "\x00" in text:
        raise SerializationError(f"{what} contains a NUL character, which PostgreSQL text "
                                 "cannot store")
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise SerializationError(f"{what} contains a lone surrogate, which is not valid "
                                 "UTF-8") from None
    if size > MAX_NAME_BYTES:
        raise SerializationError(f"{what} is {size} bytes as UTF-8, over the limit of "
                                 f"{MAX_NAME_BYTES}")
    return text


def printable(text: str, limit: int = 65536) -> str:
    """Return *text* made storable (no NUL, no lone surrogates) and at most *limit* chars.

    For error messages and tracebacks, which must always be recordable.
    """
    text = text.replace("\x00", "\\x00")
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def decode(data: str | bytes) -> Any:
    """Parse JSON text read from the database."""
    return orjson.loads(data)


# A run of 19 digits is the shortest that can leave orjson's integers (below -2**63).
_LONG_DIGITS = re.compile(rb"\d{19,}")


def decode_exact(data: str) -> Any:
    """Parse JSON text that may not have been written by this codec (arguments submitted
    through SQL) and refuse what would not decode unchanged: numbers beyond double range
    (orjson raises) and integers beyond 64 bits that a double cannot hold exactly (orjson
    would round them silently). ``1e20``, which jsonb stores as a 21-digit integer, is
    exact and accepted.

    Raises:
        ValueError: the text holds such a number (orjson.JSONDecodeError is a ValueError).
    """
    value = orjson.loads(data)
    if _LONG_DIGITS.search(data.encode()):
        json.loads(data, parse_int=_exact_int)  # the slow check, only when it can matter
    return value


def _exact_int(text: str) -> int:
    n = int(text)
    if (n >= 2**64 and float(n) != n) or (n < -(2**63) and float(n) != n):
        raise ValueError(f"the integer {text[:40]} has more than 64 bits and no exact double")
    return n


def _find_non_finite(value: Any) -> str | None:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, float):
            if not math.isfinite(item):
                return repr(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return None

"""JSON encoding of arguments, step outputs and results.

Values are stored as ``jsonb``. A value is accepted only if it survives the trip: orjson
rejects sets, arbitrary objects, lone surrogates, integers beyond 64 bits and nesting deeper
than its limit; this module also rejects what orjson would silently change (``NaN`` and
``±Infinity`` become ``null``), what ``jsonb`` would (``-0.0`` becomes ``0.0``) and what it
refuses (``\\u0000`` in a string), and anything over the size cap. The check happens before
anything is written.

JSON text from elsewhere (HTTP bodies and webhooks, the CLI's ``--args``, arguments submitted
through SQL) is read with :func:`decode_exact`, which holds the one number rule of every door:
a number is accepted only if orjson reads it and writes the same number back (the SQL
function ``number_reads_back`` holds the same rule for the SQL door).
"""

from __future__ import annotations

import json
import math
import re
from decimal import Decimal
from typing import Any

import orjson

from kestrel.errors import ConfigError, PayloadTooLarge, SerializationError

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
    # orjson writes NaN and ±Infinity as null, and jsonb stores -0.0 as 0.0: a value that
    # changes on the way in must be refused, not stored. Only floats can do that, so only
    # look when a null or a -0.0 was written.
    if b"null" in data or b"-0.0" in data:
        bad = _find_unstorable(value)
        if bad is not None:
            raise SerializationError(f"{what} contains {bad}, which JSON cannot represent"
                                     if bad != "-0.0" else
                                     f"{what} contains -0.0, which is stored as 0.0 (jsonb "
                                     "has one zero); add 0.0 to it to store 0.0")
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


MAX_TAGS = 32
"""The most tags one execution carries."""

TAG_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
"""A tag's name (migration 0025; ``check_tags`` in sql/functions is the same rule)."""

MAX_TAG_VALUE_CHARS = 256


def check_tags(tags: object, *, what: str = "tags", removals: bool = False
               ) -> dict[str, str]:
    """Return *tags* (names to text) if an execution may carry them; raise otherwise.

    At most :data:`MAX_TAGS`, each name 1-64 of ``A-Z a-z 0-9 _ . -`` and each value text
    of 1-256 characters that PostgreSQL can store (:func:`check_text`). With *removals*
    (``ctx.set_tags``' changes) a value may also be None: that tag is removed.

    Raises:
        ConfigError: not a mapping, too many, or a name that breaks the rule.
        SerializationError: a value that is not text, is empty or too long, or holds NUL or
            a lone surrogate.
    """
    if not isinstance(tags, dict):
        raise ConfigError(f"{what} must be a dict of names to text, got {type(tags).__name__}")
    if len(tags) > MAX_TAGS:
        raise ConfigError(f"at most {MAX_TAGS} {what}, got {len(tags)}")
    for name, value in tags.items():
        if not isinstance(name, str) or not TAG_NAME.fullmatch(name):
            raise ConfigError(f"invalid tag name {printable(ascii(name), 80)}: 1-64 of "
                              "A-Z a-z 0-9 _ . -")
        if value is None and removals:
            continue
        check_text(value, what=f"tag {name!r}", max_chars=MAX_TAG_VALUE_CHARS)
    return tags


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


def stored(text: str) -> Any:
    """The value that reading *text* back from a ``jsonb`` column gives, without the trip:
    what :func:`decode` returns for the text PostgreSQL writes out for what :func:`encode`
    wrote. ``jsonb`` orders an object's keys by their length in UTF-8 bytes, then bytewise,
    and writes a number in exponent form with no digits after the point once its exponent
    is applied (``1e+16``) as plain digits, which read as an integer within 64 bits and as
    a float beyond; everything else reads back as it was written.

    A worker hands this value to the workflow for a checkpoint whose write it defers to the
    next call or to the completion (``kestrel.workflow.steps``), so the live run sees what
    a replay will. ``tests/integration/test_tail.py`` holds it against a real ``jsonb``.
    """
    if "{" not in text and not _EXPONENT.search(text.encode()):
        return orjson.loads(text)
    return json.loads(text, parse_float=_stored_float, object_pairs_hook=_stored_object)


def _stored_float(text: str) -> Any:
    if "e" in text or "E" in text:
        number = Decimal(text)
        exponent = number.as_tuple().exponent
        if isinstance(exponent, int) and exponent >= 0:
            return orjson.loads(str(int(number)))  # the digits jsonb writes, read as orjson does
    return float(text)


def _stored_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    ordered = sorted(((key.encode(), key, value) for key, value in pairs),
                     key=lambda item: (len(item[0]), item[0]))
    return {key: value for _, key, value in ordered}


# Where a number may not read back unchanged: a run of 16 or more digits (and points), an
# exponent, or a negative zero. Numbers without any of these (at most 15 significant digits,
# between 1e-15 and 1e15) always do, so most text is read by orjson alone.
_LONG_RUN = re.compile(rb"[0-9.]{16,}")
_EXPONENT = re.compile(rb"[0-9][eE]")
_NEGATIVE_ZERO = re.compile(rb"-0(?:\.0*)?(?![0-9.eE])")

NUMBER_RULE = ("integers must lie in [-2^63, 2^64 - 1], other numbers must be finite float64 "
               "values in their shortest form")
"""The one number rule of every door, as its refusals state it."""


def decode_exact(data: str | bytes) -> Any:
    """Parse JSON text that was not written by this codec (HTTP bodies and webhooks, the
    CLI's ``--args`` and ``--payload``, arguments submitted through SQL) and refuse any
    number that orjson would not write back as the same number: an integer beyond
    [-2^63, 2^64 - 1] that is not a float64 in its shortest form (2^64, 2^70), digits a
    float64 cannot hold (0.12345678901234567890, 1.0000000000000000000001), underflow
    (1e-400) and overflow (1e400). ``1e20`` and ``18446744073709552000`` are accepted: each
    is the float64 it reads as, written in its shortest form. Numbers read as jsonb stores
    them: one with no digits after the point once its exponent is applied (``1e2``,
    ``1.5e1``) is an integer, and a negative zero (``-0.0``) is ``0.0``.

    The SQL function ``number_reads_back`` (sql/functions) holds exactly the same rule, so
    what one door accepts every door accepts, and the worker decodes it unchanged.

    Raises:
        ValueError: the text is not JSON or holds such a number (orjson.JSONDecodeError is
            a ValueError).
        RecursionError: nested too deeply for the exact check.
    """
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        if "infinity" not in str(exc):
            raise
        raise ValueError(f"a number is beyond a float64 ({exc}): {NUMBER_RULE}") from None
    raw = data.encode() if isinstance(data, str) else data
    if _suspect(raw):  # the slow check, only when it can matter
        return json.loads(raw, parse_int=_exact_number, parse_float=_exact_number,
                          parse_constant=_no_constant)
    return value


def _suspect(raw: bytes) -> bool:
    if (b"e" in raw or b"E" in raw) and _EXPONENT.search(raw):
        return True
    if b"-0" in raw and _NEGATIVE_ZERO.search(raw):
        return True
    for match in _LONG_RUN.finditer(raw):
        run = match.group()
        # 16 to 18 digits alone: an integer within 64 bits, read exactly.
        if len(run) > 18 or not run.isdigit():
            return True
    return False


def _exact_number(text: str) -> int | float:
    # Read as jsonb stores it: a number with no digits after the point once its exponent is
    # applied (12, 1e2, 1.5e1) is an integer, exact within 64 bits; any other is a float64.
    if "e" in text or "E" in text:
        number = Decimal(text)
        exponent = number.as_tuple().exponent
        if isinstance(exponent, int) and exponent >= 0 and -(2**63) <= number <= 2**64 - 1:
            return int(number)
    elif "." not in text and len(text) <= 20 and -(2**63) <= (n := int(text)) <= 2**64 - 1:
        return n
    value = float(text)  # correctly rounded, as orjson reads it
    if math.isfinite(value):
        written = orjson.dumps(value).decode()
        if written == text or Decimal(written) == Decimal(text):
            return value + 0.0  # -0.0 reads as 0.0, as jsonb stores it
    shown = text if len(text) <= 40 else f"{text[:20]}…{text[-12:]} ({len(text)} chars)"
    raise ValueError(f"the number {shown} would not read back unchanged: {NUMBER_RULE}")


def _no_constant(text: str) -> Any:
    raise ValueError(f"{text} is not JSON")


def _find_unstorable(value: Any) -> str | None:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, float):
            if not math.isfinite(item):
                return repr(item)
            if item == 0.0 and math.copysign(1.0, item) < 0:
                return "-0.0"
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return None

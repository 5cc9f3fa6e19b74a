"""kestrel.codec: values are stored only if they read back unchanged."""

from __future__ import annotations

import dataclasses
import datetime

import pytest

from kestrel import codec
from kestrel.errors import PayloadTooLarge, SerializationError

WHAT = "output of step 'canary-step'"


@dataclasses.dataclass
class Point:
    x: int
    y: int


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        0,
        -(2**63),
        2**63 - 1,
        1.5,
        "",
        "héllo ✓ 🐦",
        [],
        {},
        [1, "two", None, 3.25, {"nested": [True, False]}],
        {"a": {"b": {"c": [1, 2, 3]}}, "s": "x"},
    ],
)
def test_round_trip(value: object) -> None:
    text = codec.encode(value, what=WHAT)
    assert isinstance(text, str)
    assert codec.decode(text) == value
    assert codec.decode(text.encode()) == value


def test_tuple_reads_back_as_list() -> None:
    assert codec.decode(codec.encode((1, 2), what=WHAT)) == [1, 2]


def _deep_list(depth: int) -> list[object]:
    value: list[object] = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    "value",
    [
        {1, 2},
        float("nan"),
        float("inf"),
        float("-inf"),
        {"a": {"b": float("nan")}},
        [1, [2, float("inf")]],
        {"k": [float("-inf")]},
        "before\u0000after",
        {"key": ["x\u0000"]},
        "escaped backslash then NUL \\\u0000",
        object(),
        datetime.datetime(2024, 1, 1, tzinfo=datetime.UTC),
        Point(1, 2),
        "\ud800",
        2**64 + 1,
        _deep_list(10_000),
    ],
    ids=[
        "set", "nan", "inf", "-inf", "nan-in-dict", "inf-in-list", "-inf-in-dict-list",
        "nul", "nested-nul", "backslash-nul", "object", "datetime", "dataclass",
        "lone-surrogate", "big-int", "deep-nesting",
    ],
)
def test_rejects_values_that_would_not_read_back(value: object) -> None:
    with pytest.raises(SerializationError) as info:
        codec.encode(value, what=WHAT)
    assert not isinstance(info.value, PayloadTooLarge)
    assert WHAT in str(info.value)


def test_payload_over_cap_is_rejected() -> None:
    value = "x" * 100  # encodes to 102 bytes with the quotes
    with pytest.raises(PayloadTooLarge) as info:
        codec.encode(value, what=WHAT, max_bytes=101)
    assert WHAT in str(info.value)
    assert "101" in str(info.value)
    assert isinstance(info.value, SerializationError)


def test_payload_at_and_just_below_cap_is_accepted() -> None:
    value = "x" * 100
    assert codec.encode(value, what=WHAT, max_bytes=102) == f'"{value}"'
    assert codec.encode(value, what=WHAT, max_bytes=103) == f'"{value}"'


def test_text_null_without_nan_is_accepted() -> None:
    value = {"note": "null", "none": None, "list": ["nullable", 1.0]}
    assert codec.decode(codec.encode(value, what=WHAT)) == value


@pytest.mark.parametrize("value", ["C:\\u0000dir", "\\\\u0000", {"regex": "\\\\\\u0000x"}])
def test_literal_backslash_u0000_text_is_not_a_nul(value: object) -> None:
    assert codec.decode(codec.encode(value, what=WHAT)) == value


@pytest.mark.parametrize(("text", "ok"), [
    ("x" * codec.MAX_NAME_CHARS, True), ("x" * (codec.MAX_NAME_CHARS + 1), False),
    ("é" * 1024, True), ("😀" * 512, True), ("😀" * 513, False), ("", False),
    ("a\x00b", False), ("\ud800", False), ("'); DROP TABLE x; --", True),
])
def test_check_text_limits_characters_and_utf8_bytes(text: str, ok: bool) -> None:
    if ok:
        assert codec.check_text(text, what="name") == text
    else:
        with pytest.raises(SerializationError):
            codec.check_text(text, what="name")


# -- issue 26: one number rule for text from every door --------------------------------------

@pytest.mark.parametrize("text", [
    str(2**64), str(2**70), str(-(2**64)), "0.12345678901234567890", "1e-400",
    "1.0000000000000000000001", "9007199254740993.0", "1e400", "-1e400", "2e-324",
    "18446744073709551617", "1234567890123456789e-5",
])
def test_decode_exact_refuses_numbers_that_would_not_read_back(text: str) -> None:
    """Before the fix 2^64 and 2^70 were read as floats (and failed in the worker), and the
    decimals were rounded (1e-400 to 0.0)."""
    for body in (f"[{text}]", f'{{"args": [{{"deep": [{text}]}}]}}'):
        with pytest.raises(ValueError):
            codec.decode_exact(body)


@pytest.mark.parametrize(("text", "value"), [
    ("18446744073709552000", 1.8446744073709552e19),  # 2^64's float64, shortest form
    ("18446744073709551615", 2**64 - 1), ("-9223372036854775808", -(2**63)),
    ("1e20", 1e20), ("1e23", 1e23), ("5e-324", 5e-324), ("0.30000000000000004", 0.1 + 0.2),
    ("1E2", 100), ("1.5e1", 15), ("1.50e1", 15.0), ("123456789012345678", 123456789012345678),
])
def test_decode_exact_reads_numbers_as_jsonb_stores_them(text: str, value: object) -> None:
    got = codec.decode_exact(f"[{text}]")[0]
    assert got == value and type(got) is type(value)


def test_negative_zero_reads_as_zero_and_is_refused_when_encoded() -> None:
    """jsonb has one zero: text -0.0 reads as 0.0 (what the worker will see); a Python -0.0
    cannot be stored as itself, so it is refused, like NaN."""
    got = codec.decode_exact('[-0.0, -0, "-0.0"]')
    assert got == [0.0, 0, "-0.0"] and str(got[0]) == "0.0"
    with pytest.raises(SerializationError, match=r"-0\.0"):
        codec.encode([1, {"x": -0.0}], what=WHAT)
    assert codec.encode([0.0, "-0.0", -0.5], what=WHAT) == '[0.0,"-0.0",-0.5]'

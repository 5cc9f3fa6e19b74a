"""App versions: the default hash and the setting's rule (no database)."""

from __future__ import annotations

import pytest

from kestrel.config import Config
from kestrel.errors import ConfigError
from kestrel.versions import check_app_version, code_version, resolve_app_version


async def wf_a(ctx: object) -> int:
    return 1


async def wf_b(ctx: object) -> int:
    return 2


def test_the_default_version_is_a_stable_hash_of_the_workflows_code() -> None:
    v = code_version({"a": wf_a, "b": wf_b})
    assert v == code_version({"b": wf_b, "a": wf_a})  # order of registration does not matter
    assert v.startswith("code-") and len(v) == 17
    assert code_version({"a": wf_b, "b": wf_a}) != v  # other code under the same names
    assert code_version({"a": wf_a}) != v
    assert check_app_version(v) == v


def test_a_configured_version_wins_over_the_hash() -> None:
    assert resolve_app_version(Config(app_version="2026.11.30+abc"), {"a": wf_a}
                               ).app_version == "2026.11.30+abc"
    assert resolve_app_version(Config(), {"a": wf_a}).app_version == code_version({"a": wf_a})


@pytest.mark.parametrize("bad", ["v1\x00", "v\ud800", "x" * 129, "v1; DROP TABLE x", "v 1",
                                 "é"])
def test_a_hostile_app_version_is_refused_with_one_line(bad: str) -> None:
    with pytest.raises(ConfigError, match="--app-version") as info:
        Config(app_version=bad)
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="invalid app version"):
        check_app_version(bad)

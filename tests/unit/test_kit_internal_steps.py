"""The internal step names a timeline holds, listed once: the manual's table (docs/tutorials/
testing.md, "Testing your workflows"; the README before it), the kit's
``INTERNAL_STEPS`` and the names the workflow context writes are the same set, so a new
``ctx`` call that records a step cannot go unnamed (issue 27: the first ``assert_timeline``
failed on ``kestrel.now`` and ``kestrel.set_event:KEY``, which the README never named)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from kestrel.testing import INTERNAL_STEPS, Run, is_internal

ROOT = Path(__file__).resolve().parents[2]
TESTING = ROOT / "docs" / "tutorials" / "testing.md"  # where the README's table moved
# The Context, in the modules it is put together from (the kestrel/workflow package).
CONTEXT = sorted((ROOT / "src" / "kestrel" / "workflow").glob("*.py"))


def readme_names() -> list[str]:
    """The first column of the manual's internal-steps table."""
    text = TESTING.read_text()
    table = text[text.index("<!-- testing:internal-steps -->"):]
    rows = table.split("\n\n", 1)[0].splitlines()[3:]  # the marker, the header, the rule
    return [re.match(r"\| `([^`]+)` \|", row).group(1) for row in rows]  # type: ignore[union-attr]


def written_by_the_context() -> set[str]:
    """Every ``"kestrel.…"`` text in the Context's modules: whole names (``"kestrel.now"``)
    and the fixed part of formatted ones (``f"kestrel.set_event:{key}"`` gives
    ``kestrel.set_event:``)."""
    found = set()
    for path in CONTEXT:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and re.fullmatch(r"kestrel\.[a-z_]+:?", node.value)):
                found.add(node.value)
    return found


def prefix(pattern: str) -> str:
    """``kestrel.signal:NAME`` → ``kestrel.signal:``; ``kestrel.now`` stays."""
    return re.sub(r"[A-Z][A-Z_]*$", "", pattern)


def test_the_readme_lists_the_kits_internal_steps_in_its_order() -> None:
    assert readme_names() == list(INTERNAL_STEPS)


def test_every_name_the_context_writes_is_listed_and_nothing_else() -> None:
    code = written_by_the_context()
    # "kestrel.child:" is no step of its own: the signal a child's end is sent as (and the
    # idempotency key of its start), so a parent's wait for it is kestrel.signal:kestrel.child:ID.
    assert "kestrel.child:" in code
    expected = (code - {"kestrel.child:"}) | {"kestrel.signal:kestrel.child:"}
    assert {prefix(n) for n in INTERNAL_STEPS} == expected


def test_is_internal_knows_them_and_nothing_of_the_workflows_own() -> None:
    for pattern in INTERNAL_STEPS:
        assert is_internal(pattern.replace("NAME", "approval").replace("KEY", "stage"))
    for own in ["look_up", "kit.analyze", "kestrel", "kestrel.nowhere", "kestrel.sleepy",
                "kestrel_now", "my.kestrel.sleep", "kestrel.signal"]:
        assert not is_internal(own), own


def test_the_user_timeline_leaves_the_internal_steps_out() -> None:
    from datetime import UTC, datetime
    from uuid import uuid4

    from kestrel.types import Status, StepRow

    def row(i: int, name: str, error: dict[str, str] | None = None) -> StepRow:
        now = datetime.now(UTC)
        return StepRow(step_id=i, name=name, output=None, error=error, attempt=1,
                       lease_epoch=1, started_at=now, finished_at=now)

    run = Run(id=uuid4(), workflow="w", status=Status.COMPLETED, result=None, error=None,
              steps=[row(-1, "kestrel.patch:v2"), row(0, "fetch"), row(1, "kestrel.now"),
                     row(2, "kestrel.signal:approval"), row(3, "store", {"type": "E"})])
    assert run.user_step_names == ["fetch", "store"]
    assert run.user_timeline == [("fetch", 1, "ok"), ("store", 1, "error")]
    run.assert_timeline(["fetch", ("store", 1, "error")], user_only=True)
    try:
        run.assert_timeline(["fetch"], user_only=True)
    except AssertionError as exc:
        assert "recorded (its own steps)" in str(exc)
    else:
        raise AssertionError("assert_timeline passed a shorter timeline")

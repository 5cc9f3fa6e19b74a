"""The rules kestrel's statements keep so that one text runs on plain PostgreSQL and on Citus
(docs/citus.md, "What the SQL keeps for Citus"), held over every named statement, so a new
statement of the same shape cannot forget them. The Citus tier (tests/citus) shows them
working on a real cluster; this test needs none."""

from __future__ import annotations

import re

import pytest

from kestrel.sql import function_definitions, named_statements

_CTE = re.compile(r"\b(\w+)\s*(?:\([\w\s,]*\))?\s+AS\s*\(", re.IGNORECASE)
_LOCK = re.compile(r"\bFOR\s+(UPDATE|SHARE|NO\s+KEY\s+UPDATE|KEY\s+SHARE)\b", re.IGNORECASE)
_VOID_LISTED = re.compile(r"^\s*SELECT\s+(__schema__\.child_finished|pg_notify)\s*\(",
                          re.IGNORECASE)


def ctes(text: str) -> dict[str, str]:
    """Each CTE of *text* (comments and string literals removed): name -> body."""
    text = re.sub(r"--[^\n]*", "", text)
    text = re.sub(r"'(?:[^']|'')*'", "''", text)
    found = {}
    for m in _CTE.finditer(text):
        depth, i = 1, m.end()
        while depth and i < len(text):
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        found[m.group(1)] = text[m.end():i - 1]
    return found


def texts() -> dict[str, str]:
    """Every named statement and every function of sql/functions (by name; a function's
    statements are planned by Citus as the statement's are, wherever it runs)."""
    return {**named_statements(), **{f"function {n}": t
                                     for n, t in function_definitions().items()}}


def planned_cte_by_cte() -> dict[str, dict[str, str]]:
    """The statements Citus plans CTE by CTE: those with an INSERT in a CTE."""
    split = {name: ctes(text) for name, text in texts().items()}
    return {name: parts for name, parts in split.items()
            if any(re.match(r"\s*INSERT\b", body, re.IGNORECASE) for body in parts.values())}


def test_the_shape_is_found() -> None:
    # The rule below is only as good as this parse: it must see the statements it guards.
    found = planned_cte_by_cte()
    assert {"save_steps_batch", "save_new_steps_batch", "complete_batch",
            "reenqueue_expired", "expire_deadlines", "set_event"} <= set(found)
    assert "FOR SHARE" in found["save_steps_batch"]["owned"]
    assert "FOR UPDATE" in found["complete_batch"]["locked"]
    assert found["complete_batch"]["removed"].lstrip().startswith("DELETE")


def test_a_function_delegated_to_a_tenant_node_has_no_insert_in_a_cte() -> None:
    """A delegated function runs on the tenant's node, where Citus still plans a statement
    with an INSERT in a CTE CTE by CTE (and the checkpoint batch's join then read the whole
    checkpoint table back): such a function is written as plain statements
    (docs/citus.md)."""
    delegate = named_statements()["delegate_functions"]
    delegated = set(re.findall(r"'__schema__\.(\w+)\(", delegate))
    assert delegated == {"save_steps", "finish_batch", "sweep_expired", "fail_late"}
    # And what they call, run on the node as well.
    bodies = function_definitions()
    reached, todo = set(), list(delegated)
    while todo:
        name = todo.pop()
        if name in reached:
            continue
        reached.add(name)
        todo += [c for c in re.findall(r"__schema__\.(\w+)\(", bodies[name])
                 if c in bodies and c != name]
    assert "move_finished" in reached  # the walk sees the calls
    assert not {f"function {name}" for name in reached} & set(planned_cte_by_cte())


@pytest.mark.parametrize("name", sorted(planned_cte_by_cte()))
def test_each_locking_cte_of_a_statement_planned_cte_by_cte_travels_as_text(
        name: str) -> None:
    for cte, body in planned_cte_by_cte()[name].items():
        if _LOCK.search(body) and not re.match(r"\s*(INSERT|UPDATE|DELETE)\b", body, re.I):
            assert re.search(r"NULL::__schema__\.workflow_executions\s+AS\s+text_results",
                             body), (f"{name}: CTE {cte} locks rows and is shipped between "
                                     "Citus nodes: select text_results (docs/citus.md)")


@pytest.mark.parametrize("name", sorted(planned_cte_by_cte()))
def test_no_cte_of_a_statement_planned_cte_by_cte_lists_a_void_result(name: str) -> None:
    for cte, body in planned_cte_by_cte()[name].items():
        assert not _VOID_LISTED.match(body), (
            f"{name}: CTE {cte} lists a void function's results, which Citus cannot store "
            "between nodes: count the calls instead (docs/citus.md)")


_DO_UPDATE_SET = re.compile(r"\bDO\s+UPDATE\s+SET\b(.*?)(?=\bRETURNING\b|;|\)\s*,|\)\s*SELECT\b|$)",
                            re.IGNORECASE | re.DOTALL)


@pytest.mark.parametrize("name", sorted(named_statements()))
def test_an_upsert_sets_no_clock_of_its_own(name: str) -> None:
    """Citus wants what ``ON CONFLICT DO UPDATE SET`` computes immutable: the clock comes
    from the row offered (``excluded.updated_at``, its column default)."""
    text = re.sub(r"--[^\n]*", "", named_statements()[name])
    for m in _DO_UPDATE_SET.finditer(text):
        assert not re.search(r"\b(kestrel_now|now|clock_timestamp|statement_timestamp)\s*\(",
                             m.group(1)), f"{name}: DO UPDATE SET reads the clock: {m.group(1)}"

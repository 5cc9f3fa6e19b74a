"""FAULTS.md, the fault catalogue: every id the code cites has one entry (no database).

Code, SQL and tests cite scenarios as ``FAULTS R2``, ``(FAULTS C6)``, ``FAULTS D10, O4, O6``,
``FAULTS C2/O4`` or ``FAULTS.md L1, L2``, sometimes with the ids on the next comment line.
An entry is a heading ``### <ID> — <title>`` followed by a ``Tests:`` line naming test files.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CATALOGUE = ROOT / "FAULTS.md"
CITED_IN = ("src", "sql", "tests")

ID = r"[A-Z][0-9]+[a-z]?\b"
HEADING = re.compile(rf"^### ({ID}) — \S", re.MULTILINE)
# FAULTS, then blanks or comment markers (a citation may wrap), then ids joined by , or /.
CITATION = re.compile(rf"\bFAULTS(?:\.md)?(?:\s|--|#)+({ID}(?:\s*[,/]\s*{ID})*)")
# A Tests: line and its continuation lines, up to the next blank line.
TESTS_BLOCK = re.compile(r"^Tests:(.*(?:\n(?!\n).*)*)", re.MULTILINE)
PATH = re.compile(r"`([\w./-]+\.(?:py|c))`")


def catalogue_text() -> str:
    return CATALOGUE.read_text(encoding="utf-8")


def entries() -> list[str]:
    """The ids of the catalogue's entries, in order, repeats included."""
    return HEADING.findall(catalogue_text())


def citations() -> dict[str, set[str]]:
    """Each id cited in src/, sql/ and tests/ (``*.py``, ``*.sql``) -> where it is cited.
    This file's own examples of citations do not count."""
    cited: dict[str, set[str]] = defaultdict(set)
    for top in CITED_IN:
        for path in sorted((ROOT / top).rglob("*")):
            if (path.suffix not in (".py", ".sql") or "__pycache__" in path.parts
                    or path == Path(__file__).resolve()):
                continue
            text = path.read_text(encoding="utf-8")
            for match in CITATION.finditer(text):
                line = text.count("\n", 0, match.start()) + 1
                for fault in re.findall(ID, match.group(1)):
                    cited[fault].add(f"{path.relative_to(ROOT)}:{line}")
    return cited


def sections() -> dict[str, str]:
    """Each entry's id -> its text, from its heading to the next heading."""
    parts = re.split(r"^(?=##)", catalogue_text(), flags=re.MULTILINE)
    return {m.group(1): part for part in parts if (m := HEADING.match(part))}


def test_citations_are_found() -> None:
    """The parser sees the citation forms in use, so the next test cannot pass vacuously."""
    cited = citations()
    assert len(cited) > 30
    assert {"R2", "C6", "D10", "O4", "O6", "F3"} <= cited.keys()


def test_every_cited_id_has_an_entry() -> None:
    known = set(entries())
    missing = {fault: where for fault, where in citations().items() if fault not in known}
    assert not missing, "ids cited but missing from FAULTS.md:\n" + "\n".join(
        f"  {fault}: {', '.join(sorted(where))}" for fault, where in sorted(missing.items()))


def test_no_id_has_two_entries() -> None:
    twice = sorted(fault for fault, n in Counter(entries()).items() if n > 1)
    assert not twice, f"ids with more than one entry in FAULTS.md: {twice}"


def test_every_entry_has_one_tests_line() -> None:
    wrong = {fault: len(TESTS_BLOCK.findall(text)) for fault, text in sections().items()}
    assert all(n == 1 for n in wrong.values()), {f: n for f, n in wrong.items() if n != 1}


def test_every_named_test_file_exists() -> None:
    named = {path for block in TESTS_BLOCK.findall(catalogue_text())
             for path in PATH.findall(block)}
    assert named, "no test file named on any Tests: line"
    absent = sorted(path for path in named if not (ROOT / path).is_file())
    assert not absent, f"Tests: lines of FAULTS.md name files that do not exist: {absent}"

"""The tutorials of the manual (docs/tutorials/*.md) as scripts: how their code blocks run.

The convention, for every fenced block of a tutorial page:

- ``<!-- file: NAME -->`` just before a block: the block is written to NAME in the
  tutorial's folder, at that point of the page (a later block may write NAME again: a new
  version of the code);
- ``<!-- illustrative: why -->`` just before a block: it is not run (output that differs at
  each run, a fragment of a larger program, SQL with an id of yours);
- any other ``sh`` block runs as written, and a ``python`` block runs as a script
  (``python - <<'EOF'``), in one bash per page, in page order, from an empty folder: a
  background job (``&``) started by one block is there for the next;
- ``<!-- expect: TEXT -->`` anywhere on the page: TEXT must appear in what the page's
  script printed (the outcome the tutorial states); ``assert`` statements in python blocks
  state outcomes too. A block right after an expect marker shows that output: not run.

A block of another language that is neither a file nor illustrative is an error: nothing
the page shows may be silently left out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TUTORIALS = ROOT / "docs" / "tutorials"

FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)
MARKER = re.compile(r"<!-- (file|illustrative|expect):? ?(.*?) ?-->")


@dataclass
class Page:
    """One tutorial as the test runs it."""

    name: str
    script: list[str] = field(default_factory=list)
    expect: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    illustrative: int = 0

    def bash(self) -> str:
        return "set -euo pipefail\n" + "\n".join(self.script) + "\n"


def _marker_before(text: str, start: int) -> tuple[str, str] | None:
    """The marker nearest before offset *start* (only blank lines and markers between it
    and the fence)."""
    for line in reversed(text[:start].rstrip("\n").split("\n")):
        line = line.strip()
        if not line:
            continue
        m = MARKER.fullmatch(line)
        if m is None:
            return None
        return m.group(1), m.group(2)
    return None


def parse(path: Path) -> Page:
    text = path.read_text()
    page = Page(path.stem)
    page.expect = [m.group(2) for m in MARKER.finditer(text) if m.group(1) == "expect"]
    for n, m in enumerate(FENCE.finditer(text)):
        lang, body = m.group(1), m.group(2)
        marker = _marker_before(text, m.start())
        if marker and marker[0] in ("illustrative", "expect"):
            page.illustrative += 1
        elif marker and marker[0] == "file":
            page.files.append(marker[1])
            page.script.append(f"cat > {marker[1]} <<'KESTREL_DOC_{n}'\n{body}KESTREL_DOC_{n}")
        elif lang == "sh":
            page.script.append(body)
        elif lang == "python":
            page.script.append(f"python - <<'KESTREL_DOC_{n}'\n{body}KESTREL_DOC_{n}")
        else:
            raise ValueError(f"{path.name}: a ```{lang} block (line "
                             f"{text[:m.start()].count(chr(10)) + 1}) is neither a file, "
                             "nor run, nor marked <!-- illustrative: why -->")
    return page


def pages() -> list[Path]:
    return sorted(TUTORIALS.glob("*.md"))

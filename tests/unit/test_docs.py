"""The README and the manual (docs/, mkdocs.yml), without a database and without building
the site (``make docs`` does, with ``--strict``, in CI):

- the README stays the pitch, the two commands, the quick start and links: at most 300 lines;
- every relative link of the README and of docs/ resolves, to a file and to a heading;
- the quick start in the manual is the README's (tests follow the README's);
- each generated reference page covers everything the code defines (tools/docs_gen.py).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
sys.path.insert(0, str(ROOT / "tools"))
import docs_gen  # noqa: E402  (tools/ is no package)

LINK = re.compile(r"(?<!\\)!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|src=\"([^\"]+)\"")
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)


def _anchors(page: Path) -> set[str]:
    """The anchors MkDocs (and GitHub) give *page*'s headings."""
    text = FENCE.sub("", page.read_text())
    found = set()
    for heading in re.findall(r"^#{1,6} (.+?)\s*$", text, re.MULTILINE):
        slug = re.sub(r"[^\w\s-]", "", heading.replace("`", "").lower()).strip()
        found.add(re.sub(r"[\s]+", "-", slug))
    return found


def _links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)  # code spans are not links
    return [a or b for a, b in LINK.findall(text)]


def _broken(page: Path) -> list[str]:
    broken = []
    for link in _links(page):
        if re.match(r"[a-z]+:", link):  # https:, mailto:
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if path.endswith("openapi.json") and page.parent == DOCS / "reference":
            continue  # generated at build time (tools/docs_gen.py on_files)
        missing_anchor = bool(anchor) and target.suffix == ".md" and (
            not target.exists() or anchor not in _anchors(target))
        if not target.exists() or missing_anchor:
            broken.append(link)
    return broken


def test_the_readme_is_at_most_300_lines() -> None:
    assert len(README.read_text().splitlines()) <= 300


@pytest.mark.parametrize("page", [README, *sorted(DOCS.rglob("*.md"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    assert _broken(page) == []


def test_the_readme_links_into_every_section_of_the_manual() -> None:
    links = {link.partition("#")[0] for link in _links(README)}
    for page in ("docs/getting-started.md", "docs/tutorials/approval-flow.md",
                 "docs/tutorials/testing.md", "docs/tutorials/deploying.md",
                 "docs/howto/operating.md", "docs/howto/pgbouncer.md", "docs/howto/scaling.md",
                 "docs/reference/cli.md", "docs/reference/http.md", "docs/guarantees.md",
                 "docs/how-it-works.md"):
        assert page in links, page


def test_every_page_is_in_the_nav() -> None:
    nav = (ROOT / "mkdocs.yml").read_text().split("\nnav:\n", 1)[1]
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert pages == set(re.findall(r": ([\w/.-]+\.md)$", nav, re.MULTILINE))


QUICKSTART = re.compile(r"<!-- quickstart:(\w+) ?([^>]*?) ?-->\n```(\w+)\n(.*?)```", re.DOTALL)


def test_the_manuals_quick_start_is_the_readmes() -> None:
    readme = QUICKSTART.findall(README.read_text())
    manual = QUICKSTART.findall((DOCS / "getting-started.md").read_text())
    assert len(readme) == 6 and manual == readme


def test_the_two_commands_are_in_the_readme() -> None:
    text = README.read_text()
    assert "## Two commands" in text
    assert "make run    # the main job" in text and "make test   # the test suite" in text


# -- the generated reference ---------------------------------------------------------------


def test_the_cli_reference_has_every_command_and_sub_command() -> None:
    from kestrel.cli import TABLE

    text = docs_gen.cli()
    for command in TABLE:
        assert f"\n## {command.name}\n" in f"\n{text}", command.name
        assert f"usage: kestrel-runtime {command.name}" in text
        for action in command.actions:
            assert f"### {command.name} {action.name}\n" in text


def test_the_configuration_reference_has_every_setting_with_its_default() -> None:
    from kestrel.config import KNOBS

    text = docs_gen.configuration()
    for knob in KNOBS:
        assert f"`{knob.env}` | `{knob.name}` |" in text, knob.name
    assert "| `--batch-size N` | `KESTREL_BATCH_SIZE` | `batch_size` | `32` |" in text


def test_the_http_reference_has_every_route_of_the_openapi_document() -> None:
    text = docs_gen.http()
    doc = docs_gen.openapi_document()
    for path, methods in doc["paths"].items():
        for method in methods:
            assert f"### `{method.upper()} {path}`" in text
    assert "### `POST /api/v1/workflows/{workflow}/submit`" in text


def test_the_metrics_reference_has_every_metric() -> None:
    text = docs_gen.metrics()
    source = (ROOT / "src" / "kestrel" / "metrics.py").read_text()
    names = set(re.findall(r"\"(kestrel_[a-z_]+)\"", source))
    assert len(names) > 30
    for name in names:
        assert f"`{name}`" in text or f"`{name}_total`" in text, name


def test_the_sql_reference_has_every_function() -> None:
    source = "".join(p.read_text() for p in (ROOT / "sql" / "functions").glob("*.sql"))
    defined = set(re.findall(r"FUNCTION __schema__\.(\w+)\(", source))
    listed = {name for name, signature, _ in docs_gen.sql_functions() if signature}
    assert defined <= listed, defined - listed
    public = docs_gen._sql(True)
    for name in ("submit", "signal", "cancel", "retry", "fork"):
        assert f"### `{name}`" in public
    assert "kestrel.submit(" in public and "__schema__" not in public


def test_every_generated_marker_of_the_manual_has_a_generator() -> None:
    used = {m for p in DOCS.rglob("*.md") for m in docs_gen.MARKER.findall(p.read_text())}
    assert used == set(docs_gen.GENERATORS)

"""The web UI's pure parts, without a database: templates compile, escaping of search text,
the login redirect stays inside the UI, CSRF tokens belong to one session."""

from __future__ import annotations

import pytest

from kestrel.http import ui


@pytest.mark.parametrize("name", sorted(p.name for p in (ui.HERE / "templates").glob("*.html")))
def test_every_template_compiles(name: str) -> None:
    ui.TEMPLATES.get_template(name)


def test_search_text_is_matched_literally() -> None:
    assert ui.like_pattern("50%_off\\") == "%50\\%\\_off\\\\%"
    assert ui.like_pattern("") == "%%"


@pytest.mark.parametrize("target", ["//evil.example/ui", "https://evil.example/ui",
                                    "/ui\\@evil", "/api/v1/queues", "/ui/\x00", "/ui/\u2028",
                                    "javascript:alert(1)", "", None])
def test_login_never_redirects_outside_the_ui(target: str | None) -> None:
    assert ui._safe_next(target) == "/ui/"


def test_login_returns_to_the_page_asked_for() -> None:
    assert ui._safe_next("/ui/executions/x?done=cancel") == "/ui/executions/x?done=cancel"


def test_csrf_tokens_are_per_session_and_stable() -> None:
    a = "kst_0123456789abcdef_" + "a" * 43
    b = "kst_0123456789abcdef_" + "b" * 43
    assert ui.csrf_token(a) == ui.csrf_token(a) != ui.csrf_token(b)
    assert len(ui.csrf_token(a)) == 64 and a[21:] not in ui.csrf_token(a)


def test_values_are_cut_with_a_note_and_escaped_by_the_templates() -> None:
    assert ui._cut("x" * 10, 4) == "xxxx… (6 more)"
    assert "more characters not shown" in ui._short_json(["y" * 5000])
    html = ui.TEMPLATES.from_string("{{ v | json }}").render(v="<script>")
    assert "<script>" not in html and "&lt;script&gt;" in html

"""The web UI's pure parts, without a database: templates compile, escaping of search text,
the login redirect stays inside the UI, CSRF tokens belong to one session."""

from __future__ import annotations

import pytest

from kestrel.http import ui
from kestrel.http.ui import forms, render


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
    assert forms._safe_next(target) == "/ui/"


def test_login_returns_to_the_page_asked_for() -> None:
    assert forms._safe_next("/ui/executions/x?done=cancel") == "/ui/executions/x?done=cancel"


def test_csrf_tokens_are_per_session_and_stable() -> None:
    a = "kst_0123456789abcdef_" + "a" * 43
    b = "kst_0123456789abcdef_" + "b" * 43
    assert ui.csrf_token(a) == ui.csrf_token(a) != ui.csrf_token(b)
    assert len(ui.csrf_token(a)) == 64 and a[21:] not in ui.csrf_token(a)


def test_values_are_cut_with_a_note_and_escaped_by_the_templates() -> None:
    assert render._cut("x" * 10, 4) == "xxxx… (6 more)"
    assert "more characters not shown" in render._short_json(["y" * 5000])
    html = ui.TEMPLATES.from_string("{{ v | json }}").render(v="<script>")
    assert "<script>" not in html and "&lt;script&gt;" in html


@pytest.mark.parametrize(("seconds", "shown"), [
    (-3, "0 s"), (0, "0 s"), (89, "89 s"), (90, "1 min"), (12 * 60 + 59, "12 min"),
    (89 * 60 + 59, "89 min"), (90 * 60, "1 h"), (47 * 3600, "47 h"), (48 * 3600, "2 days")])
def test_how_long_ago_reads_in_whole_units_down(seconds: float, shown: str) -> None:
    assert ui.ago(seconds) == shown


def test_a_traceback_keeps_its_lines_and_is_bounded() -> None:
    trace = "Traceback (most recent call last):\n  File \"x.py\", line 1\nE: <b>" + "e" * 5000
    shown = render._traceback(trace)
    assert shown.splitlines()[:2] == ["Traceback (most recent call last):", '  File "x.py", line 1']
    assert "e" * (ui.SHOWN_CHARS + 1) not in shown and "more)" in shown
    huge = "\n".join(f"line {n}" for n in range(100_000))  # a megabyte of frames: its end
    cut = render._traceback(huge)
    assert len(cut) < ui.TRACEBACK_CHARS + 100 and cut.endswith("line 99999")
    assert cut.startswith("… (") and "earlier characters not shown" in cut
    html = ui.TEMPLATES.from_string("<pre>{{ t | traceback }}</pre>").render(t="a\n<b>\u202e")
    assert html == "<pre>a\n&lt;b&gt;\\u202e</pre>"


def test_an_error_that_is_not_an_object_is_still_shown() -> None:
    assert ui.failure_view(None) is None
    view = ui.failure_view("boom")
    assert view is not None and view["message"] == "boom" and view["traceback"] is None
    view = ui.failure_view({"type": "T", "message": "m", "traceback": "tb"})
    assert view is not None and (view["type"], view["traceback"], view["step"]) == (
        "T", "tb", None)

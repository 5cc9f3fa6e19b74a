"""How the web UI's pages show things: the Jinja2 templates (``kestrel/http/templates``)
with their filters, the security headers every page carries, and the views of what the
database holds (a wait, a failure) as the pages show them.

Every value a template prints is HTML-escaped (autoescape) and has its bidirectional
controls written as visible escapes (:func:`visible`); long values are cut with a note.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
from markupsafe import Markup
from starlette.requests import Request
from starlette.responses import HTMLResponse

from kestrel import codec
from kestrel.types import Status

if TYPE_CHECKING:
    from kestrel.http.sessions import Session

HERE = Path(__file__).parent.parent
"""The folder of the UI's ``templates/`` and ``static/`` (``kestrel/http``)."""
SHOWN_CHARS = 2000
"""How much of a JSON value (arguments, outputs, payloads) a page shows before cutting."""
TRACEBACK_CHARS = 16_000
"""How much of a failure's traceback the execution page shows (its end: the frame that
raised is there)."""

SECURITY_HEADERS = {
    # Inline style attributes only (the timeline's bar widths, computed here); no inline
    # script, nothing from another origin.
    "Content-Security-Policy": ("default-src 'none'; style-src 'self'; script-src 'self'; "
                                "style-src-attr 'unsafe-inline'; img-src 'self' data:; "
                                "connect-src 'self'; form-action 'self'; base-uri 'none'; "
                                "frame-ancestors 'none'"),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


def _short_json(value: Any, limit: int = SHOWN_CHARS) -> str:
    text = json.dumps(value, indent=2, ensure_ascii=False, default=str)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}\n… ({len(text) - limit} more characters not shown)"


def _cut(value: Any, limit: int = SHOWN_CHARS) -> str:
    text = str(value)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text) - limit} more)"


def _when(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    return str(value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S"))


def _minute(value: Any) -> str:
    """*value* to the minute in UTC ("2026-12-01 18:02"), for "since … (…)"."""
    if value is None:
        return "—"
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    return str(value.astimezone(UTC).strftime("%Y-%m-%d %H:%M"))


def ago(seconds: float) -> str:
    """A duration as a person reads it at a glance, whole units down: "40 s", "12 min",
    "5 h", "3 days"."""
    s = max(int(seconds), 0)
    if s < 90:
        return f"{s} s"
    if s < 90 * 60:
        return f"{s // 60} min"
    if s < 48 * 3600:
        return f"{s // 3600} h"
    return f"{s // 86400} days"


def _traceback(value: Any, limit: int = TRACEBACK_CHARS) -> str:
    """A traceback as text to show: each line cut at :data:`SHOWN_CHARS` (the exception's
    line may quote a huge message), then its end, at most *limit* characters (the frame that
    raised and the exception are at the end)."""
    text = "\n".join(_cut(line) for line in str(value).splitlines())
    if len(text) <= limit:
        return text
    return f"… ({len(text) - limit} earlier characters not shown)\n{text[-limit:]}"


def _ms(value: float | None) -> str:
    if value is None:
        return "—"
    if value < 1000:
        return f"{value:.1f} ms"
    if value < 120_000:
        return f"{value / 1000:.2f} s"
    return f"{value / 60_000:.1f} min"


# Bidirectional controls (embeddings, overrides, isolates, marks): shown raw, one in a name
# or a payload reorders the text around it on the page (a right-to-left override makes
# "evil\u202egnp.exe" read "evilexe.png"). Every value a page shows has them written as
# visible escapes instead.
_BIDI = re.compile("[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


class Verbatim(str):
    """A value a page must hold exactly as it is (a form field sent back to the server),
    exempt from :func:`visible`; still HTML-escaped."""


def visible(value: Any) -> Any:
    """*value* with every bidirectional control character written as ``\\uXXXX``: every
    value a template prints goes through this (Jinja2's finalize), before HTML escaping.
    Markup (already safe HTML made here) and :class:`Verbatim` values are left alone."""
    if isinstance(value, str) and not isinstance(value, Verbatim | Markup) \
            and _BIDI.search(value):
        return _BIDI.sub(lambda m: f"\\u{ord(m.group()):04x}", value)
    return value


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"),
                             autoescape=True, undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True, finalize=visible)
    env.filters.update(json=_short_json, cut=_cut, when=_when, ms=_ms, verbatim=Verbatim,
                       minute=_minute, traceback=_traceback)
    return env


TEMPLATES = _environment()


def render(request: Request, template: str, *, status: int = 200,
           session: Session | None = None, **context: Any) -> HTMLResponse:
    """*template* rendered with *context*, with the UI's security headers."""
    html = TEMPLATES.get_template(template).render(
        session=session, path=request.url.path, statuses=[s.value for s in Status], **context)
    return HTMLResponse(html, status_code=status, headers=SECURITY_HEADERS)


def error_page(request: Request, status: int, reason: str,
               session: Session | None = None) -> HTMLResponse:
    """The one-line *reason* of a refusal as a page (hostile text made printable)."""
    line = codec.printable(" ".join(str(reason).split()), 300)
    return render(request, "error.html", status=status, session=session, status_code=status,
                  reason=line)


def wait_view(row: tuple[Any, ...]) -> dict[str, Any]:
    """A ``ui_waits`` row as the pages show it: *kind* (``signal``, ``child``, ``sleep``,
    ``start`` for a delayed start, ``version`` for a give-back to a newer app version),
    the signal's name or the child's id, *until* (a sleep's end, a wait's timeout, a
    give-back's retry), *since* when it waits and how long ago that is by the database's
    clock, and whether what it waits for has *arrived* (it resumes at its next claim)."""
    (_id, waiting_for, wait_deadline, wake_at, since, given_back_at, given_back_by,
     give_backs, arrived, now) = row
    view: dict[str, Any] = {"signal": None, "child_id": None, "until": wait_deadline,
                            "since": since, "ago": ago((now - since).total_seconds()),
                            "arrived": bool(arrived),
                            "versions": ", ".join(given_back_by or []) or "an older version",
                            "give_backs": int(give_backs or 0)}
    if waiting_for is None:
        view.update(kind="start", until=wake_at)
    elif waiting_for == "kestrel.sleep":
        view.update(kind="sleep", until=wake_at)
    elif waiting_for.startswith("kestrel.child:"):
        view.update(kind="child", child_id=waiting_for.removeprefix("kestrel.child:"))
    else:
        view.update(kind="signal", signal=waiting_for)
    if given_back_at is not None:  # it waits for a worker of another version first
        view.update(kind="version", retry_at=wake_at)
    return view


def failure_view(error: Any, steps: Sequence[Any] = ()) -> dict[str, Any] | None:
    """A stored error (``{"type", "message", "traceback"}``) as the execution page shows
    it: the three as text (the traceback with its line breaks), the raw JSON, and the last
    failed step of *steps* with its own traceback (where the code raised, when the
    execution failed with :class:`~kestrel.errors.StepFailed`); None when there is none."""
    if error is None:
        return None
    step = next((s for s in reversed(steps) if s.error), None)
    if not isinstance(error, dict):
        return {"type": "error", "message": str(error), "traceback": None, "raw": error,
                "step": step, "step_traceback": None}
    trace = error.get("traceback")
    step_trace = step.error.get("traceback") if step and isinstance(step.error, dict) \
        else None
    return {"type": str(error.get("type") or "error"),
            "message": str(error.get("message") or ""),
            "traceback": str(trace) if trace else None, "raw": error, "step": step,
            "step_traceback": str(step_trace) if step_trace else None}


__all__ = [
    "HERE",
    "SECURITY_HEADERS",
    "SHOWN_CHARS",
    "TEMPLATES",
    "TRACEBACK_CHARS",
    "Verbatim",
    "ago",
    "error_page",
    "failure_view",
    "render",
    "visible",
    "wait_view",
]

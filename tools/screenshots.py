"""Regenerate docs/screenshots/*.png (the README's pictures of the web UI).

Runs the browser test that walks through the UI (tests/browser/test_ui.py) with
``KESTREL_UPDATE_SCREENSHOTS=1``: a real PostgreSQL, runtime, ``kestrel-runtime serve`` and
headless Chromium, so the pictures show what a user sees. Usage: ``python tools/screenshots.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    """Run the walk-through test with screenshots going to docs/screenshots."""
    env = dict(os.environ, KESTREL_UPDATE_SCREENSHOTS="1")
    test = ("tests/browser/test_ui.py::"
            "test_an_operator_logs_in_finds_the_waiting_incident_and_approves_it")
    return subprocess.call([sys.executable, "-m", "pytest", "-q", test], cwd=ROOT, env=env)


if __name__ == "__main__":
    raise SystemExit(main())

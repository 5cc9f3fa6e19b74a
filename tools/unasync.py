"""Generate the blocking client from the async one: ``python tools/unasync.py``.

``src/kestrel/client_async.py`` is the one hand-written client; this writes
``src/kestrel/client_sync.py`` from it by rewriting the async constructs into their blocking
equivalents (as psycopg generates its sync code). ``--check`` exits 1 when the checked-in
file differs from what would be generated; ``tests/unit/test_layering.py`` runs that check.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "src" / "kestrel" / "client_async.py"
TARGET = ROOT / "src" / "kestrel" / "client_sync.py"

# (pattern, replacement), applied in order; \b keeps them to whole names.
RULES: list[tuple[str, str]] = [
    (r"\basync def\b", "def"),
    (r"\basync with\b", "with"),
    (r"\basync for\b", "for"),
    (r"\bawait ", ""),
    (r"\basynccontextmanager\b", "contextmanager"),
    (r"\bAsyncIterator\b", "Iterator"),
    (r"\bAsyncConnectionPool\b", "ConnectionPool"),
    (r"\bpsycopg\.AsyncConnection\b", "psycopg.Connection"),
    (r"\basyncio\.sleep\b", "time.sleep"),
    (r"\basyncio\.Lock\b", "threading.Lock"),
    (r"^import asyncio$", "import threading"),
    (r"\bdb\.run_script\(", "db.run_script_sync("),
    (r"\bdb\.run\(", "db.run_sync("),
    (r"\bconnections\.configure_connection_async\b", "connections.configure_connection"),
    (r"\bconnections\.connect_async\b", "connections.connect"),
    (r"\b__aenter__\b", "__enter__"),
    (r"\b__aexit__\b", "__exit__"),
    (r"\bClient\b", "SyncClient"),
    (r"\bHandle\b", "SyncHandle"),
    (r"^    \"\"\"Async client\.", '    """Blocking client, thread-safe.'),
]


HEADER = '''"""The blocking client, :class:`SyncClient`, for scripts, web handlers and the CLI.

GENERATED from ``client_async.py`` by ``tools/unasync.py`` (``make unasync``): do not edit
this file; change the async client and regenerate.
"""'''


def generate(text: str) -> str:
    """The blocking client's source for the async client's *text*."""
    end = text.index('"""', text.index('"""') + 3) + 3  # the module docstring is replaced
    text = HEADER + text[end:]
    for pattern, replacement in RULES:
        text = re.sub(pattern, replacement, text, flags=re.MULTILINE)
    return text


def main(argv: list[str]) -> int:
    want = generate(SOURCE.read_text())
    if "--check" in argv:
        if TARGET.read_text() != want:
            print(f"{TARGET.relative_to(ROOT)} is out of date: run `make unasync`")
            return 1
        return 0
    TARGET.write_text(want)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

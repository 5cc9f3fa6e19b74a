"""A slow disk for the bench's own PostgreSQL: ``--flush-delay-us N``.

:func:`shim` compiles ``bench/flush_delay.c`` with gcc into a cache folder (once per source
version); :func:`server_env` is the environment the embedded server starts with so that
every ``fdatasync``/``fsync`` it makes takes N µs longer; :func:`running_delay` reads the
delay a running server was started with (from its postmaster's environment), so the bench
restarts a server started with another one. :func:`commit_latency_ms` measures what a single
client sees: one INSERT per commit, one at a time.
"""

from __future__ import annotations

import hashlib
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import psycopg

SOURCE = Path(__file__).with_name("flush_delay.c")
VARIABLE = "KESTREL_FLUSH_DELAY_US"


def shim() -> Path:
    """The compiled shim, built now if this version of the source has not been built yet.
    The cache lives under the system temp folder: the embedded server may run as another
    user (pgserver's own when started by root), who must be able to read it."""
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source).hexdigest()[:12]
    folder = Path(tempfile.gettempdir()) / "kestrel-bench-shim"
    folder.mkdir(mode=0o755, exist_ok=True)
    folder.chmod(0o755)
    lib = folder / f"flush_delay-{digest}.so"
    if not lib.exists():
        tmp = folder / f".flush_delay-{digest}.{time.monotonic_ns()}.so"
        subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(tmp), str(SOURCE), "-ldl"],
                       check=True)
        tmp.chmod(0o755)
        tmp.replace(lib)  # atomic: a concurrent build cannot leave half a library
    return lib


def server_env(delay_us: int) -> dict[str, str]:
    """Variables to add to the embedded server's environment (none for no delay)."""
    if delay_us <= 0:
        return {}
    return {"LD_PRELOAD": str(shim()), VARIABLE: str(delay_us)}


def running_delay(conn: psycopg.Connection[Any]) -> int:
    """The flush delay the server behind *conn* was started with (0: none), read from its
    postmaster's environment (a server on this machine only)."""
    row = conn.execute("SELECT pg_backend_pid()").fetchone()
    assert row is not None
    try:
        postmaster = psutil.Process(int(row[0])).parent()
        env = postmaster.environ() if postmaster else {}
    except (psutil.Error, OSError):
        return 0
    if "flush_delay" not in env.get("LD_PRELOAD", ""):
        return 0
    return int(env.get(VARIABLE, "0") or 0)


def commit_latency_ms(dsn: str, n: int = 200) -> dict[str, float]:
    """Median and mean milliseconds of a single-row INSERT commit, one client, one at a
    time (a scratch table in a schema of its own, dropped after: the bench needs CREATE on
    the database only, not on schema public, which PostgreSQL 15+ grants its owner alone)."""
    with psycopg.connect(dsn, autocommit=True, prepare_threshold=None) as conn:
        conn.execute("DROP SCHEMA IF EXISTS bench_commit_latency CASCADE")
        conn.execute("CREATE SCHEMA bench_commit_latency")
        conn.execute("CREATE TABLE bench_commit_latency.t (id int)")
        times = []
        try:
            for i in range(n):
                t = time.perf_counter()
                conn.execute("INSERT INTO bench_commit_latency.t VALUES (%s)", [i])
                times.append((time.perf_counter() - t) * 1000)
        finally:
            conn.execute("DROP SCHEMA bench_commit_latency CASCADE")
    return {"p50": statistics.median(times), "mean": statistics.fmean(times)}

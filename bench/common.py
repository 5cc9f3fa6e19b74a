"""Shared pieces of the benchmarks: the database, snapshots of its counters, percentiles."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import psycopg
from psycopg import sql as pgsql

ROOT = Path(__file__).resolve().parents[1]


def database(dsn: str | None, data_dir: str, flush_delay_us: int = 0) -> tuple[str, Any]:
    """Return a DSN: the given one, or an embedded server with room for the floor's
    connections (max_connections 400) and the default, durable synchronous_commit=on.

    The embedded server runs with *flush_delay_us* added to each of its ``fdatasync`` and
    ``fsync`` calls (bench/flushdelay.py); one already running with another delay (or with
    too few connections) is restarted."""
    if dsn:
        if flush_delay_us:
            raise ValueError("a flush delay needs the bench's own server (no --dsn)")
        return dsn, None
    from bench import flushdelay

    dsn, server = _start_embedded(data_dir, flush_delay_us)
    with psycopg.connect(dsn, autocommit=True, prepare_threshold=None) as conn:
        current = conn.execute("SHOW max_connections").fetchone()
        restart = flushdelay.running_delay(conn) != flush_delay_us
        if current and int(current[0]) < 400:
            conn.execute("ALTER SYSTEM SET max_connections = 400")
            conn.execute("ALTER SYSTEM SET shared_buffers = '512MB'")
            # Vacuum churned queue tables every 10 s instead of every minute, as a busy
            # production server should (README, "Operating it").
            conn.execute("ALTER SYSTEM SET autovacuum_naptime = '10s'")
            restart = True
    if restart:
        server.cleanup()
        dsn, server = _start_embedded(data_dir, flush_delay_us)
    with psycopg.connect(dsn, autocommit=True, prepare_threshold=None) as conn:
        running = flushdelay.running_delay(conn)
        method = (conn.execute("SHOW wal_sync_method").fetchone() or [""])[0]
    if running != flush_delay_us:
        raise RuntimeError(f"the embedded server in {data_dir} runs with a flush delay of "
                           f"{running} µs, not {flush_delay_us}: another process holds it; "
                           "stop that process or use another --data-dir")
    if flush_delay_us and method not in ("fdatasync", "fsync"):
        raise RuntimeError(f"wal_sync_method is {method}: the flush-delay shim slows "
                           "fdatasync and fsync only")
    return dsn, server


def _start_embedded(data_dir: str, flush_delay_us: int) -> tuple[str, Any]:
    """Start (or join) the embedded server; a server this call starts gets the flush-delay
    shim in its environment. The bench's own environment is left as it was, so neither
    kestrel's processes nor the floor's load the shim."""
    from bench import flushdelay
    from kestrel import embedded

    extra = flushdelay.server_env(flush_delay_us)
    saved = {k: os.environ.get(k) for k in (*extra, "LD_PRELOAD", flushdelay.VARIABLE)}
    os.environ.pop("LD_PRELOAD", None)
    os.environ.pop(flushdelay.VARIABLE, None)
    os.environ.update(extra)
    try:
        return embedded.start(data_dir)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def fresh_schema(dsn: str, name: str) -> None:
    from kestrel.migrate import migrate

    drop_schema(dsn, name)
    migrate(dsn, name)


def drop_schema(dsn: str, name: str) -> None:
    with psycopg.connect(dsn, autocommit=True, prepare_threshold=None) as conn:
        conn.execute(pgsql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(pgsql.Identifier(name)))


@dataclass(frozen=True)
class DbCounters:
    commits: int
    wal_bytes: int
    pg_cpu_s: float
    lsn: str = "0/0"

    @staticmethod
    def read(conn: psycopg.Connection[Any]) -> DbCounters:
        # The stats collector publishes at most every PGSTAT_MIN_INTERVAL; clear the
        # snapshot so this read sees the newest numbers.
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute(
            "SELECT xact_commit, pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint, "
            "pg_current_wal_lsn()::text "
            "FROM pg_stat_database WHERE datname = current_database()").fetchone()
        assert row is not None
        pid = conn.execute("SELECT pg_backend_pid()").fetchone()
        assert pid is not None
        return DbCounters(int(row[0]), int(row[1]), postgres_cpu_seconds(int(pid[0])),
                          str(row[2]))


def postgres_cpu_seconds(backend_pid: int) -> float:
    """CPU seconds of the server that runs *backend_pid*: its postmaster, every live child
    and every child that has exited (the postmaster reaps them, so their time shows in its
    ``children_*`` times). Only this server: other PostgreSQL servers on a shared machine
    (other engineers' test suites) must not count, nor may exited backends be lost."""
    try:
        postmaster = psutil.Process(backend_pid).parent()
    except psutil.NoSuchProcess:
        return 0.0
    if postmaster is None:
        return 0.0
    t = postmaster.cpu_times()
    total = t.user + t.system + t.children_user + t.children_system
    for child in postmaster.children():
        try:
            c = child.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += c.user + c.system
    return total


class TreeCpu:
    """CPU seconds of a process and its children, sampled while they live."""

    def __init__(self, pid: int) -> None:
        self.root = psutil.Process(pid)
        self.seen: dict[int, float] = {}

    def sample(self) -> None:
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for p in procs:
            try:
                t = p.cpu_times()
            except psutil.NoSuchProcess:
                continue
            self.seen[p.pid] = t.user + t.system

    @property
    def seconds(self) -> float:
        return sum(self.seen.values())


def machine() -> str:
    mem = psutil.virtual_memory().total / 2**30
    cpu = platform.processor() or platform.machine()
    try:
        model = next(line.split(":", 1)[1].strip() for line in
                     Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        model = cpu
    return f"{os.cpu_count()} cores ({model}), {mem:.0f} GiB, {platform.system()}"


def git_rev() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def progress(done: int, total: int, started: float, label: str) -> None:
    width = 30
    frac = done / total if total else 1.0
    bar = "█" * int(frac * width) + "·" * (width - int(frac * width))
    rate = done / max(time.monotonic() - started, 1e-9)
    print(f"\r  {label:<10} {bar} {done:>7}/{total} {rate:8.0f}/s", end="", flush=True)


def wal_by_relation(conn: psycopg.Connection[Any], start: str, end: str, schema: str
                    ) -> dict[str, int]:
    """WAL bytes between LSNs *start* and *end*, by relation of *schema* (indexes apart) and
    record kind (INSERT, HOT_UPDATE, DELETE…), and by record kind alone for the rest
    (commits); full-page images are summed apart. Uses the server's own pg_waldump on its
    pg_wal folder, so it works only for a server on this machine (the embedded one)."""
    import re
    import shutil

    row = conn.execute("SELECT current_setting('data_directory')").fetchone()
    assert row is not None
    names = {int(r[0]): str(r[1]) for r in conn.execute(
        "SELECT c.relfilenode, c.relname FROM pg_class AS c "
        "JOIN pg_namespace AS n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %s AND c.relfilenode <> 0", [schema]).fetchall()}
    binary = shutil.which("pg_waldump")
    try:
        import pgserver  # the embedded server's own binaries match its WAL format

        candidate = Path(pgserver.__file__).parent / "pginstall" / "bin" / "pg_waldump"
        if candidate.exists():
            binary = str(candidate)
    except ImportError:
        pass
    if binary is None:
        return {}
    out = subprocess.run([binary, "-p", str(Path(str(row[0])) / "pg_wal"), "-s", start,
                          "-e", end], capture_output=True, text=True).stdout
    totals: dict[str, int] = {}
    pattern = re.compile(r"rmgr: (\w+)\s+len \(rec/tot\):\s*(\d+)/\s*(\d+).*?desc: (\w+)"
                         r"(?:.*?blkref #0: rel \d+/\d+/(\d+))?")
    for line in out.splitlines():
        m = pattern.search(line)
        if not m:
            continue
        rmgr, rec, tot, desc, rel = (m.group(1), int(m.group(2)), int(m.group(3)),
                                     m.group(4), m.group(5))
        key = (f"{names.get(int(rel), 'other relations')} {rmgr}/{desc}" if rel
               else f"{rmgr}/{desc}")
        totals[key] = totals.get(key, 0) + rec
        if tot > rec:  # the record carries full-page images (first change since a checkpoint)
            totals["(full-page images, all relations)"] = (
                totals.get("(full-page images, all relations)", 0) + tot - rec)
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))

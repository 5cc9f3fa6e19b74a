"""``python -m bench.run --dsn`` on a server with few connection slots (issue 40, item 4):
before anything is created or started it reads ``max_connections`` and the reserved slots,
cuts the sweep to what fits (one line per cut), or stops in one line naming the setting and
the value it needs. Before, a stock server (100 slots) failed in the floors' sweep with
"remaining connection slots are reserved" (or "too many clients"), after the kestrel run,
with a traceback. Real servers of the test's own: pgserver's PostgreSQL 16 (with
``reserved_connections``) and the system's 15 where installed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from bench import preflight

from tests.pgcluster import Cluster, embedded_bindir

ROOT = Path(__file__).resolve().parents[2]
SLOTS = 20


def _system_15() -> Path | None:
    found = Path("/usr/lib/postgresql/15/bin")
    return found if (found / "postgres").exists() else None


@pytest.fixture(scope="module", params=["16-embedded", "15-system"])
def server(request: pytest.FixtureRequest) -> Iterator[tuple[Cluster, int]]:
    """A server with max_connections = 20; on 16, 2 of them reserved_connections. Yields the
    cluster and the slots reserved for roles other than a plain one."""
    if request.param == "15-system":
        bindir = _system_15()
        if bindir is None:
            pytest.skip("no PostgreSQL 15 under /usr/lib/postgresql")
        conf, reserved = {"max_connections": str(SLOTS)}, 0
    else:
        bindir = embedded_bindir()
        conf, reserved = {"max_connections": str(SLOTS), "reserved_connections": "2"}, 2
    c = Cluster("bench-preflight", conf=conf, bindir=bindir)
    c.start()
    with psycopg.connect(c.dsn, autocommit=True) as conn:
        conn.execute("CREATE ROLE bench_user LOGIN")
        conn.execute("CREATE ROLE bench_nocreate LOGIN")
        conn.execute("GRANT CREATE ON DATABASE postgres TO bench_user")
    yield c, reserved
    c.destroy()


def _as(c: Cluster, role: str) -> str:
    return c.dsn.replace("postgres@", f"{role}@", 1)


def _bench(dsn: str, *args: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KESTREL_")}
    env["XDG_RUNTIME_DIR"] = str(tmp)  # platformdirs warns without one
    return subprocess.run([sys.executable, "-m", "bench.run", "--dsn", dsn, "--out", str(tmp),
                           *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)


def _schemas(c: Cluster) -> list[str]:
    with psycopg.connect(c.dsn, autocommit=True) as conn:
        return [r[0] for r in conn.execute(
            "SELECT nspname FROM pg_namespace WHERE nspname LIKE 'bench%'").fetchall()]


def test_room_is_what_the_server_admits(server: tuple[Cluster, int]) -> None:
    """The arithmetic matches the server: a plain role opens exactly ``free`` connections;
    the next is refused for the reserved slots. Another role's session (whose details a
    plain role may not see) counts as in use."""
    c, reserved = server
    dsn = _as(c, "bench_user")
    other = psycopg.connect(c.dsn, autocommit=True)
    limits = preflight.read(dsn)
    assert (limits.max_connections, limits.reserved, limits.in_use) == (SLOTS, reserved, 1)
    assert limits.free == SLOTS - 3 - reserved - 1
    held = [other, *(psycopg.connect(dsn, autocommit=True) for _ in range(limits.free))]
    try:
        with pytest.raises(psycopg.OperationalError, match="reserved"):
            psycopg.connect(dsn, autocommit=True).close()
    finally:
        for conn in held:
            conn.close()


def test_too_few_slots_is_one_line_before_anything_starts(server: tuple[Cluster, int],
                                                          tmp_path: Path) -> None:
    c, reserved = server
    started = time.monotonic()
    done = _bench(_as(c, "bench_user"), "--procs", "3", "--workflows", "10", "--steps", "1",
                  tmp=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    # 3 processes x (pool 6 + heartbeat + LISTEN) + the bench's monitor + 2 spare = 27,
    # against 20 - 3 superuser slots - the reserved ones, nothing else connected.
    room = SLOTS - 3 - reserved
    assert lines[0] == (
        f"bench.run: the server has room for {room} more connections (max_connections 20 - "
        "superuser_reserved_connections 3"
        + (f" - reserved_connections {reserved}" if reserved else "")
        + " - 0 in use); kestrel at --procs 3 needs 27 (the runtime's 24, the bench's 1, 2 "
        f"spare): set max_connections to at least {SLOTS + 27 - room}, or lower --procs")
    assert time.monotonic() - started < 30
    assert _schemas(c) == []  # nothing created, no runtime started
    assert not list(tmp_path.glob("*.json"))


def test_sweep_is_cut_to_fit(server: tuple[Cluster, int], tmp_path: Path) -> None:
    c, reserved = server
    room = SLOTS - 3 - reserved
    done = _bench(_as(c, "bench_user"), "--plan", "--sweep", "procs=1,2", tmp=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout.splitlines()
    assert out[0].startswith(f"connections: room for {room} ")
    # procs=2 needs 2 x 8 + 1 + 2 = 19: more than 17 (15 on 16 with 2 reserved).
    assert out[1].startswith("kestrel: dropped procs=2 (19 connections); ")
    fits = tuple(n for n in (2, 4, 8, 16, 32, 64) if n + 3 <= room)
    assert fits == (2, 4, 8)
    cut = "/".join(str(n) for n in (2, 4, 8, 16, 32, 64) if n not in fits)
    assert out[2].startswith(f"floors at --procs 1: {cut} loops per process dropped")
    assert out[3] == (f'- {{"procs": 1}}: kestrel 11 connections; floors 1 procs × '
                      f'{fits} loops')
    assert len(out) == 4
    assert _schemas(c) == []


def test_a_role_that_cannot_create_schemas_is_told_what_to_grant(
        server: tuple[Cluster, int], tmp_path: Path) -> None:
    c, _ = server
    done = _bench(_as(c, "bench_nocreate"), "--procs", "1", tmp=tmp_path)
    assert done.returncode == 1
    assert done.stderr.strip() == (
        "bench.run: role bench_nocreate cannot create schemas in database postgres (the "
        "bench creates and drops its own): GRANT CREATE ON DATABASE postgres TO "
        "bench_nocreate, or use its owner")


def test_an_unreachable_server_is_one_line(tmp_path: Path) -> None:
    from tests.pgbouncer import free_port

    done = _bench(f"postgresql://postgres@127.0.0.1:{free_port()}/postgres", "--plan",
                  tmp=tmp_path)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "bench.run: cannot connect to the server: "), done.stderr

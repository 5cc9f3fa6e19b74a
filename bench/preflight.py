"""What the server allows, read before ``bench.run`` starts anything, and the sweep cut to it.

Every connection the bench opens, by side (from the code, confirmed by the peak of
``pg_stat_activity`` during runs, BENCHMARKS.md "A bench that runs on any server"):

- **kestrel**, one sweep point: the runtime's cap, ``procs x (pool_size + heartbeat +
  LISTEN)`` (``kestrel.config.Config.max_connections``: 8 per process at the default pool of
  6), and the bench's monitor, plus its submitter thread with ``--rate``.
- **a floor**, one number of loops per process: ``procs x loops`` (a connection per loop),
  and the floor's monitor.
- ``SPARE`` more: a closed connection's backend frees its slot a moment after the client
  goes, and the bench opens the next one at once.

Through ``--pgbouncer`` every one of them is a PgBouncer client and the server sees at most
the bouncer's pool. The slots the bench may use are ``max_connections`` less
``superuser_reserved_connections``, less ``reserved_connections`` (PostgreSQL 16+) unless the
role may use them, less the client backends already connected. A kestrel point or a floor's
loop count that does not fit is dropped with one line saying so and what to set; when no
kestrel point fits, :func:`plan` raises :class:`Refused`, a one-line message naming the
setting and the value it needs, before any schema is created or process started.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import psycopg

SPARE = 2
"""Slots kept free for backends that are still exiting when the next connection opens."""

DEFAULT_POOL_SIZE = 6  # kestrel.config.Config.pool_size, if kestrel cannot be imported


class Refused(Exception):
    """The server cannot run the bench as asked; ``str()`` is one line saying what to set."""


@dataclass(frozen=True)
class Server:
    """The settings and usage that decide how many connections the bench may open."""

    version: int
    max_connections: int
    superuser_reserved: int
    reserved: int
    """``reserved_connections`` (PostgreSQL 16+; 0 before)."""
    may_use_reserved: bool
    """The role may use the ``reserved_connections`` slots (a superuser, or a member of
    pg_use_reserved_connections)."""
    in_use: int
    """Client backends connected now, other than the one that read this."""
    role: str
    database: str
    can_create_schema: bool

    @property
    def free(self) -> int:
        """Connections the bench may open at once (``SPARE`` not taken off)."""
        return (self.max_connections - self.superuser_reserved
                - (0 if self.may_use_reserved else self.reserved) - self.in_use)

    def arithmetic(self) -> str:
        """How :attr:`free` was reached, for messages."""
        parts = [f"max_connections {self.max_connections}",
                 f"superuser_reserved_connections {self.superuser_reserved}"]
        if self.reserved and not self.may_use_reserved:
            parts.append(f"reserved_connections {self.reserved}")
        parts.append(f"{self.in_use} in use")
        return " - ".join(parts)

    def max_connections_for(self, need: int) -> int:
        """The ``max_connections`` under which *need* connections (SPARE included) fit,
        other usage as it is now."""
        return self.max_connections + need - self.free


def read(dsn: str) -> Server:
    """Read the server's limits and current usage; :class:`Refused` if it cannot be reached
    (one line, the driver's first)."""
    try:
        conn = psycopg.connect(dsn, autocommit=True, prepare_threshold=None, connect_timeout=10)
    except psycopg.Error as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise Refused(f"cannot connect to the server: {first}") from None
    with conn:
        version = int(_show(conn, "server_version_num"))
        reserved, may_use = 0, True
        if version >= 160000:
            reserved = int(_show(conn, "reserved_connections"))
            row = conn.execute(
                "SELECT rolsuper OR pg_has_role(current_user, 'pg_use_reserved_connections', "
                "'USAGE') FROM pg_roles WHERE rolname = current_user").fetchone()
            may_use = bool(row and row[0])
        # Every client backend takes a slot of max_connections (background workers,
        # autovacuum and WAL senders have slots of their own). A role without
        # pg_read_all_stats sees other roles' rows with backend_type hidden: those connected
        # to a database are counted (an autovacuum worker among them errs on the safe side).
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE pid <> pg_backend_pid() "
            "AND (backend_type = 'client backend' "
            "     OR (backend_type IS NULL AND datid IS NOT NULL))").fetchone()
        in_use = int(row[0]) if row else 0
        row = conn.execute(
            "SELECT current_user, current_database(), "
            "has_database_privilege(current_database(), 'CREATE')").fetchone()
        assert row is not None
        return Server(version=version, max_connections=int(_show(conn, "max_connections")),
                      superuser_reserved=int(_show(conn, "superuser_reserved_connections")),
                      reserved=reserved, may_use_reserved=may_use, in_use=in_use,
                      role=str(row[0]), database=str(row[1]), can_create_schema=bool(row[2]))


def _show(conn: psycopg.Connection[Any], name: str) -> str:
    row = conn.execute("SELECT current_setting(%s)", [name]).fetchone()
    assert row is not None
    return str(row[0])


def runtime_connections(procs: int, connection_mode: str = "direct") -> int:
    """The most connections ``kestrel-runtime --procs N`` opens, as it computes it itself
    (its pool size from KESTREL_POOL_SIZE or a config file, if set)."""
    try:
        from kestrel.config import load

        return load({"procs": procs, "connection_mode": connection_mode}).max_connections
    except Exception:  # an unusable KESTREL_* variable: the runtime will say so itself
        return procs * (DEFAULT_POOL_SIZE + 2)


def kestrel_need(p: dict[str, Any]) -> int:
    """Connections one kestrel point holds at once: the runtime's, the bench's monitor and,
    with ``--rate``, its submitter; SPARE included."""
    return (runtime_connections(p["procs"], p.get("connection_mode", "direct")) + 1
            + (1 if p.get("rate") else 0) + SPARE)


def floor_need(procs: int, loops: int) -> int:
    """Connections one floor run holds at once: a loop's each, the monitor; SPARE included."""
    return procs * loops + 1 + SPARE


@dataclass
class Plan:
    """The sweep that fits: kestrel's points, each floor's loops per process by procs."""

    points: list[dict[str, Any]]
    floor_loops: dict[int, tuple[int, ...]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    peak: int = 0
    """The most connections (SPARE included) any kept run needs."""


def plan(server: Server, base: dict[str, Any], points: list[dict[str, Any]], *,
         floors: bool, loops: tuple[int, ...], bouncer_pool: int | None = None) -> Plan:
    """Keep the points and floor loop counts that fit *server*; :class:`Refused` when no
    kestrel point does or the bench cannot create its schemas.

    *bouncer_pool*: everything goes through a PgBouncer whose pool holds this many server
    connections at most."""
    if not server.can_create_schema:
        raise Refused(f"role {server.role} cannot create schemas in database "
                      f"{server.database} (the bench creates and drops its own): GRANT CREATE "
                      f"ON DATABASE {server.database} TO {server.role}, or use its owner")

    def on_server(need: int) -> int:
        return need if bouncer_pool is None else min(need, bouncer_pool + SPARE)

    room = server.free
    kept: list[dict[str, Any]] = []
    dropped: list[tuple[dict[str, Any], int]] = []
    for point in points:
        need = on_server(kestrel_need({**base, **point}))
        if need <= room:
            kept.append(point)
        else:
            dropped.append((point, need))
    if not kept:
        least = min(need for _, need in dropped)
        procs = min((base | pt)["procs"] for pt, need in dropped if need == least)
        runtime = runtime_connections(procs, base.get("connection_mode", "direct"))
        raise Refused(
            f"the server has room for {room} more connections ({server.arithmetic()}); "
            f"kestrel at --procs {procs} needs {least} (the runtime's {runtime}, the "
            f"bench's {least - runtime - SPARE}, {SPARE} spare): set max_connections to at "
            f"least {server.max_connections_for(least)}, or lower --procs")
    out = Plan(points=kept)
    if dropped:
        out.notes.append(
            "kestrel: dropped " + ", ".join(_label(pt) + f" ({need} connections)"
                                            for pt, need in dropped)
            + f"; room for {room} ({server.arithmetic()}); max_connections "
            f"{server.max_connections_for(max(n for _, n in dropped))} runs them all")
    needs = [on_server(kestrel_need({**base, **pt})) for pt in kept]
    if floors:
        for procs in sorted({(base | pt)["procs"] for pt in kept}):
            fits = tuple(c for c in loops if on_server(floor_need(procs, c)) <= room)
            cut = [c for c in loops if c not in fits]
            if not fits:  # cannot happen while a kestrel point of these procs fits
                raise Refused(f"the floors at --procs {procs} need "
                              f"{floor_need(procs, loops[0])} connections; the server has "
                              f"room for {room} ({server.arithmetic()})")
            out.floor_loops[procs] = fits
            needs += [on_server(floor_need(procs, c)) for c in fits]
            if cut:
                top = on_server(floor_need(procs, cut[-1]))
                out.notes.append(
                    f"floors at --procs {procs}: {'/'.join(map(str, cut))} loops per "
                    f"process dropped (up to {top} connections; room for {room}: "
                    f"{server.arithmetic()}); max_connections "
                    f"{server.max_connections_for(top)} runs them")
    out.peak = max(needs)
    return out


def _label(point: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in point.items()) or "the run"


def describe(server: Server, fit: Plan) -> str:
    """One line: the server's connection budget and what the kept sweep needs of it."""
    return (f"connections: room for {server.free} ({server.arithmetic()}, role "
            f"{server.role}); this sweep needs at most {fit.peak} at once "
            f"({SPARE} spare included)")

"""Drive real ``kestrel-runtime`` processes against a real PostgreSQL and report.

    python -m bench.run --workflows 5000 --procs 2 --concurrency 64
    python -m bench.run --sweep batch_size=1,8,32,128 --sweep procs=1,2,4 --plot
    python -m bench.run --rate 500 --workflows 10000        # latency at a target rate
    python -m bench.run --backlog 1000000 --workflows 20000 # claims with a million queued

Each run reports workflows/s and steps/s (first start to last finish, database clock);
submit→start and submit→finish latency p50/p95/p99; CPU seconds per workflow for the workers
and for PostgreSQL; commits and WAL bytes per workflow (pg_stat_database, pg_current_wal_lsn;
the workflows' submissions excluded); the hot tables' size and dead tuples at the end; and
both floors (bench/floor.py: the group-commit loop, one transaction per pipeline, and the
per-step loop, one transaction per checkpoint), each swept to its best loops per process in
the same invocation, with the same figures and kestrel's ratio to each (``--no-floor``
skips them). ``--flush-delay-us N`` runs the bench's own PostgreSQL with N µs added to every
fdatasync/fsync (bench/flush_delay.c), a disk whose flush costs milliseconds; the
single-client commit latency is measured and printed at the start of every invocation.
With ``--backlog N``, N more executions are queued through SQL before the runtime starts;
throughput is then measured over the first ``--workflows`` to finish while the rest wait,
and the claim statement's latency (p50/p99, from the runtime's kestrel_claim_seconds
histogram) is reported. Otherwise the workflows are queued once the runtime's workers are
up, so its start (imports, pools: a cost per process, not per workflow) is reported apart;
with ``--rate`` or ``--backlog`` the start is in the figures. ``--statements`` profiles
each side's statements on the server (pg_stat_statements, on a server given by ``--dsn``;
bench/statements.py), ``--py-spy`` samples each side's client processes
(bench/profiles.py).
Before anything starts it reads the server's max_connections, superuser_reserved_connections,
reserved_connections (16+) and the connections in use, drops the sweep points and floor loop
counts that cannot fit (a line each), or stops at once with one line naming the setting and
the value it needs (bench/preflight.py); ``--plan`` prints that and exits.
Results go to bench/results/<stamp>.json (and .png with --plot).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql as pgsql

from bench import floor, preflight, profiles, statements
from bench.common import (
    ROOT,
    DbCounters,
    TreeCpu,
    database,
    drop_schema,
    fresh_schema,
    git_rev,
    machine,
    postgres_cpu_seconds,
    progress,
    wal_by_relation,
)
from bench.flushdelay import commit_latency_ms

SWEEPABLE = {"batch_size": int, "procs": int, "concurrency": int, "lease": float,
             "heartbeat": float, "steps": int, "backlog": int}


def _s(text: str, schema: str) -> pgsql.Composed:
    return pgsql.SQL(text).format(s=pgsql.Identifier(schema))  # type: ignore[arg-type]


def _submit_up_front(dsn: str, schema: str, n: int, args: str) -> None:
    with psycopg.connect(dsn, autocommit=True, prepare_threshold=None) as conn:
        conn.execute(_s("SELECT {s}.submit('bench', %s::jsonb) FROM generate_series(1, %s)",
                        schema), [args, n])


def _submit_at_rate(dsn: str, schema: str, n: int, args: str, rate: float,
                    stop: threading.Event) -> None:
    """Submit *n* executions at *rate* per second, in one statement per 10 ms tick."""
    stmt = _s("SELECT {s}.submit('bench', %s::jsonb) FROM generate_series(1, %s)", schema)
    with psycopg.connect(dsn, autocommit=True, prepare_threshold=None) as conn:
        started, sent = time.monotonic(), 0
        while sent < n and not stop.is_set():
            due = min(n, int((time.monotonic() - started) * rate) + 1)
            if due > sent:
                conn.execute(stmt, [args, due - sent])
                sent = due
            time.sleep(0.01)


@dataclass(frozen=True)
class Submission:
    """What queueing the workflows cost the server, to leave out of kestrel's figures."""

    wal_bytes: int
    pg_cpu_s: float
    commits: int
    end_lsn: str | None = None
    """Where its WAL ended (before its commit record), for --wal-by-relation."""


def _wait_for_workers(mon: psycopg.Connection[Any], schema: str, procs: int,
                      runtime: subprocess.Popen[bytes], timeout: float = 120.0) -> None:
    """Wait until each of the runtime's *procs* worker processes has registered (its pool
    is open and it claims), then a moment for the first, empty claims."""
    deadline = time.monotonic() + timeout
    query = _s("SELECT count(*) FROM {s}.workers", schema)
    while (mon.execute(query).fetchone() or [0])[0] < procs:
        if runtime.poll() is not None:
            raise RuntimeError(f"kestrel-runtime exited with {runtime.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"kestrel-runtime's {procs} workers did not start in "
                               f"{timeout:.0f}s")
        time.sleep(0.1)
    time.sleep(0.5)


def _submit_counted(mon: psycopg.Connection[Any], schema: str, n: int, args: str, *,
                    reset_statements: bool) -> tuple[DbCounters, Submission]:
    """Queue *n* workflows in one transaction on *mon* while the runtime waits for work;
    return the counters from just before and what the submission itself cost (its WAL and
    the server's CPU, read inside the transaction, so no claim's work is in them; its
    commit, one, is counted by the caller's window and left out). With *reset_statements*,
    the statement profile starts there too, before any worker can see the rows."""
    before = DbCounters.read(mon)
    with mon.transaction():
        mon.execute(_s("SELECT {s}.submit('bench', %s::jsonb) FROM generate_series(1, %s)",
                       schema), [args, n])
        row = mon.execute("SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), "
                          "%s::pg_lsn)::bigint, pg_current_wal_insert_lsn()::text",
                          [before.lsn]).fetchone()
        pg_cpu = postgres_cpu_seconds(mon.info.backend_pid)
        if reset_statements:
            statements.reset(mon)
    assert row is not None
    return before, Submission(int(row[0]), pg_cpu - before.pg_cpu_s, 1, str(row[1]))


def run_kestrel(dsn: str, p: dict[str, Any], *, quiet: bool = False) -> dict[str, Any]:
    schema = "bench_kestrel"
    fresh_schema(dsn, schema)
    n, steps = p["workflows"], p["steps"]
    args = json.dumps([steps, p["kind"], p["work"]])
    with psycopg.connect(dsn, autocommit=True, prepare_threshold=None) as mon:
        stop = threading.Event()
        submitter = None
        # Submitted once the runtime is up (the usual run): its start, the imports and the
        # pool's connections of each process, is a cost per process, not per workflow, and
        # is reported apart; the floors' loops fork from the bench, already started. With
        # a rate the submissions run alongside; with a backlog everything is queued first
        # (the claims must meet it), and the start is in the figures.
        after_start = not p["rate"] and not p["backlog"]
        if p["rate"]:
            submitter = threading.Thread(target=_submit_at_rate,
                                         args=(dsn, schema, n, args, p["rate"], stop))
        elif not after_start:
            _submit_up_front(dsn, schema, n, args)
        if p["backlog"]:
            _submit_up_front(dsn, schema, p["backlog"], args)
            mon.execute(_s("ANALYZE {s}.workflow_executions", schema))
        before = DbCounters.read(mon)
        submission = Submission(0, 0.0, 0)
        if p.get("statements") and not after_start:
            statements.reset(mon)
        polls = 0
        # The runtime runs this checkout's code (src/ first), whichever environment's
        # Python runs the bench: an A/B of two checkouts can share one virtualenv.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
        cmd = [sys.executable, "-m", "kestrel", "--app", "bench.workloads", "--dsn", dsn,
               "--schema", schema, "--procs", str(p["procs"]),
               "--concurrency", str(p["concurrency"]), "--batch-size", str(p["batch_size"]),
               "--lease", str(p["lease"]), "--heartbeat", str(p["heartbeat"]),
               "--log-level", "warning", "--metrics-port", str(_free_port())]
        metrics_port = int(cmd[-1])
        if p["with_limited"]:
            # Work waiting in limited queues the whole time, claimed alongside.
            for queue in ("bench-limited-a", "bench-limited-b"):
                mon.execute(_s("SELECT {s}.submit('bench_limited', '[5.0]', %s) "
                               "FROM generate_series(1, 500)", schema), [queue])
            cmd += ["--queues", "default,bench-limited-a,bench-limited-b"]
        if p["connection_mode"] != "direct":
            cmd += ["--connection-mode", p["connection_mode"]]
        if p["prepare"] != "auto":
            cmd += ["--prepare", p["prepare"]]
        runtime = subprocess.Popen(cmd, env=env, cwd=ROOT)
        cpu = TreeCpu(runtime.pid)
        spy = (profiles.Recorder(runtime.pid, Path(p["py_spy"]) / "kestrel.raw")
               if p.get("py_spy") else None)
        raw = None
        start_cpu = 0.0
        if after_start:
            _wait_for_workers(mon, schema, p["procs"], runtime)
            cpu.sample()
            start_cpu = cpu.seconds
            before, submission = _submit_counted(mon, schema, n, args,
                                                 reset_statements=bool(p.get("statements")))
        if submitter:
            submitter.start()
        started = time.monotonic()
        count = _s("SELECT count(*) FROM {s}.workflow_history WHERE queue = 'default'", schema)
        try:
            while True:
                time.sleep(0.25)
                cpu.sample()
                done = (mon.execute(count).fetchone() or [0])[0]
                polls += 1
                if not quiet:
                    progress(done, n, started, "kestrel")
                if done >= n:
                    break
                if runtime.poll() is not None:
                    raise RuntimeError(f"kestrel-runtime exited with {runtime.returncode}")
                if time.monotonic() - started > p["timeout"]:
                    raise RuntimeError(f"only {done}/{n} finished in {p['timeout']}s")
            after = DbCounters.read(mon)
            raw = spy.stop() if spy else None
            stmts = statements.read(mon, n) if p.get("statements") else []
            claim_ms, limit = _runtime_metrics(metrics_port)
            wal_rel = (wal_by_relation(mon, submission.end_lsn or before.lsn, after.lsn,
                                       schema)
                       if p.get("wal_by_relation") else {})
        finally:
            if spy:
                spy.stop()
            stop.set()
            cpu.sample()
            runtime.send_signal(signal.SIGTERM)
            runtime.wait(timeout=60)
            if submitter:
                submitter.join()
        # A backend publishes its commit counts at most once a second while it lives, and
        # at once when it exits: count commits once the runtime's backends are gone (the
        # runtime's shutdown commits, a handful, are in).
        gone = _wait_for_other_backends(mon)
        commits_after = DbCounters.read(mon).commits
        if not quiet:
            print()
        # The first n to finish (with a backlog, more may finish while the runtime drains).
        stats = mon.execute(_s("""
            SELECT count(*) FILTER (WHERE status = 'completed'),
                   extract(epoch FROM max(finished_at) - min(started_at)),
                   percentile_cont(ARRAY[0.5, 0.95, 0.99]) WITHIN GROUP
                       (ORDER BY extract(epoch FROM started_at - created_at)),
                   percentile_cont(ARRAY[0.5, 0.95, 0.99]) WITHIN GROUP
                       (ORDER BY extract(epoch FROM finished_at - created_at))
              FROM (SELECT * FROM {s}.workflow_history WHERE queue = 'default'
                     ORDER BY finished_at LIMIT %s) AS first_n""", schema), [n]).fetchone()
        assert stats is not None
        tables = mon.execute(_s("""
            SELECT relname, pg_total_relation_size(relid), n_live_tup, n_dead_tup
              FROM pg_stat_user_tables WHERE schemaname = %s
               AND relname IN ('workflow_executions', 'operation_outputs')""", schema),
            [schema]).fetchall()
    completed, span = int(stats[0]), float(stats[1])
    if completed != n:
        raise RuntimeError(f"{completed}/{n} completed")
    # The harness's own read-only commits on mon are not kestrel's: the two counter reads
    # (3 statements each), the progress polls and the waits for backends. Those of the last
    # second may not be published yet, so this is exact to a few commits (of thousands).
    commits = commits_after - before.commits - polls - gone - 6 - submission.commits
    result = {
        "params": p,
        "workflows_per_s": n / span,
        "steps_per_s": n * steps / span,
        "seconds": span,
        "submit_to_start_ms": dict(zip(("p50", "p95", "p99"),
                                       (round(x * 1000, 1) for x in stats[2]), strict=True)),
        "submit_to_finish_ms": dict(zip(("p50", "p95", "p99"),
                                        (round(x * 1000, 1) for x in stats[3]), strict=True)),
        "worker_cpu_s_per_workflow": (cpu.seconds - start_cpu) / n,
        "postgres_cpu_s_per_workflow": (after.pg_cpu_s - before.pg_cpu_s
                                        - submission.pg_cpu_s) / n,
        "commits_per_workflow": commits / n,
        "wal_bytes_per_workflow": (after.wal_bytes - before.wal_bytes
                                   - submission.wal_bytes) / n,
        # The runtime's start (imports, migrations checked, pools), left out of the
        # workers' figure above; 0 where the workflows were queued before it started.
        "runtime_start_cpu_s": start_cpu,
        "hot_tables": {r[0]: {"bytes": r[1], "live": r[2], "dead": r[3]} for r in tables},
        "claim_ms": claim_ms,
        # The processes' concurrency limits at the end, summed: where an adaptive limit
        # (--concurrency 0) settled (kestrel_concurrency_limit_executions).
        "concurrency_limit_at_end": limit,
    }
    if stmts:
        result["statements"] = stmts
    if raw:
        result["py_spy"] = str(raw)
    if wal_rel:
        result["wal_bytes_per_workflow_by_relation"] = {k: round(v / n) for k, v in
                                                        wal_rel.items()}
    drop_schema(dsn, schema)
    return result


def _wait_for_other_backends(mon: psycopg.Connection[Any], timeout: float = 15.0) -> int:
    """Wait until *mon* is the only client backend of its database; return how many
    statements (each a commit) that took."""
    query = ("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
             "AND backend_type = 'client backend' AND pid <> pg_backend_pid()")
    deadline, polls = time.monotonic() + timeout, 0
    while time.monotonic() < deadline:
        polls += 1
        if not (mon.execute(query).fetchone() or [0])[0]:
            break
        time.sleep(0.05)
    return polls


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _runtime_metrics(port: int) -> tuple[dict[str, float], float]:
    """From the runtime's /metrics: p50 and p99 of the claim statement (ms, the upper bound
    of the histogram bucket where each quantile falls), and the concurrency limits of its
    processes, summed."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    buckets: dict[float, float] = {}
    limit = float("nan")
    for line in text.decode().splitlines():
        if line.startswith("kestrel_concurrency_limit_executions "):
            limit = float(line.rsplit(" ", 1)[1])
        if line.startswith("kestrel_claim_seconds_bucket"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            bound = float("inf") if le == "+Inf" else float(le)
            buckets[bound] = buckets.get(bound, 0.0) + float(line.rsplit(" ", 1)[1])
    total = buckets.get(float("inf"), 0.0)
    out: dict[str, float] = {}
    for name, q in (("p50", 0.5), ("p99", 0.99)):
        out[name] = next((round(b * 1000, 1) for b, c in sorted(buckets.items())
                          if total and c >= q * total), float("nan"))
    return out, limit


FLOOR_NAMES = {"group": "group floor", "step": "per-step floor"}
BOUNCER_POOL = 20
"""Server connections of the PgBouncer that --pgbouncer puts in front of the server."""


def _conc(r: dict[str, Any]) -> str:
    """The concurrency column: the fixed value, or 0 and where the adaptive limit ended."""
    given = r["params"]["concurrency"]
    end = r.get("concurrency_limit_at_end", float("nan"))
    if given or end != end:
        return str(given)
    return f"0→{end / r['params']['procs']:.0f}"


def run_floor(dsn: str, p: dict[str, Any], mode: str, quiet: bool = False,
              loops: tuple[int, ...] = floor.CONCURRENCIES) -> dict[str, Any]:
    """A floor at its best number of loops per process (swept over *loops*, those that fit
    the server: bench/preflight.py), same procs and work."""
    name = FLOOR_NAMES[mode]
    if not quiet:
        print(f"  {name}: {p['procs']} procs × {loops} loops, best kept …", flush=True)
    best = floor.run_best(dsn, f"bench_floor_{mode}", n=p["workflows"], steps=p["steps"],
                          procs=p["procs"], mode=mode, concurrencies=loops,
                          profile=bool(p.get("statements")),
                          py_spy=Path(p["py_spy"]) if p.get("py_spy") else None)
    if not quiet:
        print(f"  {name}: " + ", ".join(f"{t['concurrency']} loops: {t['workflows_per_s']}/s"
                                        for t in best["tried"]), flush=True)
    return best


def parse_sweep(items: list[str]) -> list[dict[str, Any]]:
    axes: list[tuple[str, list[Any]]] = []
    for item in items:
        key, _, values = item.partition("=")
        if key not in SWEEPABLE or not values:
            raise SystemExit(f"--sweep {item!r}: expected KEY=V1,V2 with KEY one of "
                             f"{', '.join(SWEEPABLE)}")
        axes.append((key, [SWEEPABLE[key](v) for v in values.split(",")]))
    return [dict(zip([a[0] for a in axes], combo, strict=True))
            for combo in itertools.product(*(a[1] for a in axes))]


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'procs':>5} {'conc':>9} {'batch':>5} {'lease':>5} {'wf/s':>8} {'steps/s':>8} "
            f"{'group':>7} {'ratio':>6} {'step':>7} {'ratio':>6} "
            f"{'start p50/p99 ms':>17} {'finish p50/p99 ms':>18} "
            f"{'commits/wf':>10} {'WAL B/wf':>9} {'backlog':>8} {'claim p50/p99 ms':>16}")
    lines = [head, "-" * len(head)]
    for r in rows:
        p = r["params"]
        s, f = r["submit_to_start_ms"], r["submit_to_finish_ms"]
        floors = ""
        for mode in floor.MODES:
            fl = r.get("floors", {}).get(mode)
            if fl:
                ratio = r["workflows_per_s"] / fl["workflows_per_s"]
                floors += f"{fl['workflows_per_s']:7.0f} {ratio:5.2f}× "
            else:
                floors += "      -      - "
        lines.append(
            f"{p['procs']:>5} {_conc(r):>9} {p['batch_size']:>5} {p['lease']:>5g} "
            f"{r['workflows_per_s']:8.0f} {r['steps_per_s']:8.0f} {floors}"
            f"{s['p50']:>8.0f}/{s['p99']:<8.0f} {f['p50']:>9.0f}/{f['p99']:<8.0f} "
            f"{r['commits_per_workflow']:10.2f} {r['wal_bytes_per_workflow']:9.0f} "
            f"{p.get('backlog', 0):>8} "
            f"{r['claim_ms']['p50']:>7g}/{r['claim_ms']['p99']:<8g}")
    return "\n".join(lines)


def side_by_side(r: dict[str, Any]) -> str:
    """kestrel and the floors of one point, one line each; k/this is kestrel's throughput
    over that line's."""
    head = (f"{'':<16} {'loops/proc':>10} {'wf/s':>7} {'k/this':>6} {'commits/wf':>10} "
            f"{'WAL B/wf':>8} {'CPU ms/wf workers + PostgreSQL = total':>38}")
    rows = [("kestrel", _conc(r), r)]
    rows += [(FLOOR_NAMES[m], f["concurrency"], f) for m, f in r.get("floors", {}).items()]
    lines = [head]
    for name, conc, x in rows:
        w, pg = x["worker_cpu_s_per_workflow"] * 1000, x["postgres_cpu_s_per_workflow"] * 1000
        ratio = ("     -" if x is r else
                 f"{r['workflows_per_s'] / x['workflows_per_s']:5.2f}×")
        lines.append(f"{name:<16} {conc:>10} {x['workflows_per_s']:7.0f} {ratio} "
                     f"{x['commits_per_workflow']:10.2f} {x['wal_bytes_per_workflow']:8.0f} "
                     f"{w:>19.3f} + {pg:.3f} = {w + pg:.3f}")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], keys: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x_key = keys[0] if keys else "batch_size"
    others = [k for k in keys if k != x_key]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(tuple(r["params"][k] for k in others), []).append(r)
    for label, rs in groups.items():
        rs.sort(key=lambda r: r["params"][x_key])
        xs = [r["params"][x_key] for r in rs]
        name = ", ".join(f"{k}={v}" for k, v in zip(others, label, strict=True)) or "kestrel"
        ax1.plot(xs, [r["workflows_per_s"] for r in rs], marker="o", label=name)
        ax2.plot(xs, [r["submit_to_finish_ms"]["p99"] for r in rs], marker="o", label=name)
        for mode, style in (("group", "--"), ("step", ":")):
            if mode in rs[0].get("floors", {}):
                ax1.plot(xs, [r["floors"][mode]["workflows_per_s"] for r in rs],
                         linestyle=style, color="grey", label=f"{FLOOR_NAMES[mode]} ({name})")
    for ax, title in ((ax1, "throughput (workflows/s)"), (ax2, "submit→finish p99 (ms)")):
        ax.set_xlabel(x_key)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if x_key in ("batch_size", "concurrency"):
            ax.set_xscale("log", base=2)
    ax1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dsn", help="PostgreSQL to use (default: embedded, in --data-dir)")
    ap.add_argument("--data-dir", default=str(ROOT / ".kestrel" / "bench-pgdata"))
    ap.add_argument("--workflows", type=int, default=5000)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--kind", choices=["noop", "sleep", "cpu"], default="noop")
    ap.add_argument("--work", type=float, default=0.0,
                    help="seconds per sleep step, or hash rounds per cpu step")
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=0,
                    help="per process; 0 (the runtime's default): its adaptive limit, whose "
                         "settled value is reported (mean per process)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lease", type=float, default=30.0)
    ap.add_argument("--heartbeat", type=float, default=10.0)
    ap.add_argument("--backlog", type=int, default=0,
                    help="executions queued through SQL before the runtime starts; "
                         "throughput is measured over the first --workflows to finish")
    ap.add_argument("--rate", type=float, default=0.0,
                    help="submit at this many workflows/s while running (default: all first)")
    ap.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2",
                    help=f"vary KEY over values (repeatable): {', '.join(SWEEPABLE)}")
    ap.add_argument("--no-floor", action="store_true", help="skip the floors")
    ap.add_argument("--flush-delay-us", type=int, default=None, metavar="N",
                    help="run the bench's own PostgreSQL with N µs added to every "
                         "fdatasync/fsync (an LD_PRELOAD shim, bench/flush_delay.c, built "
                         "with gcc); not with --dsn")
    ap.add_argument("--with-limited", action="store_true",
                    help="also keep work waiting in two limited queues (concurrency 2; "
                         "2 per second), each execution sleeping 5 s in a step")
    ap.add_argument("--pgbouncer", action="store_true",
                    help="run through a PgBouncer in transaction mode (Debian's pgbouncer)")
    ap.add_argument("--prepare", choices=["auto", "on", "off"], default="auto",
                    help="server-side prepared statements (kestrel --prepare)")
    ap.add_argument("--wal-by-relation", action="store_true",
                    help="attribute the run's WAL to the schema's tables and indexes "
                         "(pg_waldump on the embedded server's pg_wal)")
    ap.add_argument("--statements", action="store_true",
                    help="profile each side's statements on the server (pg_stat_statements: "
                         "calls, execution time and WAL per workflow); needs --dsn to a "
                         "server that preloads it (bench/statements.py)")
    ap.add_argument("--py-spy", action="store_true",
                    help="sample each side's client processes with py-spy while its "
                         "workflows run; raw profiles next to the results, their top "
                         "functions printed (bench/profiles.py)")
    ap.add_argument("--plot", action="store_true", help="write a PNG next to the JSON")
    ap.add_argument("--plan", action="store_true",
                    help="check the server's connection slots and print the sweep that fits "
                         "them (bench/preflight.py), then exit without running anything")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--label", default="run")
    ap.add_argument("--citus", metavar="DSN",
                    help="a Citus coordinator: tenants on one worker node, then on two "
                         "(bench/citus.py; --workflows per tenant, --procs, --concurrency)")
    ap.add_argument("--buckets", type=int, default=0,
                    help="with --citus: one namespace of N buckets on one worker node, then "
                         "spread over all (--workflows in all)")
    ns = ap.parse_args(argv)
    if ns.buckets and not ns.citus:
        ap.error("--buckets measures a namespace on Citus: give --citus DSN")
    if ns.citus:
        from bench import citus

        return citus.main(["--dsn", ns.citus, "--workflows", str(ns.workflows),
                           "--procs", str(ns.procs), "--concurrency", str(ns.concurrency),
                           "--buckets", str(ns.buckets),
                           "--timeout", str(ns.timeout), "--out", ns.out])

    if ns.dsn and ns.flush_delay_us is not None:
        ap.error("--flush-delay-us needs the bench's own PostgreSQL (it starts the server "
                 "with the shim); a server given by --dsn was started by someone else")
    if ns.flush_delay_us is not None and ns.flush_delay_us < 0:
        ap.error("--flush-delay-us must be 0 or more")
    if ns.statements and not ns.dsn:
        ap.error("--statements needs --dsn: a server that preloads pg_stat_statements (the "
                 "embedded one is built without it)")
    if ns.statements and ns.pgbouncer:
        ap.error("--statements reads the server directly; run it without --pgbouncer")
    if ns.py_spy:
        try:
            profiles.check()
        except profiles.NotAvailable as exc:
            ap.error(str(exc))
    delay = ns.flush_delay_us or 0
    base = {k: getattr(ns, k) for k in ("workflows", "steps", "kind", "work", "procs",
                                        "concurrency", "batch_size", "lease", "heartbeat",
                                        "rate", "timeout", "with_limited", "prepare",
                                        "backlog", "wal_by_relation", "statements")}
    base["connection_mode"] = "pgbouncer" if ns.pgbouncer else "direct"
    points = parse_sweep(ns.sweep) or [{}]
    keys = list(points[0])
    dsn, server = database(ns.dsn, ns.data_dir, delay)
    # Before anything is created or started: what the server's connection slots allow
    # (bench/preflight.py). A sweep point or floor loop count that cannot fit is dropped with
    # a line saying so; when nothing fits, one line names the setting and stops here.
    try:
        limits = preflight.read(dsn)
        fit = preflight.plan(limits, base, points, floors=not ns.no_floor,
                             loops=floor.CONCURRENCIES,
                             bouncer_pool=BOUNCER_POOL if ns.pgbouncer else None)
    except preflight.Refused as exc:
        print(f"bench.run: {exc}", file=sys.stderr)
        return 1
    print(preflight.describe(limits, fit))
    for note in fit.notes:
        print(note)
    points = fit.points
    if ns.plan:
        for point in points:
            p = {**base, **point}
            loops = fit.floor_loops.get(p["procs"])
            print(f"- {json.dumps(point) if point else 'run'}: kestrel "
                  f"{preflight.kestrel_need(p)} connections"
                  + (f"; floors {p['procs']} procs × {loops} loops" if loops else ""))
        del server
        return 0
    with psycopg.connect(dsn, autocommit=True, prepare_threshold=None) as conn:
        sync_method = (conn.execute("SHOW wal_sync_method").fetchone() or ["?"])[0]
        if ns.statements:
            try:
                statements.check(conn)
            except statements.NotAvailable as exc:
                ap.error(str(exc))
    latency = commit_latency_ms(dsn)
    server_note = (f"flush delay {delay} µs" if not ns.dsn else "server given by --dsn")
    print(f"PostgreSQL: {server_note}, wal_sync_method {sync_method}; single-client commit "
          f"p50 {latency['p50']:.2f} ms, mean {latency['mean']:.2f} ms")
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    base["py_spy"] = str(Path(ns.out) / f"{ns.label}-{stamp}-py-spy") if ns.py_spy else ""
    bouncer = None
    if ns.pgbouncer:
        from tests.pgbouncer import PgBouncer

        bouncer = PgBouncer(dsn, pool_size=BOUNCER_POOL)
        dsn = bouncer.dsn
    print(f"kestrel bench on {machine()}, commit {git_rev()}")
    rows: list[dict[str, Any]] = []
    floors: dict[tuple[int, int, int], dict[str, dict[str, Any]]] = {}
    for i, point in enumerate(points):
        p = {**base, **point}
        if p["py_spy"]:
            p["py_spy"] = str(Path(base["py_spy"]) / f"point-{i}")
        print(f"- {json.dumps(point) if point else 'run'}")
        r = run_kestrel(dsn, p)
        if not ns.no_floor:
            key = (p["procs"], p["workflows"], p["steps"])
            if key not in floors:
                floors[key] = {mode: run_floor(dsn, p, mode,
                                               loops=fit.floor_loops[p["procs"]])
                               for mode in floor.MODES}
            r["floors"] = floors[key]
            for mode, f in floors[key].items():
                r[f"ratio_to_{mode}_floor"] = r["workflows_per_s"] / f["workflows_per_s"]
        rows.append(r)
    print()
    print(table(rows))
    for r in rows:
        print()
        print(side_by_side(r))
        for rel, size in r.get("wal_bytes_per_workflow_by_relation", {}).items():
            print(f"  WAL B/workflow {size:6d}  {rel}")
        sides = [("kestrel", r)] + [(f"{FLOOR_NAMES[m]} ({f['concurrency']} loops/proc)", f)
                                    for m, f in r.get("floors", {}).items()]
        for name, side in sides:
            if side.get("statements"):
                print()
                print(statements.table(name, side["statements"]))
        for name, side in sides:
            if side.get("py_spy"):
                print()
                print(profiles.summary(f"{name}, client processes", Path(side["py_spy"])))
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{ns.label}-{stamp}.json"
    path.write_text(json.dumps({"machine": machine(), "commit": git_rev(), "date": stamp,
                                "flush_delay_us": None if ns.dsn else delay,
                                "wal_sync_method": sync_method,
                                "single_client_commit_ms": latency,
                                "connections": {"room": limits.free, "peak_planned": fit.peak,
                                                "cut": fit.notes},
                                "command": " ".join(["python -m bench.run", *(argv or
                                                     sys.argv[1:])]),
                                "results": rows}, indent=2))
    print(f"\nwrote {path}")
    if ns.plot:
        png = path.with_suffix(".png")
        plot(rows, keys, png)
        print(f"wrote {png}")
    if bouncer:
        bouncer.stop()
    del server
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

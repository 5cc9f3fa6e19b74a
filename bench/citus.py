"""kestrel on a Citus cluster (issue 24): tenants on one worker node, then on two (step 1);
with ``--buckets N``, one namespace of N buckets on one worker node, then spread (step 2).

    python -m bench.run --citus postgresql://postgres@127.0.0.1:5440/postgres --workflows 2000
    python -m bench.citus --dsn postgresql://postgres@127.0.0.1:5440/postgres
    python -m bench.citus --buckets 4 --workflows 4000

Each layout has T tenants (T = 1, then one per worker node), each a distributed schema on a
worker node of its own, each with ``--workflows`` 3-step no-op workflows submitted up front
and one ``kestrel-runtime --procs P`` connected to the coordinator. Reported per layout:
workflows per second over all tenants (first start to last finish); per workflow, the
transactions committed on each node (``pg_stat_database`` read on each node), each node's
PostgreSQL CPU milliseconds (its processes, found by ``cluster_name``), and the
distributed statements the coordinator executed (``citus_stat_counters``: single-shard,
multi-shard), counted with ``citus.enable_stat_counters`` on for the runtimes' sessions.

On one machine the nodes share its cores, so two nodes do not double throughput here: the
figures show routing and statement counts per workflow (the model for a real cluster is in
BENCHMARKS.md), not a speedup.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil
import psycopg
from psycopg import sql as pgsql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from bench.common import ROOT, git_rev, machine


def _nodes(dsn: str) -> dict[str, int]:
    """Every node's role -> port: 'coordinator' and each worker as 'worker:<port>'."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT groupid, nodeport FROM pg_dist_node "
                            "WHERE noderole = 'primary' ORDER BY groupid").fetchall()
    return {("coordinator" if g == 0 else f"worker:{p}"): int(p) for g, p in rows}


def _on(dsn: str, port: int) -> str:
    return make_conninfo(dsn, port=str(port))


def _commits(dsn: str, port: int) -> int:
    with psycopg.connect(_on(dsn, port), autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute("SELECT xact_commit FROM pg_stat_database "
                           "WHERE datname = current_database()").fetchone()
    return int(row[0]) if row else 0


class NodeCpu:
    """CPU seconds of each node's PostgreSQL processes (found by the node's cluster_name in
    their titles), sampled while the run lasts: a backend's last sample counts, so one that
    exits between samples loses at most a quarter second of its time."""

    def __init__(self, dsn: str, nodes: dict[str, int]) -> None:
        self.names: dict[str, str] = {}
        for role, port in nodes.items():
            with psycopg.connect(_on(dsn, port), autocommit=True) as conn:
                name = (conn.execute("SHOW cluster_name").fetchone() or [""])[0]
            if not name:
                raise SystemExit(f"node {port} has no cluster_name: its CPU cannot be told apart")
            self.names[role] = f" {name}: "
        self.start: dict[int, float] = {}
        self.last: dict[int, tuple[str, float]] = {}
        self.sample(first=True)

    def sample(self, first: bool = False) -> None:
        for proc in psutil.process_iter(["pid", "cmdline", "cpu_times"]):
            title = " ".join(proc.info["cmdline"] or [])
            role = next((r for r, n in self.names.items() if n in f" {title}"), None)
            if role is None or proc.info["cpu_times"] is None:
                continue
            t = proc.info["cpu_times"].user + proc.info["cpu_times"].system
            if first:
                self.start[proc.info["pid"]] = t
            self.last[proc.info["pid"]] = (role, t)

    def seconds(self) -> dict[str, float]:
        out = dict.fromkeys(self.names, 0.0)
        for pid, (role, t) in self.last.items():
            out[role] += t - self.start.get(pid, 0.0)
        return out


def _counters(dsn: str) -> tuple[int, int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT sum(query_execution_single_shard)::bigint, "
                           "sum(query_execution_multi_shard)::bigint "
                           "FROM citus_stat_counters").fetchone()
    return (int(row[0] or 0), int(row[1] or 0)) if row else (0, 0)


def _place(dsn: str, schema: str, port: int) -> None:
    """Move the distributed schema *schema* to the worker node at *port* unless it is there."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        at = conn.execute("SELECT DISTINCT nodeport FROM citus_shards "
                          "WHERE table_name::text LIKE %s || '.%%'", [schema]).fetchall()
        if [r[0] for r in at] != [port]:
            host = conninfo_to_dict(dsn).get("host") or "127.0.0.1"
            conn.execute("SELECT citus_schema_move(%s::regnamespace, %s, %s, 'block_writes')",
                         [schema, host, port])


def _sharding(dsn: str) -> str:
    return make_conninfo(dsn, options="-c citus.enable_schema_based_sharding=on")


def _tenant(dsn: str, port: int) -> str:
    """A fresh tenant schema living on the worker node at *port*."""
    from kestrel.migrate import migrate

    name = f"bench_citus_{uuid.uuid4().hex[:8]}"
    migrate(_sharding(dsn), name)
    _place(dsn, name, port)
    return name


def _namespace(dsn: str, buckets: int, ports: list[int]) -> tuple[str, list[str]]:
    """A fresh namespace of *buckets*, bucket k on the worker node ``ports[k % len]``."""
    from kestrel import buckets as b
    from kestrel.migrate import migrate_namespace

    name = f"bench_ns_{uuid.uuid4().hex[:8]}"
    migrate_namespace(_sharding(dsn), name, buckets=buckets)
    schemas = b.schemas(name, buckets)
    for k, schema in enumerate(schemas):
        _place(dsn, schema, ports[k % len(ports)])
    return name, schemas


def run_layout(dsn: str, ports: list[int], p: dict[str, Any]) -> dict[str, Any]:
    """Step 1: one tenant per port in *ports*, all running at once; the figures."""
    tenants = [_tenant(dsn, port) for port in ports]
    try:
        r = _measure(dsn, tenants, [(t, p["procs"]) for t in tenants], p["workflows"], p)
        return {"tenants": len(tenants), "worker_nodes": sorted(ports), **r}
    finally:
        _drop(dsn, tenants)


def run_namespace_layout(dsn: str, ports: list[int], p: dict[str, Any]) -> dict[str, Any]:
    """Step 2: one namespace of ``p["buckets"]`` buckets spread over *ports*, one runtime
    with a process per bucket (or ``p["procs"]``, when more), ``p["workflows"]`` in all,
    the same count in each bucket; the figures."""
    name, schemas = _namespace(dsn, p["buckets"], ports)
    try:
        n = p["workflows"] // len(schemas)
        r = _measure(dsn, schemas, [(name, max(p["procs"], len(schemas)))], n, p)
        return {"buckets": len(schemas), "worker_nodes": sorted(ports), **r}
    finally:
        _drop(dsn, schemas)


def _drop(dsn: str, schemas: list[str]) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for t in schemas:
            conn.execute(pgsql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
                pgsql.Identifier(t)))


def _measure(dsn: str, schemas: list[str], runs: list[tuple[str, int]], n: int,
             p: dict[str, Any]) -> dict[str, Any]:
    """*n* workflows submitted up front into each of *schemas* (by its own ``submit()``, so
    a bucket's ids name it), then one ``kestrel-runtime --schema S --procs P`` for each
    ``(S, P)`` of *runs* until all have finished; the figures."""
    nodes = _nodes(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        for t in schemas:
            conn.execute(pgsql.SQL("SELECT {}.submit('bench', '[3, \"noop\", 0]'::jsonb) "
                                   "FROM generate_series(1, %s)").format(
                pgsql.Identifier(t)), [n])
    commits = {role: _commits(dsn, port) for role, port in nodes.items()}
    counters = _counters(dsn)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    counting = make_conninfo(dsn, options="-c citus.enable_stat_counters=on")
    runtimes = [subprocess.Popen(
        [sys.executable, "-m", "kestrel", "--app", "bench.workloads", "--dsn", counting,
         "--schema", schema, "--procs", str(procs), "--concurrency", str(p["concurrency"]),
         "--log-level", "warning", "--metrics-port", "0"], env=env, cwd=ROOT)
        for schema, procs in runs]
    started = time.monotonic()
    cpu = NodeCpu(dsn, nodes)
    total = n * len(schemas)
    try:
        with psycopg.connect(dsn, autocommit=True) as mon:
            while True:
                time.sleep(0.25)
                cpu.sample()
                done = sum(int((mon.execute(pgsql.SQL(
                    "SELECT count(*) FROM {}.workflow_history").format(
                    pgsql.Identifier(t))).fetchone() or [0])[0]) for t in schemas)
                if done >= total:
                    break
                if any(r.poll() is not None for r in runtimes):
                    raise RuntimeError("a kestrel-runtime exited")
                if time.monotonic() - started > p["timeout"]:
                    raise RuntimeError(f"only {done}/{total} finished")
            spans = [mon.execute(pgsql.SQL(
                "SELECT min(started_at), max(finished_at) FROM {}.workflow_history").format(
                pgsql.Identifier(t))).fetchone() for t in schemas]
    finally:
        for r in runtimes:
            r.terminate()
        for r in runtimes:
            r.wait(timeout=60)
    first = min(s[0] for s in spans if s)
    last = max(s[1] for s in spans if s)
    after = {role: _commits(dsn, port) for role, port in nodes.items()}
    single, multi = (a - b for a, b in zip(_counters(dsn), counters, strict=True))
    return {
        "workflows_per_s": total / (last - first).total_seconds(),
        "commits_per_workflow": {role: round((after[role] - commits[role]) / total, 3)
                                 for role in nodes},
        "postgres_cpu_ms_per_workflow": {role: round(sec * 1000 / total, 3)
                                         for role, sec in cpu.seconds().items()},
        "single_shard_statements_per_workflow": round(single / total, 3),
        "multi_shard_statements_per_workflow": round(multi / total, 3),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.citus", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dsn", default=os.environ.get(
        "KESTREL_CITUS_DSN", "postgresql://postgres@127.0.0.1:5440/postgres"),
        help="the Citus coordinator (default: the local one, or KESTREL_CITUS_DSN)")
    ap.add_argument("--workflows", type=int, default=2000,
                    help="per tenant; with --buckets, in all")
    ap.add_argument("--procs", type=int, default=1,
                    help="worker processes per tenant; with --buckets, of the runtime (at "
                         "least one per bucket)")
    ap.add_argument("--buckets", type=int, default=0,
                    help="step 2: one namespace of N buckets (2-256), on one worker node and "
                         "then spread over all of them, instead of a tenant per node")
    ap.add_argument("--concurrency", type=int, default=0,
                    help="per process; 0 (the runtime's default): its adaptive limit")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args(argv)
    p = vars(args)
    workers = [port for role, port in _nodes(args.dsn).items() if role != "coordinator"]
    if not workers:
        raise SystemExit(f"{args.dsn}: no worker nodes (is it a Citus coordinator?)")
    print(f"Citus at {args.dsn}: worker nodes {workers}; {machine()}")
    results = []
    for layout in ([workers[0]], workers):
        if args.buckets:
            r = run_namespace_layout(args.dsn, layout, p)
            what = f"{r['buckets']} buckets"
        else:
            r = run_layout(args.dsn, layout, p)
            what = f"{r['tenants']} tenant(s)"
        results.append(r)
        print(f"  {what} on {r['worker_nodes']}: "
              f"{r['workflows_per_s']:.0f} wf/s; per workflow: commits "
              + ", ".join(f"{k} {v}" for k, v in r["commits_per_workflow"].items())
              + "; PostgreSQL CPU ms "
              + ", ".join(f"{k} {v}" for k, v in r["postgres_cpu_ms_per_workflow"].items())
              + f"; distributed statements {r['single_shard_statements_per_workflow']} "
              f"single-shard, {r['multi_shard_statements_per_workflow']} multi-shard",
              flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    path = out / f"citus-{stamp}.json"
    path.write_text(json.dumps({"machine": machine(), "rev": git_rev(), "params": p,
                                "results": results}, indent=2, default=str))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

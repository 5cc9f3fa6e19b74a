"""The incident-response demo: ``kestrel-runtime demo`` (and ``make run``).

A failing-workload alert starts ``incident_response``: a (simulated) AI root-cause analysis,
a generated fix, a wait for a human's approval (``wait_for_signal``: the execution is parked
as a row, holding no worker), and a (simulated) GitOps pull request. Every step is
checkpointed, so a worker killed mid-incident resumes at the next step without redoing the
analysis.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import subprocess
import sys
import time
from typing import Any

import kestrel
from kestrel.config import Config

CAUSES = [
    ("OOMKilled", "memory limit 256Mi is below the p99 working set of 410Mi",
     "raise resources.limits.memory to 512Mi"),
    ("CrashLoopBackOff", "readiness probe hits /healthz before migrations finish",
     "add initialDelaySeconds: 20 to the readiness probe"),
    ("ImagePullBackOff", "tag v2.3.1 was never pushed to the registry",
     "pin the image to v2.3.0"),
]


@kestrel.step(retries=2, base_delay=0.1)
async def analyze_root_cause(alert: dict[str, Any]) -> dict[str, Any]:
    """Ask the (simulated) model what went wrong; slow and retried, so checkpointed."""
    await asyncio.sleep(0.05)
    n = int(hashlib.sha256(alert["workload"].encode()).hexdigest(), 16) // 7
    reason, cause, _ = CAUSES[n % len(CAUSES)]
    return {"reason": reason, "cause": cause, "confidence": round(0.7 + (n % 30) / 100, 2)}


@kestrel.step
def generate_fix(alert: dict[str, Any], rca: dict[str, Any]) -> dict[str, Any]:
    """A plain function: runs in a worker thread, never blocking the event loop."""
    time.sleep(0.01)
    fix = next(f for r, _, f in CAUSES if r == rca["reason"])
    return {"patch": f"{alert['workload']}: {fix}", "files": [f"k8s/{alert['workload']}.yaml"]}


@kestrel.step
async def open_pull_request(alert: dict[str, Any], fix: dict[str, Any]) -> dict[str, Any]:
    """Open the GitOps PR; the step's idempotency key makes a retried call safe downstream."""
    await asyncio.sleep(0.02)
    key = kestrel.current_step().idempotency_key
    number = int(hashlib.sha256(key.encode()).hexdigest(), 16) % 9000 + 1000
    return {"url": f"https://git.example.com/infra/pulls/{number}", "title": fix["patch"]}


APPROVAL_TIMEOUT_S = 7 * 24 * 3600
"""A week: the execution waits as one row, holding no worker, until a human answers."""


@kestrel.workflow(name="incident_response")
async def incident_response(ctx: kestrel.Context, alert: dict[str, Any]) -> dict[str, Any]:
    """Handle one alert: analyse it, generate a fix, wait for approval, open a pull request.

    The wait lasts up to a week. Returns what happened: ``pr_opened`` (with the pull request),
    ``rejected`` or ``expired``.
    """
    rca = await ctx.step(analyze_root_cause, alert)
    fix = await ctx.step(generate_fix, alert, rca)
    await ctx.set_event("stage", "awaiting_approval")
    decision = await ctx.wait_for_signal("approval", timeout=APPROVAL_TIMEOUT_S)
    outcome = {"workload": alert["workload"], "cause": rca["reason"], "fix": fix["patch"]}
    if decision.timed_out:
        return {**outcome, "outcome": "expired"}
    answer = decision.payload or {}
    if not answer.get("approved"):
        return {**outcome, "outcome": "rejected", "by": answer.get("by")}
    pr = await ctx.step(open_pull_request, alert, fix)
    return {**outcome, "outcome": "pr_opened", "by": answer.get("by"),
            "pull_request": pr["url"]}


def run(cfg: Config, *, incidents: int) -> int:
    """Start the runtime, raise *incidents* alerts, approve them, show what happened."""
    import psycopg

    from kestrel import db
    from kestrel.client import SyncClient
    from kestrel.embedded import resolve_dsn
    from kestrel.migrate import migrate
    from kestrel.sql import queries

    def cli(*argv: str) -> None:
        """Run `kestrel-runtime ARGV` as the operator would, in a process of its own."""
        sys.stdout.flush()
        subprocess.run([sys.executable, "-m", "kestrel", *argv], check=True)

    incidents = max(incidents, 3)
    dsn, server = resolve_dsn(cfg)
    print(f"kestrel demo: PostgreSQL at {dsn or '(PG* environment)'}, schema {cfg.schema}")
    migrate(dsn, cfg.schema, history_interval=cfg.history_interval,
                      history_ahead=cfg.history_ahead)
    procs = max(cfg.procs, 2)
    env = dict(os.environ, KESTREL_DSN=dsn, KESTREL_SCHEMA=cfg.schema,
               KESTREL_APP="kestrel.demo", KESTREL_PROCS=str(procs))
    print(f"\n1. starting the runtime: kestrel-runtime --procs {procs} --app kestrel.demo")
    runtime = subprocess.Popen([sys.executable, "-m", "kestrel", "--log-level", "warning"],
                               env=env)
    try:
        client = SyncClient(dsn, schema=cfg.schema, pool_size=2)
        run_id = f"{time.time():.0f}"
        print(f"2. {incidents} KubePodCrashLooping alerts arrive; each starts "
              "incident_response (root-cause analysis → fix → human approval → pull request)")
        handles = []
        for i in range(incidents):
            alert = {"workload": f"payments-api-{i}", "namespace": "prod",
                     "alert": "KubePodCrashLooping"}
            handles.append(client.submit(incident_response, alert,
                                         idempotency_key=f"demo-{run_id}-alert-{i}"))
        for h in handles:
            client.get_event(h.id, "stage", timeout=60)
        deadline = time.monotonic() + 30
        while True:  # the event comes just before the park: give the parks a moment
            waiting = sum(1 for h in handles if client.get(h.id).status.value == "waiting")
            if waiting == len(handles) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        print(f"3. analysis and fixes done; {waiting} executions now wait for approval as rows "
              "in PostgreSQL (no worker, no lease held)")
        print("4. humans answer:")
        approver, sql_one, rejected = handles[0], handles[1], handles[2]
        for h in handles:
            if h in (sql_one, rejected):
                continue
            client.signal(h.id, "approval", {"approved": True, "by": "alice (Slack)"})
        print(f"   - from Python (a Slack button handler): approved {incidents - 2}")
        with psycopg.connect(dsn, autocommit=True) as conn:  # the statement SQL users run
            db.run_sync(conn, db.value(queries(cfg.schema).signal, {
                "id": sql_one.id, "name": "approval", "idempotency_key": None,
                "payload": '{"approved": true, "by": "bob (SQL)"}'}))
        print(f"   - from SQL: SELECT {cfg.schema}.signal('{sql_one.id}', 'approval', "
              "'{\"approved\": true, \"by\": \"bob (SQL)\"}')")
        base = ["--dsn", dsn, "--schema", cfg.schema, "--log-level", "warning"]
        print(f"   - from the CLI: kestrel-runtime signal {rejected.id} approval "
              "--payload '{\"approved\": false, \"by\": \"carol (CLI)\"}'")
        print("     ", end="", flush=True)
        cli("signal", str(rejected.id), "approval", "--payload",
            '{"approved": false, "by": "carol (CLI)"}', *base)
        results = [h.result(timeout=120) for h in handles]
        print("\n5. outcomes:")
        for r in results[:4]:
            where = r.get("pull_request") or r["outcome"]
            print(f"   {r['workload']:<16} {r['cause']:<18} {r['outcome']:<10} "
                  f"by {r.get('by')!s:<16} {where}")
        if len(results) > 4:
            print(f"   … and {len(results) - 4} more")
        print("\n$ kestrel-runtime stats")
        cli("stats", *base)
        print(f"\n$ kestrel-runtime show {approver.id}")
        cli("show", str(approver.id), *base)
        opened = sum(1 for r in results if r["outcome"] == "pr_opened")
        print(f"\ndemo done: {opened} pull requests opened, "
              f"{sum(1 for r in results if r['outcome'] == 'rejected')} rejected. "
              f"Data stays in {cfg.data_dir}; `make clean` removes it.")
        client.close()
        return 0
    finally:
        runtime.send_signal(signal.SIGTERM)
        runtime.wait(timeout=60)
        del server

"""The incident-response demo: ``kestrel-runtime demo`` (and ``make run``).

A failing-workload alert starts ``incident_response``: a (simulated) AI root-cause analysis,
a generated fix, and a (simulated) GitOps pull request. Every step is checkpointed, so a
worker killed mid-incident resumes at the next step without redoing the analysis.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import signal
import subprocess
import sys
import time
from typing import Any

import kestrel
from kestrel.config import Config

log = logging.getLogger("kestrel.demo")

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
    n = int(hashlib.sha256(alert["workload"].encode()).hexdigest(), 16)
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


@kestrel.workflow(name="incident_response")
async def incident_response(ctx: kestrel.Context, alert: dict[str, Any]) -> dict[str, Any]:
    rca = await ctx.step(analyze_root_cause, alert)
    fix = await ctx.step(generate_fix, alert, rca)
    pr = await ctx.step(open_pull_request, alert, fix)
    return {"workload": alert["workload"], "cause": rca["reason"], "pull_request": pr["url"]}


def run(cfg: Config, *, incidents: int) -> int:
    """Start the runtime, submit *incidents* alerts, wait for them, show the outcome."""
    from kestrel.cli import resolve_dsn
    from kestrel.client import SyncClient
    from kestrel.migrate import migrate

    dsn, server = resolve_dsn(cfg)
    print(f"kestrel demo: PostgreSQL at {dsn or '(PG* environment)'} (schema {cfg.schema})")
    migrate(dsn, cfg.schema)
    procs = max(cfg.procs, 2)
    env = dict(os.environ, KESTREL_DSN=dsn, KESTREL_SCHEMA=cfg.schema,
               KESTREL_APP="kestrel.demo", KESTREL_PROCS=str(procs))
    print(f"starting kestrel-runtime --procs {procs} --app kestrel.demo")
    runtime = subprocess.Popen([sys.executable, "-m", "kestrel", "--log-level", "warning"],
                               env=env)
    try:
        client = SyncClient(dsn, schema=cfg.schema)
        started = time.monotonic()
        handles = []
        for i in range(incidents):
            alert = {"workload": f"payments-api-{i % 7}", "namespace": "prod",
                     "alert": "KubePodCrashLooping", "n": i}
            handles.append(client.submit(incident_response, alert,
                                         idempotency_key=f"demo-alert-{started:.0f}-{i}"))
        print(f"submitted {incidents} incidents; waiting for them to finish…")
        results = [h.result(timeout=120) for h in handles]
        took = time.monotonic() - started
        print(f"\nall {len(results)} incidents handled in {took:.2f}s\n")
        for r in results[:3]:
            print(f"  {r['workload']:<16} {r['cause']:<18} → {r['pull_request']}")
        print("\n$ kestrel-runtime stats")
        from kestrel.cli import main as cli_main

        base = ["--dsn", dsn, "--schema", cfg.schema]
        cli_main(["stats", *base])
        print(f"\n$ kestrel-runtime show {handles[0].id}")
        cli_main(["show", handles[0].id.hex, *base])
        return 0
    finally:
        runtime.send_signal(signal.SIGTERM)
        runtime.wait(timeout=60)
        del server

"""The incident-response demo: ``kestrel-runtime demo`` (and ``make run``).

A failing-workload alert starts ``incident_response``: a (simulated) AI root-cause analysis,
a generated fix, a wait for a human's approval (``wait_for_signal``: the execution is parked
as a row, holding no worker), and a (simulated) GitOps pull request. Every step is
checkpointed, so a worker killed mid-incident resumes at the next step without redoing the
analysis.

The runtime also serves the HTTP door on 127.0.0.1 (the web UI under ``/ui``). The demo
answers all incidents but one from Python, SQL and the CLI, creates a token for the
operator, and prints the UI's address and the token, so a person can approve the last one in
the browser. On a terminal it keeps serving until Ctrl-C; otherwise (CI, scripts) it stops
after printing what a person would do, and the waiting incident stays in the database.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path
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
    """Start the runtime (with the HTTP door), raise *incidents* alerts, answer them, show
    what happened; then leave one more waiting for a person in the web UI and print its
    address and a token. On a terminal, serve until Ctrl-C; otherwise return at once."""
    from kestrel import connections, db, statements
    from kestrel.client import SyncClient
    from kestrel.embedded import resolve_dsn
    from kestrel.migrate import migrate
    from kestrel.parentage import set_parent_death_signal
    from kestrel.sql import queries

    def cli(*argv: str) -> None:
        """Run `kestrel-runtime ARGV` as the operator would, in a process of its own."""
        sys.stdout.flush()
        subprocess.run([sys.executable, "-m", "kestrel", *argv], check=True)

    incidents = max(incidents, 3)
    prog = command_name()
    # SIGTERM (a terminal closed, `kill`) ends the demo the way Ctrl-C does: through the
    # `finally` below, which stops the runtime it started, and the exit handlers, which stop
    # the embedded PostgreSQL. Python's default for SIGTERM skips both: orphans.
    signal.signal(signal.SIGTERM, _terminate)
    dsn, server = resolve_dsn(cfg)
    print(f"kestrel demo: PostgreSQL at {dsn or '(PG* environment)'}, schema {cfg.schema}")
    migrate(dsn, cfg.schema, history_interval=cfg.history_interval,
                      history_ahead=cfg.history_ahead)
    procs = max(cfg.procs, 2)
    port = http_port(cfg.http_host, cfg.http_port)
    env = dict(os.environ, KESTREL_DSN=dsn, KESTREL_SCHEMA=cfg.schema,
               KESTREL_APP="kestrel.demo", KESTREL_PROCS=str(procs),
               KESTREL_HTTP_HOST=cfg.http_host, KESTREL_HTTP_PORT=str(port))
    print(f"\n1. starting the runtime: kestrel-runtime --procs {procs} --app kestrel.demo "
          f"--http-port {port}")
    # The runtime stops when the demo does, however it ends: SIGKILLed, the demo could not
    # stop it, and it ran on, orphaned, with its workers and the UI's port.
    runtime = subprocess.Popen([sys.executable, "-m", "kestrel", "--log-level", "warning"],
                               env=env, preexec_fn=functools.partial(
                                   set_parent_death_signal, os.getpid(), signal.SIGTERM))
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
        with connections.connect(dsn) as conn:  # the statement SQL users run
            db.run_sync(conn, statements.client.signal(
                queries(cfg.schema), id=sql_one.id, name="approval", idempotency_key=None,
                payload='{"approved": true, "by": "bob (SQL)"}'))
        print(f"   - from SQL: SELECT {cfg.schema}.signal('{sql_one.id}', 'approval', "
              "'{\"approved\": true, \"by\": \"bob (SQL)\"}')")
        base = ["--dsn", dsn, "--schema", cfg.schema, "--log-level", "warning"]
        print(f"   - from the CLI: {prog} signal {rejected.id} approval "
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
        print(f"\n$ {prog} stats")
        cli("stats", *base)
        print(f"\n$ {prog} show {approver.id}")
        cli("show", str(approver.id), *base)
        opened = sum(1 for r in results if r["outcome"] == "pr_opened")
        print(f"\ndemo done: {opened} pull requests opened, "
              f"{sum(1 for r in results if r['outcome'] == 'rejected')} rejected. "
              f"Data stays in {cfg.data_dir}; `make clean` removes it.")
        left = client.submit(incident_response, {
            "workload": "search-api", "namespace": "prod", "alert": "KubePodCrashLooping"},
            idempotency_key=f"demo-{run_id}-for-you")
        client.get_event(left.id, "stage", timeout=60)
        token = _operator_token(cfg, dsn, run_id)
        host = f"[{cfg.http_host}]" if ":" in cfg.http_host else cfg.http_host
        ui = f"{'https' if cfg.http_certfile else 'http'}://{host}:{port}"
        up = cfg.http_certfile != "" or _wait_http(f"{ui}/healthz")
        print(f"\n6. one more incident waits for you: approve it in the web UI"
              f"{'' if up else ' (the HTTP server did not answer yet)'}")
        print(f"   UI:        {ui}/ui/")
        print(f"   incident:  {ui}/ui/executions/{left.id}")
        print(f"   token:     {token}")
        print("              (scopes read,operate; paste it on the login page; "
              f"`{prog} token revoke demo-operator-{run_id}` ends it)")
        if sys.stdin is not None and sys.stdin.isatty():
            _serve_until_interrupted(client, left.id)
        else:
            print("   not attached to a terminal: stopping now. The incident stays waiting in "
                  f"PostgreSQL; run `make run` in a terminal, or `{prog} --app "
                  "kestrel.demo --http-port 8080`, to approve it.")
        client.close()
        return 0
    finally:
        runtime.send_signal(signal.SIGTERM)
        try:
            runtime.wait(timeout=60)
        except subprocess.TimeoutExpired:  # never left running: its workers die with it
            print("   the runtime did not stop within 60 s: killed", file=sys.stderr)
            runtime.kill()
            runtime.wait()
        del server


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def command_name() -> str:
    """How the person at the keyboard runs kestrel-runtime from here: the bare name when it
    is this installation's on PATH, else its path (``make run`` does not activate .venv, so
    the demo's follow-up commands would not be found as printed)."""
    import shutil

    mine = Path(sys.executable).parent / "kestrel-runtime"
    found = shutil.which("kestrel-runtime")
    if not mine.exists() or (found is not None and Path(found).resolve() == mine.resolve()):
        return "kestrel-runtime"
    try:
        return str(mine.relative_to(Path.cwd()))
    except ValueError:
        return str(mine)


def http_port(host: str, wanted: int) -> int:
    """*wanted*, or 8080 when 0, if it is free on *host*; otherwise a free port there.

    The probe sets SO_REUSEADDR as the server's own listening socket does: a port left in
    TIME_WAIT by the last run is free to the server, and must be to the probe too."""
    port = wanted or 8080
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return port
        except OSError:
            s.bind((host, 0))
            return int(s.getsockname()[1])


def _operator_token(cfg: Config, dsn: str, run_id: str) -> str:
    """A fresh ``read,operate`` token for the person at the keyboard (printed once)."""
    from kestrel.http.commands import token_command

    data, _ = token_command(cfg, dsn, "create", {"name": f"demo-operator-{run_id}",
                                                 "scopes": "read,operate"})
    return str(data["token"])


def _wait_http(url: str, timeout: float = 30) -> bool:
    """Whether *url* answers 200 within *timeout* seconds (the HTTP child starting)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                if reply.status == 200:
                    return True
        except OSError:
            time.sleep(0.2)
    return False


def _serve_until_interrupted(client: Any, incident: uuid.UUID) -> None:
    """Keep the runtime and the UI up until Ctrl-C (or SIGTERM); say so when the incident is
    answered.

    Its own handlers, not Python's KeyboardInterrupt: a process started with SIGINT ignored
    (by a background job of a non-interactive shell, as `make test &` starts everything)
    never gets one, and the demo served on after Ctrl-C (CI failed so). The handlers only
    set an event, read between two polls, so nothing is interrupted inside the client's
    pool."""
    print("\n   serving until Ctrl-C …", flush=True)
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set())
                for s in (signal.SIGINT, signal.SIGTERM)}
    told = False
    try:
        while not stop.wait(0.5):
            if not told and client.get(incident).status.terminal:
                told = True
                outcome = client.get(incident).result or {}
                where = outcome.get("pull_request") or outcome.get("outcome")
                print(f"   search-api: {outcome.get('outcome')} by {outcome.get('by')} "
                      f"→ {where}", flush=True)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    print("\n   stopping.", flush=True)

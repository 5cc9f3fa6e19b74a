"""``kestrel-runtime demo`` (``make run``) and the web UI: it serves the UI on loopback,
prints its address and a token, and leaves one incident waiting for a person. Without a
terminal it stops by itself (CI, scripts); on a terminal (a real pty here) it serves until
Ctrl-C (a real SIGINT), and a person's approval in the UI completes the incident."""

from __future__ import annotations

import os
import pty
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from kestrel.client import SyncClient
from tests.helpers import ROOT, runtime, wait_until
from tests.http_helpers import Api, free_port
from tests.ui_helpers import FORM_KEY, Browserless

TOKEN = re.compile(r"token:\s+(kst_[0-9a-f]{16}_[A-Za-z0-9_-]{43})")
INCIDENT = re.compile(r"incident:\s+http://127\.0\.0\.1:(\d+)/ui/executions/([0-9a-f-]{36})")


def demo(dsn: str, schema: str, port: int, **kw: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "kestrel", "demo", "--incidents", "3", "--dsn", dsn,
         "--schema", schema, "--http-port", str(port)],
        cwd=ROOT, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"),
        **kw)  # type: ignore[call-overload]


def approve_in_the_ui(port: int, token: str, eid: str) -> None:
    ui = Browserless(Api(port))
    ui.login(token)
    page = ui.get(f"/ui/executions/{eid}")
    assert page.status == 200 and b'id="approve"' in page.body
    key = FORM_KEY.search(page.body)
    assert key
    sent = ui.post_form(f"/ui/executions/{eid}/approve", {
        "csrf": ui.csrf(page), "key": key.group(1).decode(), "name": "approval"})
    assert sent.status == 303, sent.body


def test_without_a_terminal_the_demo_stops_by_itself_and_leaves_the_incident_waiting(
        pg_dsn: str, schema: str, tmp_path: Path) -> None:
    port = free_port()
    proc = demo(pg_dsn, schema, port, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert "demo done: 2 pull requests opened, 1 rejected" in out
    assert f"UI:        http://127.0.0.1:{port}/ui/" in out
    assert "not attached to a terminal: stopping now" in out
    token = TOKEN.search(out)
    incident = INCIDENT.search(out)
    assert token and incident and int(incident.group(1)) == port
    eid = incident.group(2)
    with SyncClient(pg_dsn, schema=schema, pool_size=1) as client:
        assert client.get(eid).status.value == "waiting"
        # Later, a person starts the runtime with the UI and approves it with that token.
        ui_port = free_port()
        with runtime(pg_dsn, schema, procs=1, app="kestrel.demo", log=tmp_path / "rt.log",
                     args=["--http-port", str(ui_port)]):
            wait_until(lambda: _up(ui_port), timeout=60, what="the UI")
            approve_in_the_ui(ui_port, token.group(1), eid)
            result = client.result(eid, timeout=60)
    assert result["outcome"] == "pr_opened" and result["by"].startswith("demo-operator-")


def _up(port: int) -> bool:
    try:
        return Api(port).get("/healthz", token=None).status == 200
    except OSError:
        return False


def test_on_a_terminal_the_demo_serves_the_ui_until_ctrl_c(pg_dsn: str, schema: str) -> None:
    """Also when it starts with SIGINT ignored, as every process started by a background
    job of a non-interactive shell does (`make test &`, TEST_PARALLEL's second pass): the
    demo relied on Python's KeyboardInterrupt, which such a process never gets, and served
    on after Ctrl-C (it failed CI run that way, in both passes)."""
    port = free_port()
    leader, follower = pty.openpty()
    proc = demo(pg_dsn, schema, port, stdin=follower, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    os.close(follower)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout],  # type: ignore
                     daemon=True).start()
    seen: list[str] = []

    def read_until(text: str, timeout: float = 240) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                seen.append(lines.get(timeout=1))
            except queue.Empty:
                assert proc.poll() is None, "".join(seen)
                continue
            if text in seen[-1]:
                return "".join(seen)
        raise AssertionError(f"no {text!r} in:\n{''.join(seen)}")

    try:
        out = read_until("serving until Ctrl-C")
        token, incident = TOKEN.search(out), INCIDENT.search(out)
        assert token and incident, out
        assert proc.poll() is None  # a terminal: it keeps serving
        approve_in_the_ui(port, token.group(1), incident.group(2))
        told = read_until("search-api: pr_opened by demo-operator-")
        assert "https://git.example.com/infra/pulls/" in told.splitlines()[-1]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 0
        read_until("stopping.", timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(leader)


def test_a_demo_killed_with_sigkill_leaves_no_runtime_behind(pg_dsn: str, schema: str) -> None:
    # SIGKILLed, the demo could not stop the runtime it started: it ran on, orphaned, with
    # its workers and the UI's port (seen in CI after a hung test killed its demo).
    import psutil

    port = free_port()
    leader, follower = pty.openpty()
    proc = demo(pg_dsn, schema, port, stdin=follower, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT)
    os.close(follower)
    try:
        lines: list[str] = []
        threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()  # type: ignore[arg-type]
        wait_until(lambda: any("serving until Ctrl-C" in line for line in lines),
                   timeout=240, what="the demo serving")
        family = psutil.Process(proc.pid).children(recursive=True)
        assert family, "the demo started no runtime"
        proc.kill()
        proc.wait(timeout=30)
        # The runtime drains (SIGTERM from the kernel when its parent died) and exits.
        _gone, alive = psutil.wait_procs(family, timeout=60)
        assert alive == [], [p.cmdline() for p in alive]
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(leader)

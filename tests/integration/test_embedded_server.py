"""The embedded PostgreSQL (``pgserver``) of the first hour (issue 43 items 4 and 6): it stays
up while any process uses it, whoever started it, and a stop leaves no orphan.

- A rolling deploy on it: v2 started with ``--dsn $(kestrel-runtime dsn)`` lost its database
  when v1, which had started the server, stopped. A DSN naming the server's own socket
  directory now joins it.
- SIGTERM to the demo left its embedded ``postgres`` (and its runtime) running.
- A holder killed with SIGKILL stayed on pgserver's list of holders, so the server never
  stopped after it: the dead are dropped from the list.

Real processes, real signals, real servers in data directories of their own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.helpers import ROOT, wait_until


def postgres_of(data: Path) -> list[psutil.Process]:
    """The postmaster serving *data* (pgserver starts it with ``-D data``)."""
    found = []
    for proc in psutil.process_iter(["name", "cmdline"]):
        cmd = proc.info["cmdline"] or []
        if proc.info["name"] == "postgres" and str(data) in cmd:
            found.append(proc)
    return found


def env() -> dict[str, str]:
    """No database named by the environment: the embedded one is used."""
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("KESTREL_", "PG"))}
    clean["PYTHONPATH"] = os.pathsep.join((str(ROOT / "src"), str(ROOT)))
    return clean


def kestrel(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kestrel", *args], env=env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def start(*args: str, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "kestrel", *args], env=env(), cwd=ROOT,
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                            start_new_session=True)


@pytest.fixture
def data(tmp_path: Path) -> Iterator[Path]:
    where = tmp_path / "pgdata"
    yield where
    for proc in postgres_of(where):  # a failed test's leftovers, not the next test's
        proc.kill()


RUNTIME = ("--app", "tests.apps.ledger_app", "--procs", "1", "--lease", "2", "--heartbeat",
           "0.5", "--poll-interval", "0.1")


def test_a_second_runtime_given_the_servers_dsn_keeps_it_up_after_the_first_stops(
        data: Path, tmp_path: Path) -> None:
    made = kestrel("migrate", "--data-dir", str(data))
    assert made.returncode == 0, made.stderr
    assert not postgres_of(data)  # migrate alone: stopped when it exited
    v1 = start(*RUNTIME, "--data-dir", str(data), log=tmp_path / "v1.log")
    try:
        wait_until(lambda: bool(postgres_of(data)), timeout=60, what="v1's server")
        dsn = kestrel("dsn", "--data-dir", str(data))
        assert dsn.returncode == 0, dsn.stderr
        url = dsn.stdout.strip().splitlines()[-1]
        assert str(data) in url
        v2 = start(*RUNTIME, "--dsn", url, log=tmp_path / "v2.log")
        try:
            wait_until(lambda: kestrel("submit", "three_steps", "--args", "[1]", "--dsn", url,
                                       "--allow-unknown", "--wait", "30").returncode == 0,
                       timeout=90, what="the server to serve")
            # That execution may have been v1's: v2 has joined the server once its supervisor
            # starts its workers (it joins before it migrates). On a busy machine v2 can take
            # longer to start than v1 takes to run three steps.
            wait_until(lambda: "starting 1 worker processes" in
                       (tmp_path / "v2.log").read_text(errors="replace"),
                       timeout=90, what="v2's supervisor to start")
            v1.send_signal(signal.SIGTERM)
            assert v1.wait(timeout=60) == 0
            # v1 started the server and is gone; v2 still has it, and works.
            assert postgres_of(data)
            done = kestrel("submit", "three_steps", "--args", "[2]", "--dsn", url, "--wait",
                           "60")
            assert done.returncode == 0, (done.stdout, done.stderr,
                                          (tmp_path / "v2.log").read_text()[-3000:])
        finally:
            v2.send_signal(signal.SIGTERM)
            assert v2.wait(timeout=60) == 0
        # The last holder gone, the server stopped: no orphan.
        wait_until(lambda: not postgres_of(data), timeout=30, what="the server to stop")
    finally:
        if v1.poll() is None:
            os.killpg(v1.pid, signal.SIGKILL)
            v1.wait()


def test_a_holder_killed_with_sigkill_does_not_keep_the_server_up_for_ever(
        data: Path, tmp_path: Path) -> None:
    made = kestrel("migrate", "--data-dir", str(data))
    assert made.returncode == 0, made.stderr
    first = start(*RUNTIME, "--data-dir", str(data), log=tmp_path / "first.log")
    wait_until(lambda: bool(postgres_of(data)), timeout=60, what="the server")
    url = kestrel("dsn", "--data-dir", str(data)).stdout.strip().splitlines()[-1]
    killed = start(*RUNTIME, "--dsn", url, log=tmp_path / "killed.log")
    try:
        wait_until(lambda: killed.pid in _holders(data), timeout=60, what="the join")
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait()
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=60) == 0
        wait_until(lambda: not postgres_of(data), timeout=30,
                   what="the server to stop after its last live holder")
    finally:
        for proc in (first, killed):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _holders(data: Path) -> list[int]:
    import json

    try:
        return list(json.loads((data / ".handle_pids.json").read_text()))
    except (OSError, ValueError):
        return []


def test_sigterm_to_the_demo_stops_its_runtime_and_its_server(data: Path,
                                                             tmp_path: Path) -> None:
    from tests.http_helpers import free_port

    log = tmp_path / "demo.log"
    demo = start("demo", "--incidents", "3", "--data-dir", str(data), "--http-port",
                 str(free_port()), log=log)
    try:
        wait_until(lambda: "1. starting the runtime" in log.read_text(), timeout=120,
                   what="the demo to start its runtime")
        runtimes: list[psutil.Process] = []

        def started() -> bool:  # the line comes before the runtime's process
            runtimes[:] = [c for c in psutil.Process(demo.pid).children(recursive=True)
                           if "kestrel" in " ".join(c.cmdline())]
            return bool(runtimes)

        wait_until(started, timeout=30, what="the demo's runtime process")
        assert postgres_of(data)
        demo.send_signal(signal.SIGTERM)
        assert demo.wait(timeout=90) == 128 + signal.SIGTERM
        wait_until(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                                   for p in runtimes), timeout=60, what="its runtime to stop")
        wait_until(lambda: not postgres_of(data), timeout=30, what="its server to stop")
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait()

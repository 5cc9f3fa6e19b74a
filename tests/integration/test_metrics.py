"""Metrics, health endpoints and the Grafana dashboard, against a real Prometheus."""

from __future__ import annotations

import json
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import psutil
import pytest

from kestrel.config import Config
from kestrel.migrate import readiness
from tests.helpers import (
    ROOT,
    finished_count,
    kill,
    q,
    runtime,
    submit_many,
    wait_until,
    worker_pids,
)

DASHBOARD = ROOT / "grafana" / "dashboards" / "kestrel.json"
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str, timeout: float = 5) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except (urllib.error.URLError, ConnectionError):
        return 0, ""


def series(text: str) -> list[str]:
    return [line.split(" ")[0] for line in text.splitlines()
            if line and not line.startswith("#")]


def dashboard_exprs(workflow: str = ".*", queue: str = ".*") -> list[str]:
    """Every panel query as Grafana sends it: variables substituted (All is ``.*``), then
    the template variables' own queries (``label_values(m, l)`` as ``count by (l) (m)``)."""
    data = json.loads(DASHBOARD.read_text())
    found = [t["expr"].replace("$workflow", workflow).replace("$queue", queue)
             .replace("$__rate_interval", "1m")
             for p in data["panels"] for t in p["targets"]]
    for var in data["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((\w+), (\w+)\)", var["query"]["query"])
            assert m is not None, var
            found.append(f"count by ({m.group(2)}) ({m.group(1)})")
    assert not [e for e in found if "$" in e], found
    return found


def test_dashboard_queries_use_only_exported_metric_names() -> None:
    from kestrel import metrics

    exported = {m._name for m in vars(metrics.get()).values()}  # type: ignore[attr-defined]
    for expr in dashboard_exprs():
        for name in re.findall(r"kestrel_[a-z_]+", expr):
            base = re.sub(r"_(bucket|sum|count|total)$", "", name)
            assert base in exported or base.removesuffix("_total") in exported, name


@pytest.mark.skipif(shutil.which("prometheus") is None,
                    reason="needs Debian's prometheus (.ci/run installs it)")
def test_prometheus_evaluates_every_dashboard_query(
    pg_dsn: str, schema: str, tmp_path: Path
) -> None:
    port, prom_port = free_port(), free_port()
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: kestrel\n    static_configs: [{{targets: ['127.0.0.1:{port}']}}]\n")
    prom = subprocess.Popen(
        ["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prom.log", "wb"))  # noqa: SIM115
    api = f"http://127.0.0.1:{prom_port}/api/v1/query?query="
    try:
        with runtime(pg_dsn, schema, procs=2, args=["--metrics-port", str(port)],
                     log=tmp_path / "rt.log"):
            wait_until(lambda: get(f"http://127.0.0.1:{port}/healthz")[0] == 200, timeout=20,
                       what="the metrics endpoint")
            # Load of every kind the dashboard shows: steps, retries, failures, waits.
            submit_many(pg_dsn, schema, "three_steps", "jsonb_build_array(i)", 1500)
            submit_many(pg_dsn, schema, "flaky_wf", "jsonb_build_array('m' || i, 1)", 50)
            submit_many(pg_dsn, schema, "fails_in_step", "'[]'::jsonb", 20)
            submit_many(pg_dsn, schema, "waiter", "'[]'::jsonb", 20)
            submit_many(pg_dsn, schema, "quick", "jsonb_build_array(i)", 300)
            q(pg_dsn, schema, "SELECT {s}.submit('quick', '[1]', 'backlog')")  # never claimed
            wait_until(lambda: finished_count(pg_dsn, schema) >= 1870, timeout=90,
                       what="the load to finish")
            time.sleep(4)  # a few more scrapes after the last events

            def all_have_data() -> list[str]:
                empty = []
                for expr in dashboard_exprs():
                    status, body = get(api + urllib.parse.quote(expr))
                    data = json.loads(body)
                    if status != 200 or data["status"] != "success" or not data["data"]["result"]:
                        empty.append(expr)
                return empty

            missing: list[str] = []

            def complete() -> bool:
                missing[:] = all_have_data()
                return not missing

            try:
                wait_until(complete, timeout=40, interval=2,
                           what="every dashboard query to return data")
            except AssertionError:
                raise AssertionError(f"queries without data: {missing}") from None

            # One workflow and one queue picked: every query still parses and runs, and the
            # filters filter (the waiting panel shows the waiter's signal, not another's).
            def result(expr: str) -> list[dict[str, object]]:
                status, body = get(api + urllib.parse.quote(expr))
                data = json.loads(body)
                assert status == 200 and data["status"] == "success", (expr, body)
                return data["data"]["result"]  # type: ignore[no-any-return]

            for expr in dashboard_exprs(workflow="waiter|quick", queue="default"):
                result(expr)
            waiting = next(e for e in dashboard_exprs(workflow="waiter")
                           if "kestrel_waiting_executions" in e)
            assert [(r["metric"], r["value"][1]) for r in result(waiting)] == [  # type: ignore[index]
                ({"workflow": "waiter", "waiting_for": "go"}, "20")]
            other = next(e for e in dashboard_exprs(workflow="quick")
                         if "kestrel_waiting_executions" in e)
            assert result(other) == []
    finally:
        prom.terminate()
        prom.wait(timeout=20)


def test_labels_stay_bounded_and_carry_no_ids_or_secrets(
    pg_dsn: str, schema: str, tmp_path: Path
) -> None:
    port = free_port()
    canary = "canary-s3cr3t-pw"
    sep = "&" if "?" in pg_dsn else "?"
    dsn = f"{pg_dsn}{sep}password={canary}"  # trust auth ignores it; it must never show
    url = f"http://127.0.0.1:{port}/metrics"
    log = tmp_path / "rt.log"
    with runtime(dsn, schema, procs=2, args=["--metrics-port", str(port)], log=log):
        wait_until(lambda: get(url)[0] == 200, timeout=20, what="/metrics")
        submit_many(pg_dsn, schema, "quick", "jsonb_build_array(i)", 100)
        wait_until(lambda: finished_count(pg_dsn, schema) == 100, timeout=60, what="100")
        time.sleep(1)
        small = set(series(get(url)[1]))
        submit_many(pg_dsn, schema, "quick", "jsonb_build_array(i)", 10_000)
        wait_until(lambda: finished_count(pg_dsn, schema) == 10_100, timeout=240,
                   interval=0.5, what="10,100 executions")
        time.sleep(6)  # a stats round after the load
        status, text = get(url)
    big = set(series(text))
    assert status == 200
    # 100x more executions, not one more label set: O(workflows x outcomes), never O(ids).
    # (Queue gauges gain a series when a queue first has queued work: bounded by queues.)
    grown = {s for s in big - small
             if not s.startswith(("kestrel_queue_depth", "kestrel_oldest_queued"))}
    assert grown == set(), sorted(grown)[:5]
    assert len(big) < 600
    assert not UUID.search(text)
    assert canary not in text
    assert canary not in log.read_text()
    assert "password" not in log.read_text() or "***" in log.read_text()


def test_health_endpoints_bind_to_loopback_and_are_read_only(
    pg_dsn: str, schema: str, tmp_path: Path
) -> None:
    port = free_port()
    with runtime(pg_dsn, schema, procs=1, args=["--metrics-port", str(port)],
                 log=tmp_path / "rt.log") as proc:
        wait_until(lambda: get(f"http://127.0.0.1:{port}/healthz")[0] == 200, timeout=20,
                   what="/healthz")
        status, body = get(f"http://127.0.0.1:{port}/readyz")
        assert status == 200 and json.loads(body)["ready"] is True
        assert get(f"http://127.0.0.1:{port}/admin")[0] == 404
        req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", data=b"x",
                                     method="POST")
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=5)
        assert info.value.code == 501
        listening = [c.laddr for c in psutil.Process(proc.pid).net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN]
        assert [(a.ip, a.port) for a in listening] == [("127.0.0.1", port)]
    assert Config().metrics_host == "127.0.0.1"
    ok, why = readiness("postgresql://nobody@127.0.0.1:1/x", schema)
    assert not ok and "unreachable" in why


def test_dead_workers_gauges_are_dropped_and_restarts_counted(
    pg_dsn: str, schema: str, tmp_path: Path
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"

    def value(name: str) -> float:
        for line in get(url)[1].splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return -1.0

    with runtime(pg_dsn, schema, procs=2, args=["--metrics-port", str(port)],
                 log=tmp_path / "rt.log") as proc:
        wait_until(lambda: value("kestrel_workers") == 2, timeout=20, what="two workers")
        kill(worker_pids(proc.pid)[0], signal.SIGKILL)
        wait_until(lambda: value("kestrel_worker_restarts_total") == 1, timeout=20,
                   what="the restart to be counted")
        wait_until(lambda: value("kestrel_workers") == 2, timeout=20,
                   what="the dead worker's gauge to go")
        time.sleep(6)
        assert value("kestrel_workers") == 2  # not 3: the dead one was marked dead


def _finished(port: int, outcome: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {s.labels["workflow"]: s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == "kestrel_workflows_finished_total"
            and s.labels["outcome"] == outcome and s.value}


def test_cancelling_a_parked_or_queued_execution_counts_as_finished(
        pg_dsn: str, schema: str, tmp_path: Path) -> None:
    """cancel() moves a waiting or queued execution to history itself, so no worker saw it
    finish and kestrel_workflows_finished_total never counted it (issue 18). The metrics
    collector now counts each once, registered workflow names only."""
    from kestrel.client import SyncClient
    from tests.apps import ledger_app as app

    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    port = free_port()
    with runtime(pg_dsn, schema, procs=2, args=["--metrics-port", str(port)],
                 log=tmp_path / "rt.log"):
        parked = [client.submit(app.waiter) for _ in range(3)]
        parked.append(client.submit(app.sleeper, 1, 3600.0))
        wait_until(lambda: all(client.get(h.id).status.value == "waiting" for h in parked),
                   timeout=60, what="the parked executions")
        delayed = client.submit(app.quick, 1, delay=3600)  # waiting for its start
        queued = client.submit(app.quick, 2, queue="nobody-claims-this")
        unknown = client.submit("no_worker_knows_this", 3)
        for h in [*parked, delayed, queued, unknown]:
            assert client.cancel(h.id) == "cancelled"
        wait_until(lambda: _finished(port, "cancelled") == {"waiter": 3, "sleeper": 1,
                                                            "quick": 2},
                   timeout=60, what="the cancels counted")
        # Counted once: nothing is left to count, and the unknown name is no label.
        wait_until(lambda: q(pg_dsn, schema, "SELECT workflow FROM {s}.uncounted_finishes")
                   == [("no_worker_knows_this",)],  # left for a worker that registers it
                   timeout=30, what="the counted rows acknowledged")
        assert _finished(port, "cancelled") == {"waiter": 3, "sleeper": 1, "quick": 2}
        assert client.get(parked[0].id).error == {"type": "Cancelled",
                                                  "message": "cancelled by request"}


def test_every_series_the_dashboard_reads_exists_before_anything_retried_or_queued(
    pg_dsn: str, schema: str, tmp_path: Path
) -> None:
    """Issue 43 item 9: on a runtime where nothing retried and nothing is queued, the step
    retries and oldest-queued panels showed "No data": their series appeared only once
    something retried or queued. They exist at 0 from the first run of a step and the first
    round of the queue gauges."""
    from prometheus_client.parser import text_string_to_metric_families

    port = free_port()

    def samples() -> dict[str, list[tuple[dict[str, str], float]]]:
        found: dict[str, list[tuple[dict[str, str], float]]] = {}
        for family in text_string_to_metric_families(get(f"http://127.0.0.1:{port}/metrics")[1]):
            for s in family.samples:
                found.setdefault(s.name, []).append((s.labels, s.value))
        return found

    with runtime(pg_dsn, schema, procs=1, args=["--metrics-port", str(port)],
                 log=tmp_path / "rt.log"):
        # Nothing submitted yet: the queue it serves has its gauges all the same.
        wait_until(lambda: "kestrel_oldest_queued_seconds" in samples(), timeout=30,
                   what="the queue gauges' first round")
        queued = samples()
        submit_many(pg_dsn, schema, "three_steps", "jsonb_build_array(i)", 5)
        wait_until(lambda: finished_count(pg_dsn, schema) >= 5, timeout=60, what="the load")
        got = samples()
    ran = {(labels["workflow"], labels["step"]) for labels, _ in got["kestrel_step_runs_total"]}
    retries = got.get("kestrel_step_retries_total", [])
    assert ran and {(labels["workflow"], labels["step"]) for labels, _ in retries} == ran
    assert {value for _, value in retries} == {0.0}  # one per step that ran, none retried
    assert queued["kestrel_oldest_queued_seconds"] == [({"queue": "default"}, 0.0)]
    assert queued["kestrel_queue_depth"] == [({"queue": "default", "status": "queued"}, 0.0)]

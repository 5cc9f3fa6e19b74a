"""Bug 18: the first submits of a process from several threads at once. The metrics were
created lazily without a lock, so 1-7 of 8 first submits raised DuplicateTimeseries after
their row had committed; a caller retrying on that error duplicated the work."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import textwrap
import uuid
from typing import Any

import pytest

from kestrel.client import Client, SyncClient
from tests.helpers import ROOT, q, q1

EIGHT_THREADS = textwrap.dedent("""
    import json, sys, threading
    from kestrel.client import SyncClient

    dsn, schema = sys.argv[1], sys.argv[2]
    barrier = threading.Barrier(8)
    got = []

    def submit(n):
        client = SyncClient(dsn, schema=schema, pool_size=0)
        barrier.wait()
        try:
            got.append(str(client.submit("wf", n).id))
        except Exception as exc:
            got.append(f"error {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=submit, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps(got))
""")


def test_first_submits_from_eight_threads_all_return_their_ids(
    pg_dsn: str, schema: str
) -> None:
    """A fresh process each round: the registry is per process, so its first use is fresh.
    Three rounds, since the old race lost in about four runs of five."""
    for round_ in range(1, 4):
        done = subprocess.run([sys.executable, "-c", EIGHT_THREADS, pg_dsn, schema],
                              env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        got = json.loads(done.stdout)
        assert [g for g in got if g.startswith("error")] == []
        assert len({uuid.UUID(g) for g in got}) == 8
        assert q1(pg_dsn, schema, "SELECT count(*) FROM {s}.workflow_executions") == 8 * round_


def test_a_metrics_failure_after_commit_is_logged_not_raised(
    pg_dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken() -> Any:
        raise RuntimeError("registry broke")

    monkeypatch.setattr("kestrel.metrics.get", broken)
    caplog.set_level(logging.ERROR, logger="kestrel.client")
    h = SyncClient(pg_dsn, schema=schema, pool_size=0).submit("wf", 1)
    ah = asyncio.run(Client(pg_dsn, schema=schema, pool_size=0).submit("wf", 2))
    assert {h.id, ah.id} == {r[0] for r in q(pg_dsn, schema,
                                             "SELECT id FROM {s}.workflow_executions")}
    assert sum("metrics" in r.getMessage() for r in caplog.records) == 2

"""The bench's profile readers (bench/profiles.py, bench/statements.py): what a py-spy raw
file folds into, and the refusal of a server that cannot profile statements. No timing."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest

from bench import profiles, statements

RAW = """\
process 10:"python -m kestrel";run (kestrel/worker.py:5);_execute (kestrel/runner.py:9);\
_send_query_prepared (psycopg/_cursor_base.py:3) 30
process 10:"python -m kestrel";run (kestrel/worker.py:5);_execute (kestrel/runner.py:9) 10
process 11:"python -m kestrel";run (kestrel/worker.py:5);run (kestrel/worker.py:5);\
inc (prometheus_client/values.py:7) 10
process 11:"python -m kestrel";run_forever (asyncio/base_events.py:1);\
select (selectors.py:468) 50
not a sample line
"""


def test_a_profile_leaves_idle_samples_out_and_names_each_frames_package(
        tmp_path: Path) -> None:
    raw = tmp_path / "side.raw"
    raw.write_text(RAW)
    prof = profiles.Profile(raw)
    assert (prof.total, prof.idle, prof.busy) == (100, 50, 50)
    assert prof.own == {"_send_query_prepared (_cursor_base.py)": 30,
                        "_execute (runner.py)": 10, "inc (values.py)": 10}
    assert prof.packages == {"psycopg": 30, "kestrel": 10, "prometheus_client": 10}
    # Inclusive: once per sample however often a function recurs on its stack.
    assert prof.inclusive["run (worker.py)"] == 50
    assert prof.inclusive["_execute (runner.py)"] == 40
    text = profiles.summary("kestrel", raw)
    assert "50 busy samples" in text and "50 more waiting in epoll" in text
    assert "psycopg 60%" in text


def test_a_server_without_pg_stat_statements_is_refused_with_the_way_to_fix_it(
        pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        if conn.execute("SELECT count(*) FROM pg_extension "
                        "WHERE extname = 'pg_stat_statements'").fetchone() != (0,):
            pytest.fail("the suite's server was expected to run without pg_stat_statements")
        with pytest.raises(statements.NotAvailable, match="shared_preload_libraries"):
            statements.check(conn)

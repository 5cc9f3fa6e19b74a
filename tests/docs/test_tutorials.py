"""Every tutorial of the manual runs as written (docs/tutorials; the convention is in
tests/docs/tutorials.py) against the suite's PostgreSQL, in a fresh schema, from an empty
folder, and prints what the page says it prints.

The page's commands run in one bash with this suite's environment first on PATH (the
reader's activated virtualenv), ``KESTREL_DSN`` naming the suite's server and
``KESTREL_SCHEMA`` the test's schema."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import kestrel
from tests.docs.tutorials import pages, parse

CODE_UNDER_TEST = str(Path(kestrel.__file__).resolve().parents[1])


def test_every_tutorial_block_is_run_or_marked() -> None:
    found = {p.stem: parse(p) for p in pages()}
    assert set(found) == {"approval-flow", "fan-out", "schedules", "testing", "deploying"}
    for name, page in found.items():
        assert page.script and page.expect, f"{name}: nothing run, or no stated outcome"


@pytest.mark.parametrize("path", pages(), ids=lambda p: p.stem)
def test_tutorial_runs_as_written(path: Path, pg_dsn: str, schema: str, tmp_path: Path) -> None:
    page = parse(path)
    folder = tmp_path / page.name
    folder.mkdir()
    # KESTREL_CONNECTION_MODE and KESTREL_LISTEN_DSN stay: in the suite's PgBouncer pass
    # the tutorial's runtime and clients must know they go through one.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KESTREL_DSN", "KESTREL_SCHEMA", "KESTREL_TEST_DSN", "PG"))
           and k not in ("PYTHONPATH", "PYTEST_ADDOPTS")}
    env |= {"PATH": f"{Path(sys.executable).parent}:{env['PATH']}", "KESTREL_DSN": pg_dsn,
            "KESTREL_SCHEMA": schema, "PYTHONPATH": f"{folder}:{CODE_UNDER_TEST}",
            # the testing tutorial's pytest: a basetemp of its own, no cache in the folder
            "PYTEST_ADDOPTS": f"-p no:cacheprovider --basetemp={tmp_path / '.inner'}"}
    proc = subprocess.Popen(["bash", "-c", page.bash()], cwd=folder, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{page.name} did not finish:\n{out}\n{err}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # a runtime a failed page left behind
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, f"{page.name} failed:\n{out}\n{err}"
    for text in page.expect:
        assert text in out, f"{page.name} does not print {text!r}:\n{out}\n{err}"
    assert "Traceback" not in err, err

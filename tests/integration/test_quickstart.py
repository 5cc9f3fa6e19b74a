"""README "Your own project in five minutes", followed verbatim from an empty folder.

The blocks come out of README.md by their markers (``<!-- quickstart:file NAME -->`` before
a file's code, ``<!-- quickstart:run -->`` before commands), so this test breaks when the
README drifts. The files are written as the README shows them and the commands run as
written, in one bash, with one difference: instead of the install block's fresh virtualenv
with the built wheel (tests/package/test_package.py runs that one), this suite's own
environment is first on PATH. ``KESTREL_DSN`` (the README's ``export``)
names the suite's PostgreSQL, ``KESTREL_SCHEMA`` a fresh schema of this test.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, q1

README = ROOT / "README.md"
BLOCK = re.compile(r"<!-- quickstart:(\w+) ?([^>]*?) ?-->\n```(\w+)\n(.*?)```", re.DOTALL)


def quickstart() -> list[tuple[str, str, str]]:
    """(kind, argument, text) of each marked block of the quick-start, in order."""
    text = README.read_text()
    section = text[text.index("## Your own project in five minutes"):]
    section = section[:section.index("\n## ", 1)]
    return [(m.group(1), m.group(2), m.group(4)) for m in BLOCK.finditer(section)]


def test_the_readme_quickstart_has_the_steps_this_test_follows() -> None:
    kinds = [(kind, arg.split(" ")[0]) for kind, arg, _ in quickstart()]
    assert kinds == [("install", "(test_package.py"), ("file", "greet.py"), ("run", ""),
                     ("file", "test_greet.py"), ("run", ""), ("dockerfile", "")]
    install = quickstart()[0][2]
    # Not on PyPI yet: the wheel built from a clone (test_package.py runs this block).
    assert "pip install '../kestrel-runtime/dist/kestrel_runtime-" in install
    assert "-py3-none-any.whl[embedded]' pytest" in install and "KESTREL_DSN=" in install


def test_following_the_quickstart_from_an_empty_folder(
    pg_dsn: str, schema: str, tmp_path: Path
) -> None:
    folder = tmp_path / "greeter"
    folder.mkdir()
    script = ["set -euo pipefail"]
    for kind, arg, text in quickstart():
        if kind == "file":
            (folder / arg).write_text(text)
        elif kind == "run":
            script.append(text)
    assert sorted(p.name for p in folder.iterdir()) == ["greet.py", "test_greet.py"]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KESTREL_DSN", "KESTREL_SCHEMA", "KESTREL_TEST_DSN", "PG"))
           and k not in ("PYTHONPATH", "PYTEST_ADDOPTS")}
    env |= {"PATH": f"{Path(sys.executable).parent}:{env['PATH']}", "KESTREL_DSN": pg_dsn,
            "KESTREL_SCHEMA": schema}
    proc = subprocess.Popen(["bash", "-c", "\n".join(script)], cwd=folder, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the quick-start did not finish:\n{out}\n{err}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, f"{out}\n{err}"
    # submit --wait printed the id, then the result; list shows it completed.
    lines = out.splitlines()
    assert lines[0] == f"schema {schema}: up to date"  # `migrate`: the fixture migrated it
    assert lines[2] == '"hello, Ada!"', out
    assert re.search(rf"{lines[1]}\s+greet\s+default\s+completed", out), out
    assert "2 passed" in out, out  # the README's tests, run by the README's pytest line
    assert q1(pg_dsn, schema, "SELECT count(*) FROM {s}.workflow_steps WHERE step_name "
              "IN ('look_up', 'kestrel.sleep', 'compose')") == 3
    assert "Traceback" not in err, err


def test_the_embedded_database_says_it_is_used_and_where_its_data_is(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KESTREL_", "PG"))}
    data = tmp_path / "pgdata"
    done = subprocess.run([str(Path(sys.executable).parent / "kestrel-runtime"), "migrate",
                           "--data-dir", str(data)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    warnings = [line for line in done.stderr.splitlines() if "embedded PostgreSQL" in line]
    assert len(warnings) == 1, done.stderr
    assert "WARNING" in warnings[0].upper() and str(data) in warnings[0]
    assert "pass --dsn" in warnings[0]
    assert (data / "PG_VERSION").exists()

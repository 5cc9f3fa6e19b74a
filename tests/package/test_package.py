"""The release check: kestrel-runtime as a user gets it before it is on PyPI (README
"Install"), from the wheel a release would upload.

``python -m build`` makes the sdist and, from that sdist, the wheel, as a release does;
``twine check`` reads both; the wheel must hold the SQL (``sql/`` force-included as
``kestrel/sql``) and the web UI's templates and static files. Then the README's quick-start
is followed from an empty folder: its install block runs as written, creating a clean
virtualenv (``python -m venv``, no ``--system-site-packages``) and installing the built wheel
with its ``embedded`` extra and pytest, dependencies from the package index as a user's pip
gets them (PyPI in CI; pip's cache makes it seconds). That is the honest check: a
virtualenv borrowing this suite's site-packages through a ``.pth`` would also see the
editable kestrel installed there and every dependency the wheel forgot to declare. Three
substitutions only: the wheel's folder (``../kestrel-runtime/dist/``: this test's build), the
interpreter (this suite's, as ``pgserver`` has wheels for CPython 3.11 and 3.12 only), and
the ``export KESTREL_DSN=…`` line (the suite's PostgreSQL). Then the app file, the runtime,
``submit --wait``, ``list`` and the README's tests run from that virtualenv, as in
tests/integration/test_quickstart.py, with the schema this test made (``KESTREL_SCHEMA``).
Last, the README's other way, ``pip install`` of the clone's folder, into the same
virtualenv (``--no-deps``: they are there), and kestrel again finds its SQL and templates.

Marked ``network`` (pip fetches from the index) and ``slow``: about a minute on two cores
with a warm pip cache, build included. It lives outside tests/integration, which make test's
second pass runs again through PgBouncer: the package is the same there.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.helpers import ROOT, q1
from tests.integration.test_quickstart import quickstart

pytestmark = [pytest.mark.slow, pytest.mark.network]

VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
WHEEL = f"kestrel_runtime-{VERSION}-py3-none-any.whl"
SDIST = f"kestrel_runtime-{VERSION}.tar.gz"
# The interpreter the virtualenv is made from: this suite's, not whatever python3 is first
# on PATH (Debian's may be 3.13, for which the embedded extra has no wheel).
BASE_PYTHON = getattr(sys, "_base_executable", sys.executable)


def _clean_env(**extra: str) -> dict[str, str]:
    """The environment of a user's shell: nothing of this suite's virtualenv, database or
    pytest settings."""
    ours = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KESTREL_", "PG", "PYTEST_"))
           and k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if p and p != ours)
    return env | extra


def _bash(script: str, cwd: Path, env: dict[str, str], timeout: float
          ) -> subprocess.CompletedProcess[str]:
    """Run *script* in bash; kill its whole process group if it outlives *timeout*."""
    proc = subprocess.Popen(["bash", "-c", script], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"did not finish in {timeout}s:\n{script}\n{out}\n{err}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sdist and the wheel, built as a release builds them (isolated, from the sdist)."""
    out = tmp_path_factory.mktemp("dist")
    done = subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)],
                          capture_output=True, text=True, timeout=300, env=_clean_env())
    assert done.returncode == 0, done.stdout + done.stderr
    assert {p.name for p in out.iterdir()} == {SDIST, WHEEL}
    return out


def test_the_readme_names_the_wheel_the_build_makes() -> None:
    readme = (ROOT / "README.md").read_text()
    assert set(re.findall(r"kestrel_runtime-[\w.+]+?-py3-none-any\.whl", readme)) == {WHEEL}
    assert "not on PyPI yet" in readme


def test_the_sdist_and_wheel_pass_twine_check_and_carry_the_sql_and_the_ui(dist: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "twine", "check", "--strict",
                           str(dist / SDIST), str(dist / WHEEL)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("PASSED") == 2, done.stdout

    with zipfile.ZipFile(dist / WHEEL) as wheel:
        names = set(wheel.namelist())
        meta = wheel.read(f"kestrel_runtime-{VERSION}.dist-info/METADATA").decode()
        entry_points = wheel.read(f"kestrel_runtime-{VERSION}.dist-info/entry_points.txt")
    # Every SQL file of the checkout, as kestrel/sql/… (kestrel.sql.sql_dir() reads them
    # there), and every template and static file of the web UI.
    sql = {f"kestrel/sql/{p.relative_to(ROOT / 'sql')}" for p in (ROOT / "sql").rglob("*.sql")}
    http = ROOT / "src" / "kestrel" / "http"
    ui = {f"kestrel/http/{p.relative_to(http)}" for folder in ("templates", "static")
          for p in (http / folder).rglob("*") if p.is_file()}
    assert len(sql) > 30 and sql <= names, sorted(sql - names)
    assert any(n.startswith("kestrel/sql/migrations/0001_") for n in names)
    assert len(ui) > 5 and ui <= names, sorted(ui - names)
    assert "kestrel/py.typed" in names  # users' mypy reads kestrel's annotations
    assert "kestrel/grafana/kestrel.json" in names  # `kestrel-runtime dashboard` prints it
    assert f"kestrel_runtime-{VERSION}.dist-info/licenses/LICENSE" in names
    assert not [n for n in names if n.startswith(("tests/", "bench/", "sql/"))]
    assert b"kestrel-runtime = kestrel.cli:main" in entry_points
    assert b"kestrel = kestrel.testing" in entry_points  # the pytest plugin
    assert "Provides-Extra: embedded" in meta and "Requires-Dist: anyio>=4" in meta
    assert "Requires-Python: >=3.11" in meta


def test_the_readme_quickstart_from_the_built_wheel_in_a_clean_virtualenv(
    dist: Path, pg_dsn: str, schema: str, tmp_path: Path
) -> None:
    blocks = quickstart()
    install = blocks[0][2]
    for old, new in [("../kestrel-runtime/dist/", f"{dist}/"),
                     ("python3 -m venv", f"{BASE_PYTHON} -m venv")]:
        assert install.count(old) == 1, install
        install = install.replace(old, new)
    install, exports = re.subn(r"^export KESTREL_DSN=.*$", f"export KESTREL_DSN={pg_dsn}",
                               install, flags=re.MULTILINE)
    assert exports == 1, install
    env = _clean_env(PIP_DISABLE_PIP_VERSION_CHECK="1")
    done = _bash("set -euo pipefail\n" + install, tmp_path, env, timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr
    folder = tmp_path / "greeter"
    venv = folder / ".venv"
    assert "include-system-site-packages = false" in (venv / "pyvenv.cfg").read_text()

    # The wheel, not a checkout: kestrel, its SQL and its templates come from the virtualenv.
    probe = ("import kestrel, kestrel.sql, kestrel.http.ui as ui, jinja2, importlib.metadata "
             "as m; print(kestrel.__file__); print(kestrel.sql.sql_dir()); "
             "print(len(list((kestrel.sql.sql_dir() / 'migrations').glob('*.sql')))); "
             "jinja2.Environment(loader=jinja2.FileSystemLoader(ui.HERE / 'templates'))"
             ".get_template('base.html'); print((ui.HERE / 'static' / 'ui.css').is_file()); "
             "print(m.distribution('kestrel-runtime').read_text('direct_url.json'))")
    seen = subprocess.run([str(venv / "bin" / "python"), "-c", probe], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=60)
    assert seen.returncode == 0, seen.stderr
    module, sql_dir, migrations, static, direct_url = seen.stdout.splitlines()[:5]
    site = str(venv / "lib")
    assert module.startswith(site) and sql_dir.startswith(site), seen.stdout
    assert int(migrations) == len(list((ROOT / "sql" / "migrations").glob("*.sql")))
    assert static == "True"
    assert WHEEL in direct_url and '"editable"' not in direct_url, direct_url
    check = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "check"], cwd=folder,
                           env=env, capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr

    script = ["set -euo pipefail", ". .venv/bin/activate", f"export KESTREL_DSN={pg_dsn}"]
    for kind, arg, text in blocks[1:]:
        if kind == "file":
            (folder / arg).write_text(text)
        elif kind == "run":
            script.append(text)
    run_env = env | {"KESTREL_SCHEMA": schema,
                     "PYTEST_ADDOPTS": f"-p no:cacheprovider --basetemp={tmp_path / 'pt'}"}
    done = _bash("\n".join(script), folder, run_env, timeout=240)
    out, err = done.stdout, done.stderr
    assert done.returncode == 0, f"{out}\n{err}"
    lines = out.splitlines()
    assert lines[0] == f"schema {schema}: up to date", out  # the fixture migrated it
    assert lines[2] == '"hello, Ada!"', out  # submit --wait: the id, then the result
    assert re.search(rf"{lines[1]}\s+greet\s+default\s+completed", out), out
    assert "2 passed" in out, out  # the README's tests, run by the README's pytest line
    assert q1(pg_dsn, schema, "SELECT count(*) FROM {s}.workflow_steps WHERE step_name "
              "IN ('look_up', 'kestrel.sleep', 'compose')") == 3
    assert "Traceback" not in err, err

    # README "Install"'s other way, from a clone's folder: pip builds the same package there.
    done = _bash(f"{venv}/bin/python -m pip install -q --no-deps --force-reinstall {ROOT}",
                 folder, env, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    seen = subprocess.run([str(venv / "bin" / "python"), "-c", probe], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=60)
    assert seen.returncode == 0, seen.stderr
    module, sql_dir, migrations, static, direct_url = seen.stdout.splitlines()[:5]
    assert module.startswith(site) and sql_dir.startswith(site), seen.stdout
    assert int(migrations) == len(list((ROOT / "sql" / "migrations").glob("*.sql")))
    assert static == "True" and '"editable"' not in direct_url, direct_url

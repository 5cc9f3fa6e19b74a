"""A newcomer's first hour, without a database: ``--app`` finds the modules of the folder it
is run from, a module that cannot be imported is one line saying what to do, and with no
DSN and no embedded extra one line says how to give a database. The real console script in
a process of its own, as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
UNREACHABLE = "postgresql://nobody@127.0.0.1:1/none?connect_timeout=2"

WORKFLOWS = """
import kestrel

@kestrel.workflow
async def hello(ctx: kestrel.Context, name: str) -> str:
    return f"hello {name}"
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KESTREL_", "PG")) and k != "PYTHONPATH"}
    return env | extra


def kestrel_runtime(folder: Path, *argv: str, block_embedded: bool = False
                    ) -> subprocess.CompletedProcess[str]:
    """``kestrel-runtime ARGV`` run from *folder*, optionally as if the embedded extra were
    not installed (pgserver cannot be imported)."""
    if block_embedded:
        cmd = [sys.executable, "-c", "import sys; sys.modules['pgserver'] = None; "
               "from kestrel.cli import main; raise SystemExit(main())", *argv]
    else:
        cmd = [str(BIN / "kestrel-runtime"), *argv]
    return subprocess.run(cmd, cwd=folder, env=_env(), capture_output=True, text=True,
                          timeout=60)


def test_app_modules_are_found_in_the_current_folder(tmp_path: Path) -> None:
    (tmp_path / "myapp").mkdir()
    (tmp_path / "myapp" / "__init__.py").write_text("")
    (tmp_path / "myapp" / "workflows.py").write_text(WORKFLOWS)
    done = kestrel_runtime(tmp_path, "--app", "myapp.workflows", "--dsn", UNREACHABLE)
    # Imported: it went on to the database, which is not there.
    assert "cannot import" not in done.stderr
    assert "cannot connect to the database" in done.stderr, done.stderr
    assert done.returncode == 1


@pytest.mark.parametrize("name", ["myapp.workflow", "nosuchmodule"])
def test_a_module_not_found_says_where_it_was_looked_for(tmp_path: Path, name: str) -> None:
    (tmp_path / "myapp").mkdir()
    (tmp_path / "myapp" / "__init__.py").write_text("")
    done = kestrel_runtime(tmp_path, "--app", name, "--dsn", UNREACHABLE)
    assert done.returncode == 2
    [line] = done.stderr.splitlines()
    assert f"KESTREL_APP={name!r}: cannot import it (No module named" in line
    if name == "nosuchmodule":
        assert f"from the folder that holds 'nosuchmodule' (now {tmp_path})" in line


def test_a_missing_dependency_of_the_app_is_not_blamed_on_the_folder(tmp_path: Path) -> None:
    (tmp_path / "flows.py").write_text("import no_such_dependency\n")
    done = kestrel_runtime(tmp_path, "--app", "flows", "--dsn", UNREACHABLE)
    assert done.returncode == 2
    [line] = done.stderr.splitlines()
    assert "No module named 'no_such_dependency'" in line and "folder" not in line


@pytest.mark.parametrize("name", ["bad\x01name", ".relative", "a..b", "'); DROP TABLE x; --",
                                  "x" * 5000, "\u00e9t\u00e9"])
def test_hostile_app_names_are_one_line(tmp_path: Path, name: str) -> None:
    done = kestrel_runtime(tmp_path, "--app", name, "--dsn", UNREACHABLE)
    assert done.returncode == 2
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert "Traceback" not in done.stderr and "cannot import it" in done.stderr


@pytest.mark.parametrize("argv", [["migrate"], ["list"], ["--app", "flows"]])
def test_no_dsn_and_no_embedded_extra_is_one_line_saying_how(tmp_path: Path,
                                                               argv: list[str]) -> None:
    (tmp_path / "flows.py").write_text(WORKFLOWS)
    done = kestrel_runtime(tmp_path, *argv, block_embedded=True)
    assert done.returncode in (1, 2)
    [line] = done.stderr.splitlines()
    assert "no database given: pass --dsn postgresql://USER@HOST/DB (or set KESTREL_DSN or " \
           "PGHOST), or pip install 'kestrel-runtime[embedded]'" in line
    assert not (tmp_path / ".kestrel").exists()  # no database created behind the user's back


def test_the_embedded_extra_is_optional_and_the_core_installs_without_it() -> None:
    import tomllib

    root = Path(__file__).resolve().parents[2]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    assert not any(d.startswith("pgserver") for d in project["dependencies"])
    assert project["optional-dependencies"]["embedded"] == ["pgserver>=0.1.4"]
    assert project["entry-points"]["pytest11"] == {"kestrel": "kestrel.testing"}
    # make venv / make run / CI install it, so the README's two commands keep working.
    assert "'.[dev,embedded]'" in (root / "Makefile").read_text()

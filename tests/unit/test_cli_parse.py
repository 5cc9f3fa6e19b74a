"""kestrel.cli: help text and the errors reported before any database is touched."""

from __future__ import annotations

import pytest

from kestrel import cli
from kestrel.config import KNOBS


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for var in list(os.environ):
        if var.startswith("KESTREL_") or var.startswith("PG"):
            monkeypatch.delenv(var)


def _help(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        cli.build_parser().parse_args(argv)
    assert info.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_help_lists_every_knob_and_the_precedence(capsys: pytest.CaptureFixture[str]) -> None:
    out = _help(capsys, ["--help"])
    for knob in KNOBS:
        assert knob.flag in out, knob.flag
        assert knob.env in out, knob.env
    assert "--config" in out
    assert " ".join(cli.PRECEDENCE.split()) in out


def test_subcommand_help_lists_knobs(capsys: pytest.CaptureFixture[str]) -> None:
    out = _help(capsys, ["run", "--help"])
    for knob in KNOBS:
        assert knob.flag in out, knob.flag


def test_flags_parse_with_knob_types() -> None:
    ns = cli.build_parser().parse_args(["--procs", "3", "--queues", "a,b", "--listen", "no"])
    cfg = cli.config_from_args(ns, environ={})
    assert (cfg.procs, cfg.queues, cfg.listen) == (3, ("a", "b"), False)


def test_invalid_config_exits_2_before_anything_else(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("nothing may run after a config error")

    monkeypatch.setattr(cli, "resolve_dsn", boom)
    monkeypatch.setattr(cli.kestrel_log, "setup", boom)
    code = cli.main(["--heartbeat", "30", "--lease", "10", "--app", "x"])
    err = capsys.readouterr().err
    assert code == 2
    assert any("--heartbeat" in line for line in err.splitlines())


def test_unimportable_app_fails_before_database(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("no database may be touched when --app cannot be imported")

    monkeypatch.setattr(cli, "resolve_dsn", boom)
    code = cli.main(
        ["run", "--app", "no_such_module_xyz", "--dsn", "postgresql://nobody@127.0.0.1:1/x"]
    )
    err = capsys.readouterr().err
    assert code != 0
    assert "--app" in err
    assert "no_such_module_xyz" in err


def test_subcommand_options_are_not_taken_for_abbreviations_of_settings() -> None:
    """`submit --queue` was refused as an ambiguous abbreviation of --queues and
    --queue-limits (the top-level parser sees every option)."""
    ns = cli.build_parser().parse_args(["submit", "wf", "--queue", "q", "--dsn", "x"])
    assert (ns.queue, ns.dsn) == ("q", "x")

"""kestrel.cli: help text and the errors reported before any database is touched."""

from __future__ import annotations

import argparse

import pytest

from kestrel import boot, cli
from kestrel.cli import runtime
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
    # The top level (no COMMAND: run) takes them all but lists them under `run --help`.
    assert "kestrel-runtime run --help" in _help(capsys, ["--help"])
    out = _help(capsys, ["run", "--help"])
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
    monkeypatch.setattr(boot, "resolve_dsn", boom)  # where run's boot sequence reaches it
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


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


RUNTIME_ONLY = [k.flag for k in KNOBS if k.name not in cli.CONNECTION + cli.HISTORY
                + cli.PAYLOAD + cli.NAMESPACE + ("history_retention_days",
                   "app_version")]  # `list --app-version` is a filter of its own


@pytest.mark.parametrize("command", ["submit", "list", "show", "cancel", "retry", "fork",
                                     "signal", "stats", "migrate", "partitions"])
def test_operator_help_shows_its_options_and_only_the_connection_settings(
        capsys: pytest.CaptureFixture[str], command: str) -> None:
    out = _help(capsys, [command, "--help"])
    flags = {f for a in _subparsers()[command]._actions for f in a.option_strings}
    for name in cli.CONNECTION:
        assert "--" + name.replace("_", "-") in flags
        assert "--" + name.replace("_", "-") in out
    for flag in RUNTIME_ONLY:  # --procs, --batch-size, --lease…: the runtime's, not ours
        assert flag not in flags, flag
        assert f"[{flag} " not in out, flag
    # The commands that write a value check it against the payload cap before writing.
    assert ("--max-payload-bytes" in flags) == (command in ("submit", "signal"))
    # Only migrate makes a namespace of buckets (run migrates too, with every setting).
    assert ("--buckets" in flags) == (command == "migrate")
    # Its own options come before the settings, in the usage line too.
    assert out.index("options:") < out.index("settings:")
    if "[--json]" in out:
        assert out.index("[--json]") < out.index("[--dsn DSN]")


def test_a_runtime_setting_on_an_operator_command_is_refused(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.build_parser().parse_args(["list", "--procs", "4"])
    assert info.value.code == 2
    assert "unrecognized arguments: --procs 4" in capsys.readouterr().err


def test_serve_help_shows_only_the_settings_it_uses(
        capsys: pytest.CaptureFixture[str]) -> None:
    """`serve --help` listed (and serve silently took) every runtime setting; it takes the
    connection settings, the history ones its migrate uses, and what kestrel.http reads."""
    out = _help(capsys, ["serve", "--help"])
    flags = {f for a in _subparsers()["serve"]._actions for f in a.option_strings}
    wanted = cli.CONNECTION + cli.HISTORY + runtime.SERVE
    assert flags == {"-h", "--help", "--config"} | {"--" + n.replace("_", "-") for n in wanted}
    for name in ("app", "http_port", "http_max_connections", "metrics_port", "pool_size",
                 "max_payload_bytes", *cli.CONNECTION):
        assert "--" + name.replace("_", "-") in out, name
    for flag in ("--procs", "--concurrency", "--batch-size", "--lease", "--heartbeat",
                 "--queues", "--sweep-interval", "--drain-timeout", "--app-version",
                 "--maintenance-interval", "--history-retention-days", "--listen"):
        assert flag not in flags, flag
        assert f"[{flag} " not in out, flag


def test_serve_takes_every_setting_of_the_http_door() -> None:
    """The door's settings added later (--http-statement-timeout, the per-client cap, the
    hook body budget) were read from the environment but refused as serve's flags."""
    from kestrel.config import KNOBS

    door = {k.name for k in KNOBS if k.name.startswith("http_")}
    assert door <= set(runtime.SERVE), sorted(door - set(runtime.SERVE))


def test_a_runtime_setting_on_serve_is_refused_with_its_usage(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.build_parser().parse_args(["serve", "--app", "x", "--procs", "4"])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert err.startswith("usage: kestrel-runtime serve")
    assert "unrecognized arguments: --procs 4" in err


def test_every_option_and_argument_has_help_text() -> None:
    parsers = {"kestrel-runtime": cli.build_parser(), **_subparsers()}
    for name, parser in parsers.items():
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            assert action.help and action.help.strip(), (name, action.dest)


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"kestrel-runtime {cli.version()}"
    assert cli.version() not in ("", "unknown")  # installed (pip install -e .)


@pytest.mark.parametrize("argv", [
    ["submit", "wf", "--args", "[1]", "--queue", "default"],
    ["submit", "wf", "--args", "[1]", "--queue=default"],
    ["submit", "wf", "--queue=default", "--args=[1]"],
])
def test_submit_queue_as_two_words_or_with_equals(argv: list[str]) -> None:
    ns = cli.build_parser().parse_args(argv)
    assert (ns.command, ns.workflow, ns.queue, ns.args) == ("submit", "wf", "default", "[1]")


def test_submit_delay_and_start_at_are_exclusive(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["submit", "wf", "--delay", "5", "--start-at",
                                       "2030-01-01T00:00:00Z"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_fork_is_a_command_and_needs_from_step(capsys: pytest.CaptureFixture[str]) -> None:
    ns = cli.build_parser().parse_args(["fork", "id", "--from-step", "2"])
    assert (ns.command, ns.id, ns.from_step) == ("fork", "id", 2)
    assert "fork" in cli.COMMANDS
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["fork", "id"])
    assert "--from-step" in capsys.readouterr().err


def test_a_migrate_that_fails_on_a_missing_object_says_where_not_run_migrate() -> None:
    """Issue 44 row 2: a migrate that met `schema "shop" does not exist` on a Citus worker
    node was told to run migrate, and the CONTEXT naming the node was dropped."""
    from types import SimpleNamespace

    import psycopg

    from kestrel.cli import describe_db_error
    from kestrel.config import Config

    class OnANode(psycopg.errors.InvalidSchemaName):
        sqlstate = "3F000"
        diag = SimpleNamespace(  # type: ignore[assignment]
            context="while executing command on 127.0.0.1:5441")

    exc = OnANode('schema "shop" does not exist')
    said = describe_db_error(exc, "migrate", Config(schema="shop"))
    assert said == ('migrate of schema shop failed: schema "shop" does not exist (while '
                    "executing command on 127.0.0.1:5441) [SQLSTATE 3F000]; no migration of "
                    "this run was kept (one transaction)")
    # Any other command: the schema lacks kestrel's tables, and migrate is the way.
    assert "run `kestrel-runtime migrate --schema shop`" in describe_db_error(
        exc, "list", Config(schema="shop"))

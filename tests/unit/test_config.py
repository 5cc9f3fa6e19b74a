"""kestrel.config: precedence, validation messages and DSN masking."""

from __future__ import annotations

from pathlib import Path

import pytest

from kestrel.config import Config, load, mask_dsn
from kestrel.errors import ConfigError

CANARY = "s3cr3t-canary"


def _toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "kestrel.toml"
    path.write_text(text)
    return str(path)


def test_defaults_without_any_source() -> None:
    assert load({}, environ={}) == Config()


@pytest.mark.parametrize("table", [False, True], ids=["top-level", "kestrel-table"])
def test_precedence_flag_env_file_default(tmp_path: Path, table: bool) -> None:
    body = "procs = 3\nconcurrency = 7\nbatch_size = 11\nqueues = ['a', 'b']\n"
    path = _toml(tmp_path, ("[kestrel]\n" if table else "") + body)
    env = {"KESTREL_PROCS": "4", "KESTREL_CONCURRENCY": "8"}
    cfg = load({"procs": 5, "concurrency": None}, environ=env, config_file=path)
    assert cfg.procs == 5  # flag beats env and file
    assert cfg.concurrency == 8  # env beats file (a None flag is "not given")
    assert cfg.batch_size == 11  # file beats default
    assert cfg.queues == ("a", "b")  # a TOML list becomes a tuple
    assert cfg.max_attempts == Config().max_attempts  # default


def test_config_file_from_env_variable(tmp_path: Path) -> None:
    path = _toml(tmp_path, "schema = 'from_file'\n")
    assert load({}, environ={"KESTREL_CONFIG": path}).schema == "from_file"


def test_env_values_are_parsed() -> None:
    env = {"KESTREL_LEASE": "12.5", "KESTREL_LISTEN": "off", "KESTREL_QUEUES": " x, y ,,z "}
    cfg = load({}, environ=env)
    assert cfg.lease == 12.5
    assert cfg.listen is False
    assert cfg.queues == ("x", "y", "z")


def test_file_string_values_are_parsed(tmp_path: Path) -> None:
    path = _toml(tmp_path, "procs = '6'\nqueues = 'q1,q2'\nlisten = 'no'\n")
    cfg = load({}, environ={}, config_file=path)
    assert (cfg.procs, cfg.queues, cfg.listen) == (6, ("q1", "q2"), False)


def _error(flags: dict[str, object], **kw: object) -> str:
    with pytest.raises(ConfigError) as info:
        load(flags, **kw)  # type: ignore[arg-type]
    return str(info.value)


def test_heartbeat_not_under_lease_names_heartbeat() -> None:
    msg = _error({"heartbeat": 30.0, "lease": 10.0}, environ={})
    assert "--heartbeat" in msg
    assert "--lease" in msg


def test_heartbeat_equal_to_lease_is_rejected() -> None:
    assert "--heartbeat" in _error({"heartbeat": 10.0, "lease": 10.0}, environ={})


@pytest.mark.parametrize(
    ("flags", "flag"),
    [
        ({"batch_size": 0}, "--batch-size"),
        ({"procs": 0}, "--procs"),
        ({"schema": "Bad-Name"}, "--schema"),
        ({"schema": 'x"; drop'}, "--schema"),
        ({"queues": ("ok", "bad queue")}, "--queues"),
        ({"queues": ()}, "--queues"),
        ({"lease": 0.0}, "--lease"),
        ({"max_payload_bytes": 10}, "--max-payload-bytes"),
        ({"metrics_port": 70000}, "--metrics-port"),
        ({"log_level": "loud"}, "--log-level"),
        ({"drain_timeout": -1.0}, "--drain-timeout"),
    ],
)
def test_invalid_flag_value_names_the_setting(flags: dict[str, object], flag: str) -> None:
    assert flag in _error(flags, environ={})


def test_unknown_key_in_config_file(tmp_path: Path) -> None:
    path = _toml(tmp_path, "[kestrel]\nprocs = 2\nbogus_knob = 1\n")
    msg = _error({}, environ={}, config_file=path)
    assert "bogus_knob" in msg
    assert path in msg


def test_invalid_toml(tmp_path: Path) -> None:
    path = _toml(tmp_path, "procs = = 3\n")
    msg = _error({}, environ={}, config_file=path)
    assert "TOML" in msg
    assert path in msg


def test_missing_config_file(tmp_path: Path) -> None:
    path = str(tmp_path / "absent.toml")
    assert path in _error({}, environ={}, config_file=path)


@pytest.mark.parametrize(
    ("var", "value"),
    [("KESTREL_PROCS", "abc"), ("KESTREL_LEASE", "soon"), ("KESTREL_LISTEN", "maybe")],
)
def test_unparsable_env_value_names_the_variable(var: str, value: str) -> None:
    msg = _error({}, environ={var: value})
    assert var in msg
    assert value in msg


def test_unparsable_file_value_names_the_key(tmp_path: Path) -> None:
    path = _toml(tmp_path, "procs = 'many'\n")
    msg = _error({}, environ={}, config_file=path)
    assert "procs" in msg
    assert "many" in msg


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        Config(batch_size=0)


@pytest.mark.parametrize(
    "dsn",
    [
        f"postgresql://alice:{CANARY}@db.example.com:5432/app",
        f"postgres://alice:{CANARY}@db.example.com/app?sslmode=require",
        f"postgresql://alice@db.example.com/app?password={CANARY}&sslmode=require",
        f"host=db.example.com user=alice password={CANARY} dbname=app",
        f"host=db.example.com user=alice password = '{CANARY} with space' dbname=app",
    ],
)
def test_mask_dsn_hides_password(dsn: str) -> None:
    masked = mask_dsn(dsn)
    assert CANARY not in masked
    assert "alice" in masked
    assert "db.example.com" in masked
    assert "***" in masked


def test_mask_dsn_keeps_dsn_without_password() -> None:
    for dsn in ("postgresql://alice@db.example.com/app", "host=db user=alice dbname=app"):
        assert mask_dsn(dsn) == dsn


def test_tls_warning_for_unverified_remote_servers() -> None:
    from kestrel.config import tls_warning

    assert tls_warning("postgresql://u:p@db.example.com/app") is not None
    assert "sslmode=require" in (tls_warning("host=db.example.com sslmode=require") or "")
    assert tls_warning("postgresql://u@db.example.com/app?sslmode=verify-full") is None
    assert tls_warning("postgresql://u@localhost/app") is None
    assert tls_warning("postgresql://postgres:@/postgres?host=/tmp/sock") is None
    assert tls_warning("host=127.0.0.1,db.example.com") is not None

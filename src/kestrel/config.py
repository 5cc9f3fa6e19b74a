"""Runtime settings: one table of knobs read from flags, environment and a config file.

Precedence, highest first: command-line flag, ``KESTREL_<NAME>`` environment variable, key in
the TOML config file (``--config`` / ``KESTREL_CONFIG``), built-in default. Every knob is
validated before anything starts; an invalid one raises :class:`ConfigError` naming it.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from kestrel.codec import DEFAULT_MAX_PAYLOAD_BYTES, MAX_HISTORY_BYTES, QUEUE_NAME
from kestrel.errors import ConfigError
from kestrel.sql import SCHEMA_NAME, SCHEMA_RULE

if TYPE_CHECKING:
    from kestrel.queues import QueueSpec

# An application version (--app-version): a release name, a tag or a commit hash.
APP_VERSION = re.compile(r"[A-Za-z0-9_.:+/@-]{1,128}")


def _queues(text: str) -> tuple[str, ...]:
    return tuple(q.strip() for q in text.split(",") if q.strip())


def _bool(text: str) -> bool:
    if text.lower() in {"1", "true", "yes", "on"}:
        return True
    if text.lower() in {"0", "false", "no", "off"}:
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def incarnation_id(pid: int, nonce: str) -> str:
    """The worker id, and lease owner, of one process incarnation: ``host:pid:nonce``. The
    nonce keeps a later process that reuses the pid from being taken for this one (the
    supervisor releases a reaped worker's leases by this id, FAULTS O8)."""
    return f"{socket.gethostname()}:{pid}:{nonce}"


@dataclass(frozen=True, slots=True)
class Knob:
    """One setting: its flag, environment variable and config-file key derive from *name*."""

    name: str
    parse: Callable[[str], Any]
    help: str
    metavar: str = ""

    @property
    def flag(self) -> str:
        """The command-line flag: ``--`` and *name* with dashes for underscores."""
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        """The environment variable: ``KESTREL_`` and *name* in upper case."""
        return "KESTREL_" + self.name.upper()


KNOBS: tuple[Knob, ...] = (
    Knob("dsn", str, "PostgreSQL connection string. Without one (and without PG* variables) "
         "an embedded PostgreSQL is started in --data-dir.", "DSN"),
    Knob("schema", str, "Schema holding every kestrel table and function; of a namespace "
         "spread over buckets (migrate --buckets), its name, which is bucket 0's schema.",
         "NAME"),
    Knob("buckets", int, "migrate (and run, which migrates): make --schema a namespace of "
         "N buckets, N schemas "
         "(2-256; on Citus with schema-based sharding each one a distributed schema, "
         "spread over the nodes), or check that it has N. 0 (the default): as it was made "
         "(an ordinary schema: 1).", "N"),
    Knob("app", str, "Comma-separated modules to import; they register the workflows.",
         "MODULES"),
    Knob("procs", int, "Worker processes forked by the supervisor.", "N"),
    Knob("concurrency", int, "Executions each worker process runs at once. 0 (the default): "
         "a limit that adapts, starting at 256 and doubling or halving (32-1024) towards "
         "the count that gets the most work done per second while there is a backlog "
         "(the kestrel_concurrency_limit_executions gauge shows it); N fixes it at N.", "N"),
    Knob("batch_size", int, "Most executions one claim statement takes.", "N"),
    Knob("lease", float, "Lease length in seconds: a silent worker's executions are "
         "recovered this long after its last heartbeat.", "SECONDS"),
    Knob("heartbeat", float, "Seconds between heartbeats; must be under --lease.", "SECONDS"),
    Knob("lock_timeout", float, "Seconds any statement of a worker waits for a lock (a "
         "client's open transaction, an operator's LOCK) before it gives up and retries with "
         "backoff; 0: min(2, lease/4). At most half the lease.", "SECONDS"),
    Knob("poll_interval", float, "Seconds between claim polls when idle (jittered ±20%%); "
         "LISTEN/NOTIFY usually wakes workers sooner.", "SECONDS"),
    Knob("sweep_interval", float, "Seconds between sweeps for expired leases.", "SECONDS"),
    Knob("queues", _queues, "Comma-separated queues this runtime claims from.", "Q1,Q2"),
    Knob("queue_limits", str, "Limits of named queues, as an alternative to kestrel.queue() "
         "in code: 'ai:concurrency=5,rate=60/60,per_process=2;ci:per_key=1' (rate is "
         "N/SECONDS; per_key: at most N running per concurrency key).", "SPEC"),
    Knob("max_attempts", int, "Claims an execution may use without finishing before it is "
         "quarantined (its worker keeps dying).", "N"),
    Knob("drain_timeout", float, "On SIGTERM, seconds to let running executions finish "
         "before releasing their leases.", "SECONDS"),
    Knob("max_payload_bytes", int, "Largest encoded argument list, step output or result.",
         "BYTES"),
    Knob("max_history_bytes", int, "Most recorded step output one execution may load when "
         "it is claimed (its history as text); past it the execution fails with "
         "HistoryTooLarge instead of stalling its claims.", "BYTES"),
    Knob("listen", _bool, "Use LISTEN/NOTIFY for wake-ups (polling always runs too).",
         "BOOL"),
    Knob("connection_mode", str, "direct: a PostgreSQL server; pgbouncer: a pooler in "
         "transaction mode (no prepared statements unless --prepare on, LISTEN only on "
         "--listen-dsn).", "MODE"),
    Knob("prepare", str, "Server-side prepared statements: auto (on when direct, off behind "
         "PgBouncer), on (PgBouncer >= 1.21 with max_prepared_statements > 0), off.", "MODE"),
    Knob("listen_dsn", str, "Direct (non-pooled) DSN for LISTEN; behind PgBouncer without "
         "one, workers poll only.", "DSN"),
    Knob("pool_size", int, "Database connections per worker process (plus one for the "
         "heartbeat and one for LISTEN). Total cap: procs x (pool_size + 2).", "N"),
    Knob("history_interval", str, "Width of a history partition: day, week or month.",
         "UNIT"),
    Knob("history_ahead", int, "History partitions created ahead of time.", "N"),
    Knob("history_retention_days", float, "Drop history partitions wholly older than this "
         "many days; 0 keeps history for ever.", "DAYS"),
    Knob("maintenance_interval", float, "Seconds between partition upkeep rounds (one "
         "process at a time does the work).", "SECONDS"),
    Knob("metrics_host", str, "Address of the /metrics endpoint.", "HOST"),
    Knob("metrics_port", int, "Port of the /metrics endpoint; 0 disables it.", "PORT"),
    Knob("metrics_certfile", str, "TLS certificate for the metrics endpoint (PEM); "
         "without one it serves plain HTTP.", "PATH"),
    Knob("metrics_keyfile", str, "TLS private key for --metrics-certfile.", "PATH"),
    Knob("http_host", str, "Address of the HTTP API (kestrel-runtime serve, or --http-port "
         "on the supervisor).", "HOST"),
    Knob("http_port", int, "Port of the HTTP API. On the supervisor 0 disables it; serve "
         "uses 8080 when it is 0.", "PORT"),
    Knob("http_certfile", str, "TLS certificate for the HTTP API (PEM); without one it "
         "serves plain HTTP.", "PATH"),
    Knob("http_keyfile", str, "TLS private key for --http-certfile.", "PATH"),
    Knob("http_max_body_bytes", int, "Largest request body the HTTP API reads; a larger one "
         "gets 413 before it is read.", "BYTES"),
    Knob("http_max_header_bytes", int, "Largest request line and headers the HTTP API reads; "
         "past it the request gets 431 and its connection is closed, unread.", "BYTES"),
    Knob("http_header_timeout", float, "Seconds a client has to send a request's line and "
         "headers, from its connection or its first byte; then 408 and the connection is "
         "closed (a client that never finishes its headers holds nothing longer).", "SECONDS"),
    Knob("http_body_timeout", float, "Seconds a client has to send a request's whole body "
         "once its headers are in; then 408 and the connection is closed (a body trickled a "
         "byte at a time holds nothing longer).", "SECONDS"),
    Knob("http_statement_timeout", float, "Seconds a request of the HTTP API and web UI may "
         "wait on the database (a pool connection, a lock, a slow statement); then PostgreSQL "
         "ends the statement (a transaction-local statement_timeout, no cancel request), "
         "its connection goes back to the pool, and the request is answered 503 with "
         "Retry-After.", "SECONDS"),
    Knob("http_max_connections", int, "Most open connections the HTTP API keeps. At the "
         "limit a new one first displaces the oldest connection that is idle or still "
         "sending its headers; only when every connection carries a request is it refused "
         "with 503.", "N"),
    Knob("http_max_connections_per_client", int, "Most open connections of the HTTP API "
         "from one client address (0: no cap). At the cap a client's new connection "
         "displaces its own oldest idle or slowest one, else it is refused with 503: one "
         "client cannot take the door. Behind a reverse proxy every client has the proxy's "
         "address: set 0 there and let the proxy cap each client (deploy/nginx).", "N"),
    Knob("http_hook_body_budget_bytes", int, "Most bytes of webhook bodies the HTTP process "
         "holds at once before their signatures are checked (and while they are handled); "
         "a delivery past it is refused with 503 and Retry-After as its bytes arrive. At "
         "least the largest hook's max_body_bytes.", "BYTES"),
    Knob("http_hook_pool_size", int, "Database connections reserved for webhooks in the HTTP "
         "process, apart from the --pool-size connections of the API and web UI, so neither "
         "kind of traffic can take the other's.", "N"),
    Knob("data_dir", str, "Directory of the embedded PostgreSQL used when no DSN is set.",
         "PATH"),
    Knob("log_level", str, "debug, info, warning or error.", "LEVEL"),
    Knob("log_format", str, "text or json.", "FORMAT"),
    Knob("app_version", str, "Application version recorded on each execution this runtime "
         "starts (1-128 of A-Z a-z 0-9 _ . : + / @ -); change it with the code. Default: a "
         "hash of the registered workflows' source and of every module loaded from the "
         "application's own files.", "VERSION"),
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """Validated runtime settings. Build with :func:`load` or directly in code and tests."""

    dsn: str | None = None
    schema: str = "kestrel"
    buckets: int = 0
    app: str = ""
    procs: int = 1
    concurrency: int = 0
    batch_size: int = 32
    lease: float = 30.0
    heartbeat: float = 10.0
    lock_timeout: float = 0.0
    poll_interval: float = 1.0
    sweep_interval: float = 5.0
    queues: tuple[str, ...] = ("default",)
    queue_limits: str = ""
    max_attempts: int = 5
    drain_timeout: float = 30.0
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    max_history_bytes: int = MAX_HISTORY_BYTES
    listen: bool = True
    connection_mode: str = "direct"
    prepare: str = "auto"
    listen_dsn: str = ""
    pool_size: int = 6
    history_interval: str = "day"
    history_ahead: int = 3
    history_retention_days: float = 30.0
    maintenance_interval: float = 60.0
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0
    metrics_certfile: str = ""
    metrics_keyfile: str = ""
    http_host: str = "127.0.0.1"
    http_port: int = 0
    http_certfile: str = ""
    http_keyfile: str = ""
    http_max_body_bytes: int = 1024 * 1024
    http_max_header_bytes: int = 64 * 1024
    http_header_timeout: float = 10.0
    http_body_timeout: float = 30.0
    http_statement_timeout: float = 5.0
    http_max_connections: int = 1000
    http_max_connections_per_client: int = 100
    http_hook_body_budget_bytes: int = 64 * 1024 * 1024
    http_hook_pool_size: int = 2
    data_dir: str = ".kestrel/pgdata"
    log_level: str = "info"
    log_format: str = "text"
    app_version: str = ""
    worker_id: str = field(default="")

    def __post_init__(self) -> None:
        if not SCHEMA_NAME.fullmatch(self.schema):
            _bad("schema", self.schema[:100], f"must be {SCHEMA_RULE}")
        for name in ("procs", "batch_size", "max_attempts"):
            if getattr(self, name) < 1:
                _bad(name, getattr(self, name), "must be at least 1")
        if self.buckets and not 1 <= self.buckets <= 256:
            _bad("buckets", self.buckets, "must be 0 (as the namespace was made) or 1-256")
        if self.concurrency < 0:
            _bad("concurrency", self.concurrency, "must be 0 (adaptive) or at least 1")
        for name in ("lease", "heartbeat", "poll_interval", "sweep_interval"):
            if not getattr(self, name) > 0:
                _bad(name, getattr(self, name), "must be greater than 0")
        if self.heartbeat >= self.lease:
            _bad("heartbeat", self.heartbeat,
                 f"must be shorter than --lease ({self.lease}), or leases expire between "
                 "heartbeats")
        if not 0 <= self.lock_timeout <= self.lease / 2:
            _bad("lock_timeout", self.lock_timeout,
                 f"must be 0 (automatic) or at most half of --lease ({self.lease}): a "
                 "statement waiting on a lock must give up well before its lease runs out")
        if self.drain_timeout < 0:
            _bad("drain_timeout", self.drain_timeout, "must not be negative")
        if not self.queues:
            _bad("queues", "", "must name at least one queue")
        for q in self.queues:
            if not QUEUE_NAME.fullmatch(q):
                _bad("queues", q, "queue names are 1-128 of A-Z a-z 0-9 _ . : -")
        if self.connection_mode not in {"direct", "pgbouncer"}:
            _bad("connection_mode", self.connection_mode, "must be direct or pgbouncer")
        if self.prepare not in {"auto", "on", "off"}:
            _bad("prepare", self.prepare, "must be auto, on or off")
        if not 2 <= self.pool_size <= 100:
            _bad("pool_size", self.pool_size, "must be 2-100 (claims and writes run at once)")
        if self.history_interval not in {"day", "week", "month"}:
            _bad("history_interval", self.history_interval, "must be day, week or month")
        if not 0 <= self.history_ahead <= 366:
            _bad("history_ahead", self.history_ahead, "must be 0-366")
        if self.history_retention_days < 0:
            _bad("history_retention_days", self.history_retention_days,
                 "must not be negative (0 keeps history for ever)")
        if not self.maintenance_interval > 0:
            _bad("maintenance_interval", self.maintenance_interval, "must be greater than 0")
        from kestrel.queues import parse_limits

        parse_limits(self.queue_limits)  # raises ConfigError naming the bad part
        if self.max_payload_bytes < 1024:
            _bad("max_payload_bytes", self.max_payload_bytes, "must be at least 1024")
        if not self.max_payload_bytes <= self.max_history_bytes <= 200 * 1024 * 1024:
            _bad("max_history_bytes", self.max_history_bytes, "must be at least "
                 "--max-payload-bytes and at most 200 MiB (PostgreSQL's jsonb limit is 256 MB)")
        if not 0 <= self.metrics_port <= 65535:
            _bad("metrics_port", self.metrics_port, "must be 0-65535")
        if not 0 <= self.http_port <= 65535:
            _bad("http_port", self.http_port, "must be 0-65535")
        if self.http_certfile and not self.http_keyfile:
            _bad("http_keyfile", "", "is needed with --http-certfile")
        if not 1024 <= self.http_max_body_bytes <= 256 * 1024 * 1024:
            _bad("http_max_body_bytes", self.http_max_body_bytes, "must be 1 KiB-256 MiB")
        if not 1024 <= self.http_max_header_bytes <= 1024 * 1024:
            _bad("http_max_header_bytes", self.http_max_header_bytes, "must be 1 KiB-1 MiB")
        for name in ("http_header_timeout", "http_body_timeout", "http_statement_timeout"):
            if not 0 < getattr(self, name) <= 3600:
                _bad(name, getattr(self, name), "must be greater than 0 and at most 3600")
        if not 1 <= self.http_max_connections <= 100_000:
            _bad("http_max_connections", self.http_max_connections, "must be 1-100000")
        if not 0 <= self.http_max_connections_per_client <= 100_000:
            _bad("http_max_connections_per_client", self.http_max_connections_per_client,
                 "must be 0-100000 (0: no cap)")
        if not 1024 * 1024 <= self.http_hook_body_budget_bytes <= 64 * 1024 ** 3:
            _bad("http_hook_body_budget_bytes", self.http_hook_body_budget_bytes,
                 "must be 1 MiB-64 GiB")
        if not 1 <= self.http_hook_pool_size <= 100:
            _bad("http_hook_pool_size", self.http_hook_pool_size, "must be 1-100")
        if self.log_level not in {"debug", "info", "warning", "error"}:
            _bad("log_level", self.log_level, "must be debug, info, warning or error")
        if self.log_format not in {"text", "json"}:
            _bad("log_format", self.log_format, "must be text or json")
        if self.app_version and not APP_VERSION.fullmatch(self.app_version):
            _bad("app_version", self.app_version[:200],
                 "must be 1-128 of A-Z a-z 0-9 _ . : + / @ -")

    @property
    def statement_lock_timeout(self) -> float:
        """Seconds every worker statement waits for a lock: --lock-timeout, or min(2 s,
        lease/4) when it is 0."""
        return self.lock_timeout or min(2.0, self.lease / 4)

    @property
    def max_concurrency(self) -> int:
        """The most executions one process may run at once: --concurrency, or the adaptive
        limit's ceiling when it is 0 (:mod:`kestrel.slots`)."""
        from kestrel.slots import CEILING

        return self.concurrency or CEILING

    @property
    def prepared_statements(self) -> bool:
        """Whether hot statements are prepared server-side."""
        if self.prepare == "auto":
            return self.connection_mode == "direct"
        return self.prepare == "on"

    def notify_dsn(self, dsn: str) -> str | None:
        """Where to LISTEN given the resolved *dsn*: --listen-dsn, else *dsn* when direct,
        else nowhere (behind PgBouncer a LISTEN would land on a shared server connection and
        its notifications would be lost: poll instead)."""
        if self.listen_dsn:
            return self.listen_dsn
        return None if self.connection_mode == "pgbouncer" else dsn

    @property
    def max_connections(self) -> int:
        """Most connections this runtime opens: every process's pool, its heartbeat
        connection and its LISTEN."""
        return self.procs * (self.pool_size + 1 + (1 if self.listen else 0))

    def queue_specs(self) -> dict[str, QueueSpec]:
        """Declared queues: those of kestrel.queue() in code, overridden by --queue-limits."""
        from kestrel.queues import declared, parse_limits

        return {**declared(), **parse_limits(self.queue_limits)}

    def check_queues(self) -> None:
        """Every queue in --queues must be 'default' or declared.

        Raises:
            ConfigError: naming the unknown queue and the known ones.
        """
        known = {"default", *self.queue_specs()}
        for q in self.queues:
            if q not in known:
                _bad("queues", q, f"unknown queue; declare it with kestrel.queue({q!r}) or "
                     f"--queue-limits (known: {', '.join(sorted(known))})")

    def replace(self, **changes: Any) -> Config:
        """Return a copy with *changes* applied (and validated)."""
        return dataclasses.replace(self, **changes)


def _bad(name: str, value: object, why: str) -> None:
    knob = next((k for k in KNOBS if k.name == name), None)
    where = f"{knob.flag} / {knob.env}" if knob else name
    raise ConfigError(f"invalid setting {where}={value!r}: {why}")


def load(
    flags: Mapping[str, Any],
    *,
    environ: Mapping[str, str] | None = None,
    config_file: str | None = None,
) -> Config:
    """Merge flags, environment and config file into a validated :class:`Config`.

    *flags* maps knob names to values already parsed (``None`` = not given).

    Raises:
        ConfigError: a value does not parse or is out of range; the message names it.
    """
    env = os.environ if environ is None else environ
    path = config_file or env.get("KESTREL_CONFIG")
    from_file = _read_file(path) if path else {}
    values: dict[str, Any] = {}
    for knob in KNOBS:
        if flags.get(knob.name) is not None:
            values[knob.name] = flags[knob.name]
        elif knob.env in env:
            values[knob.name] = _parse(knob, env[knob.env], f"environment {knob.env}")
        elif knob.name in from_file:
            raw = from_file[knob.name]
            if isinstance(raw, list):  # queues = ["a", "b"]
                raw = ",".join(map(str, raw))
            if isinstance(raw, dict):
                raise ConfigError(f"config file {path}: {knob.name} must be a value, not a table")
            text = str(raw).lower() if isinstance(raw, bool) else str(raw)
            values[knob.name] = _parse(knob, text, f"{path}: {knob.name}")
    return Config(**values)


def _read_file(path: str) -> dict[str, Any]:
    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    section = data.get("kestrel", data)
    # [hooks.NAME] tables configure the HTTP door's webhooks (kestrel/http/hooks.py).
    known = {k.name for k in KNOBS} | {"hooks"}
    unknown = sorted(set(section) - known)
    if unknown:
        raise ConfigError(f"config file {path}: unknown setting(s) {', '.join(unknown)}")
    return dict(section)


def _parse(knob: Knob, text: str, source: str) -> Any:
    try:
        return knob.parse(text)
    except ValueError as exc:
        raise ConfigError(f"invalid setting {source}={text!r}: {exc}") from None


def mask_dsn(dsn: str) -> str:
    """Return *dsn* with any password replaced by ``***`` (URL and key=value forms)."""
    if "://" in dsn:
        parts = urlsplit(dsn)
        if parts.password is not None:
            host = parts.netloc.rsplit("@", 1)[1]
            netloc = f"{parts.username or ''}:***@{host}"
            dsn = urlunsplit(parts._replace(netloc=netloc))
        return re.sub(r"(password=)[^&]*", r"\1***", dsn)
    return re.sub(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", r"\1***", dsn)


_LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1", ""}


def tls_warning(dsn: str) -> str | None:
    """A warning when *dsn* reaches a non-local server without verifying it (FAULTS S6).

    libpq's default ``sslmode=prefer`` neither requires TLS nor checks the certificate;
    only ``verify-full`` protects against a server that is not the one you meant.
    """
    from psycopg.conninfo import conninfo_to_dict

    try:
        params = conninfo_to_dict(dsn)
    except Exception:  # an unparsable DSN fails at connect with its own message
        return None
    hosts = [h for h in str(params.get("host") or "").split(",")]
    remote = [h for h in hosts if h not in _LOCAL_HOSTS and not h.startswith("/")]
    mode = str(params.get("sslmode") or "prefer")
    if remote and mode in {"disable", "allow", "prefer", "require"}:
        return (f"the connection to {', '.join(remote)} uses sslmode={mode}: the server is not "
                "verified; use sslmode=verify-full (with sslrootcert) in production")
    return None

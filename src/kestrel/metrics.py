"""Every Prometheus metric kestrel exports, and the HTTP endpoint that serves them.

Multiprocess mode (prometheus_client): the supervisor points ``PROMETHEUS_MULTIPROC_DIR`` at
a directory it empties at start, *before* this module is imported anywhere, so each forked
worker writes its own files; the supervisor serves the merged view on ``/metrics``, with
``/healthz`` and ``/readyz``, and marks dead children's files dead so gauges of exited
processes disappear (prometheus/client_python#275). Without the variable (tests, scripts,
an application using only the client) the metrics are ordinary in-process metrics.

Labels are bounded by design: ``workflow``, ``step``, ``queue``, ``outcome``, ``kind`` and
``state`` take values from code (registered names) or from small fixed sets; execution ids,
arguments, error text and DSNs are never labels (FAULTS S2). The HTTP door's ``route`` is a
route's template (``/api/v1/executions/{id}``), never the path a client sent, and its
``method`` one of a fixed few. Internal steps are labelled by
their kind (``kestrel.signal``), never by the signal or child id they carry.
"""

from __future__ import annotations

import json
import os
import ssl
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, TypeVar, cast

from kestrel.errors import ConfigError

if TYPE_CHECKING:
    from prometheus_client.metrics import MetricWrapperBase

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 3600)
_COMMIT = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_HTTP = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)

M = TypeVar("M", bound="MetricWrapperBase")


class Metrics:
    """The metric objects. Created on first use: prometheus_client picks single- or
    multi-process storage when it is imported, so nothing may import it before the
    supervisor has set ``PROMETHEUS_MULTIPROC_DIR`` (see :func:`prepare_multiprocess`)."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        self.submitted = Counter(
            "kestrel_workflows_submitted_total", "Executions submitted through this "
            "process's clients (SQL submissions show in kestrel_queue_depth)", ["workflow"])
        self.started = Counter("kestrel_workflows_started_total",
                               "Executions claimed for the first time", ["workflow"])
        self.finished = Counter("kestrel_workflows_finished_total",
                                "Executions finished, by outcome: by a worker, or (cancels "
                                "and deadlines no worker saw) by the metrics collector",
                                ["workflow", "outcome"])
        self.deadlines = Counter("kestrel_deadlines_exceeded_total",
                                 "Executions failed because their workflow deadline passed, "
                                 "by their worker or by the sweeper (also counted in "
                                 "kestrel_workflows_finished_total as failed)", ["workflow"])
        self.parked = Counter("kestrel_workflows_parked_total",
                              "Executions parked as a row (sleep, signal or child wait)",
                              ["workflow"])
        self.step_runs = Counter("kestrel_step_runs_total",
                                 "Step bodies run to a checkpoint, by outcome",
                                 ["workflow", "step", "outcome"])
        self.step_retries = Counter("kestrel_step_retries_total",
                                    "Step attempts that failed and were retried",
                                    ["workflow", "step"])
        self.step_seconds = Histogram("kestrel_step_duration_seconds",
                                      "Step body duration, all attempts",
                                      ["workflow", "step"], buckets=_LATENCY)
        self.claim_batch = Histogram("kestrel_claim_batch_size",
                                     "Executions taken per claim statement", buckets=_BATCH)
        self.claim_seconds = Histogram("kestrel_claim_seconds", "Claim statement latency",
                                       buckets=_COMMIT)
        self.checkpoint_batch = Histogram("kestrel_checkpoint_batch_size",
                                          "Checkpoints written per group commit",
                                          buckets=_BATCH)
        self.checkpoint_seconds = Histogram("kestrel_checkpoint_commit_seconds",
                                            "Checkpoint group-commit latency", buckets=_COMMIT)
        self.completion_batch = Histogram("kestrel_completion_batch_size",
                                          "Executions finished per statement", buckets=_BATCH)
        self.completion_seconds = Histogram("kestrel_completion_commit_seconds",
                                            "Completion statement latency", buckets=_COMMIT)
        self.submit_to_start = Histogram("kestrel_submit_to_start_seconds",
                                         "Submission to first claim (database clock)",
                                         ["workflow"], buckets=_LATENCY)
        self.submit_to_finish = Histogram("kestrel_submit_to_finish_seconds",
                                          "Submission to finish", ["workflow"],
                                          buckets=_LATENCY)
        self.leases_expired = Counter("kestrel_leases_expired_total",
                                      "Expired leases the sweeper recovered")
        self.leases_lost = Counter("kestrel_leases_lost_total",
                                   "Executions a worker abandoned because its lease was gone")
        self.fenced = Counter("kestrel_fenced_writes_total",
                              "Writes rejected because a newer claim owns the execution",
                              ["kind"])
        self.stalls = Counter("kestrel_stalls_total",
                              "Times a worker stopped extending its leases because its event "
                              "loop or a writer made no progress for a whole lease")
        self.rejected_writes = Counter("kestrel_rejected_writes_total",
                                       "Writes the database refused for one execution, "
                                       "isolated from the rest of their group commit", ["kind"])
        self.write_retries = Counter("kestrel_write_retries_total",
                                     "Group commits sent again because the database refused "
                                     "them for contention (a lock or statement timeout, a "
                                     "deadlock...), by writer and SQLSTATE",
                                     ["kind", "sqlstate"])
        self.quarantined = Counter("kestrel_quarantined_total",
                                   "Executions quarantined after max_attempts lost workers")
        self.worker_restarts = Counter("kestrel_worker_restarts_total",
                                       "Worker processes restarted after they died")
        # Set by one process of each schema (of each bucket, in a namespace): summed.
        self.queue_depth = Gauge("kestrel_queue_depth", "Live executions by queue and status",
                                 ["queue", "status"], multiprocess_mode="livesum")
        self.waiting = Gauge("kestrel_waiting_executions",
                             "Waiting executions by workflow and what they wait for: a "
                             "signal's name (an approval), kestrel.sleep or kestrel.child",
                             ["workflow", "waiting_for"], multiprocess_mode="livesum")
        self.oldest_queued = Gauge("kestrel_oldest_queued_seconds",
                                   "Age of the oldest queued execution", ["queue"],
                                   multiprocess_mode="livemax")
        self.pool = Gauge("kestrel_pool_connections", "Database pool connections by state",
                          ["state"], multiprocess_mode="livesum")
        self.running = Gauge("kestrel_running_executions",
                             "Executions running in worker processes",
                             multiprocess_mode="livesum")
        self.concurrency_limit = Gauge(
            "kestrel_concurrency_limit_executions", "Executions worker processes may run at once: "
            "--concurrency each, or each one's adaptive limit", multiprocess_mode="livesum")
        self.workers = Gauge("kestrel_workers", "Worker processes alive",
                             multiprocess_mode="livesum")
        # No workflow label: an unclaimable name may be anything a client submitted, so it
        # never becomes a label (FAULTS P4, S2); `kestrel-runtime unclaimable` names them.
        self.unclaimable = Gauge("kestrel_unclaimable_executions",
                                 "Live executions whose workflow and queue no live worker "
                                 "registers (they wait)", multiprocess_mode="livesum")
        self.unclaimable_workflows = Gauge("kestrel_unclaimable_workflows",
                                           "Distinct workflow names among the unclaimable "
                                           "executions (of a namespace: the most of any "
                                           "bucket)", multiprocess_mode="livemax")
        # Give-backs (CodeTooOld): a worker whose code is older than an execution's history
        # left it, unrun, for a worker of another version (FAULTS O5).
        self.give_backs = Counter("kestrel_give_backs_total",
                                  "Executions a worker gave back unrun because newer code "
                                  "recorded a patch it does not know", ["workflow"])
        # The HTTP door (its own process): requests by route template, method and status;
        # connections the door refused or cut before a request reached a route.
        self.http_requests = Counter("kestrel_http_requests_total",
                                     "HTTP requests answered, by method, route template "
                                     "(unmatched: no route) and status",
                                     ["method", "route", "status"])
        self.http_seconds = Histogram("kestrel_http_request_duration_seconds",
                                      "HTTP request duration, headers in to response sent, "
                                      "by method and route template", ["method", "route"],
                                      buckets=_HTTP)
        self.http_refused = Counter("kestrel_http_refused_total",
                                    "HTTP connections refused or cut by the door itself, by "
                                    "reason: header_timeout, body_timeout, header_too_large, "
                                    "trailers_too_large, connection_limit, client_limit, "
                                    "displaced, displaced_body, malformed; and requests "
                                    "refused 503 because the database did not answer within "
                                    "--http-statement-timeout (statement_timeout) or the "
                                    "webhook body budget was spent (hook_body_budget)",
                                    ["reason"])
        self.http_connections = Gauge("kestrel_http_connections",
                                      "Open connections of the HTTP door",
                                      multiprocess_mode="livesum")
        self.given_back = Gauge("kestrel_given_back_executions",
                                "Live executions given back and not claimed since: they wait "
                                "for a worker of another app version",
                                multiprocess_mode="livesum")

    def child(self, metric: M, *labels: str) -> M:
        """``metric.labels(*labels)``, created once and then reused: the hot path labels a
        few metrics per step and per workflow, and ``labels()`` validates and locks on every
        call (about 1 µs each). Safe to share: label values are bounded (FAULTS S2), so the
        cache is too, and a dict lookup needs no lock."""
        key = (metric, labels)  # the metric itself, not its id: an id can be reused
        got = _children.get(key)
        if got is None:
            got = _children[key] = metric.labels(*labels)
            if metric is self.step_seconds:
                # A step's retries exist, at 0, from its first run: a rate() over them has
                # data before anything retried (the dashboard's panel said "No data").
                self.step_retries.labels(*labels)
        return cast(M, got)


_metrics: Metrics | None = None
# Metrics.child's cache (not an attribute: every attribute of Metrics is a metric).
_children: dict[tuple[MetricWrapperBase, tuple[str, ...]], MetricWrapperBase] = {}
_create_lock = threading.Lock()


def get() -> Metrics:
    """The process's metrics, created on first use, once, whatever the number of threads
    asking at once (two creations would register every name twice: DuplicateTimeseries)."""
    global _metrics
    made = _metrics
    if made is None:
        with _create_lock:
            made = _metrics
            if made is None:
                made = _metrics = Metrics()
    return made


def prepare_multiprocess(directory: str | None = None) -> str:
    """Set up multiprocess mode for a supervisor: an empty directory in the environment,
    before prometheus_client is imported. Returns the directory.

    Raises:
        RuntimeError: prometheus_client was imported already (by the app?), too early.
    """
    import shutil
    import sys
    import tempfile

    if "prometheus_client" in sys.modules and not os.environ.get(MULTIPROC_ENV):
        raise RuntimeError("prometheus_client was imported before the supervisor could set "
                           f"{MULTIPROC_ENV}; import it lazily in your app module")
    path = directory or tempfile.mkdtemp(prefix="kestrel-metrics-")
    shutil.rmtree(path, ignore_errors=True)  # stale files of an earlier run would add up
    os.makedirs(path, exist_ok=True)
    first = "prometheus_client" not in sys.modules
    os.environ[MULTIPROC_ENV] = path
    if first:
        _multiprocess_values_with_cached_pid()
    return path


_pid = os.getpid()


def _fork_child() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_fork_child)


def _cached_pid() -> int:
    return _pid


def _multiprocess_values_with_cached_pid() -> None:
    """Multiprocess values that learn of a fork from a pid kept current at fork, not from a
    getpid() system call on every increment (prometheus_client's default): at a few metric
    updates a step, that call was 8-9% of a worker's samples (py-spy --native) and its
    removal -4% of a worker's CPU per workflow (BENCHMARKS.md).

    Only where nothing has made a value yet (prometheus_client imported just now, under the
    directory): each value class keeps its own open files, and two of them writing one
    process's file would corrupt it."""
    from prometheus_client import values

    values.ValueClass = values.MultiProcessValue(  # type: ignore[no-untyped-call]
        process_identifier=_cached_pid)


def step_label(name: str) -> str:
    """Bounded step label: internal steps by kind (``kestrel.signal:x`` → ``kestrel.signal``)."""
    return name.split(":", 1)[0] if name.startswith("kestrel.") else name


def registry() -> Any:
    """The registry to serve: merged across processes in multiprocess mode."""
    from prometheus_client import REGISTRY, CollectorRegistry, multiprocess

    if os.environ.get(MULTIPROC_ENV):
        reg = CollectorRegistry()
        multiprocess.MultiProcessCollector(reg)  # type: ignore[no-untyped-call]
        return reg
    return REGISTRY


def mark_dead(pid: int) -> None:
    """Drop a dead worker's live gauges (multiprocess mode)."""
    if os.environ.get(MULTIPROC_ENV):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)  # type: ignore[no-untyped-call]


def serve(host: str, port: int, *, ready: Callable[[], tuple[bool, str]],
          certfile: str | None = None, keyfile: str | None = None) -> ThreadingHTTPServer:
    """Serve ``/metrics``, ``/healthz`` and ``/readyz`` on *host*:*port* in a thread.

    Read-only: there is no endpoint that changes anything. *ready* says whether the database
    is reachable and the schema current. With *certfile* (and *keyfile*) it speaks TLS.
    """
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    get()  # the supervisor's own metrics (restarts) exist from the start
    reg = registry()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._send(200, generate_latest(reg), CONTENT_TYPE_LATEST)
            elif path == "/healthz":
                self._send(200, b"ok\n", "text/plain")
            elif path == "/readyz":
                ok, why = ready()
                body = json.dumps({"ready": ok, "detail": why}).encode()
                self._send(200 if ok else 503, body, "application/json")
            else:
                self._send(404, b"not found\n", "text/plain")

        def _send(self, code: int, body: bytes, ctype: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # scrapes are not events
            pass

    try:
        server = ThreadingHTTPServer((host, port), Handler)
    except OSError as exc:
        # One line naming the setting and the fix, not a traceback (README, "Operating").
        raise ConfigError(
            f"invalid setting --metrics-port={port}: cannot listen on {host}:{port} "
            f"({exc.strerror or exc}); choose a free port (or stop what holds it) with "
            "--metrics-port / KESTREL_METRICS_PORT, or 0 to serve no metrics") from None
    if certfile:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            ctx.load_cert_chain(certfile, keyfile)
        except OSError as exc:  # ssl.SSLError is one
            server.server_close()
            raise ConfigError(
                f"invalid setting --metrics-certfile={certfile!r}: cannot load the "
                f"certificate and key ({exc.strerror or exc})") from None
        server.socket = ctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, name="kestrel-metrics", daemon=True).start()
    return server

"""The HTTP door's connection guard: uvicorn's httptools protocol with deadlines and caps.

uvicorn alone has no deadline for a request's headers or body, no cap on header size
(httptools buffers a header of any length) and a fixed ``limit_concurrency`` at which every
request, ``/healthz`` included, gets a plain-text 503 for as long as idle or stalled
connections stay open. :func:`protocol_class` returns a subclass of its
``HttpToolsProtocol`` that, per connection:

- gives a request ``header_timeout`` seconds for its request line and headers, counted
  from the connection (a client that connects and says nothing) or from the first byte
  after a keep-alive pause, and ``body_timeout`` seconds from its headers to the end of its
  body (while the door itself has paused reading, because the app has not taken what came
  yet, the clock is not the client's and starts again);
- refuses a request line and headers over ``max_header_bytes``, counted as they arrive,
  before httptools has buffered more than one read past the cap;
- refuses a request line and headers over ``max_header_bytes``, and as much again of chunk
  framing and trailers after them (httptools joins a trailer's value piece by piece
  without limit: three connections once grew the server by 280 MiB);
- keeps at most ``max_per_client`` connections open from one client address: at its cap, a
  client's new connection displaces that client's own oldest one that is idle, sending its
  headers or sending its body, else it is refused, so one client cannot take the door;
- keeps at most ``max_connections`` open: at the limit, a new connection displaces the
  oldest connection that is idle (keep-alive) or still sending its headers, else the one
  whose body has been arriving longest (a request that announces a body and never sends
  it held its slot for the whole body timeout); only when every connection has a request
  in the app is the new one refused;
- counts the sockets of refused connections until they close: at most
  ``lingering_cap`` of them linger for their answer to be read, the oldest beyond that
  are closed at once (the process's open-file limit is checked at start, :func:`check_files`);
- answers every refusal of its own (400 malformed, 408, 431, 503) as one line of JSON,
  ``{"error": "..."}``, like the app's, with ``Connection: close``, then closes after
  the client has had a moment (``LINGER_S``) to read it: the write side is shut first and
  what still arrives is discarded, so the answer is not lost to a reset.

A refusal never reaches the app: the request is counted in ``kestrel_http_refused_total``
(by reason) instead of ``kestrel_http_requests_total``. When the client is cut off
mid-body, the app's handler sees a disconnect and its answer is dropped.

It relies on uvicorn's httptools protocol internals (``parser``, ``cycle``, ``flow``,
``connections``), as of uvicorn 0.30-0.55; httptools is a dependency of kestrel-runtime.
A TLS handshake is not a connection here until it completes (asyncio bounds a handshake to
60 s).
"""

from __future__ import annotations

import asyncio
import http
import json
from dataclasses import dataclass
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kestrel import metrics
from kestrel.config import Config
from kestrel.errors import ConfigError

LINGER_S = 2.0
"""Seconds a refused connection stays half-open so that the client reads the answer."""


@dataclass(frozen=True, slots=True)
class DoorLimits:
    """What one connection may take: see the module docstring."""

    max_header_bytes: int
    header_timeout: float
    body_timeout: float
    max_connections: int
    max_per_client: int = 0  # 0: no cap per client address

    @classmethod
    def of(cls, cfg: Config) -> DoorLimits:
        """The limits set by ``--http-max-header-bytes``, ``--http-header-timeout``,
        ``--http-body-timeout``, ``--http-max-connections`` and
        ``--http-max-connections-per-client``."""
        return cls(max_header_bytes=cfg.http_max_header_bytes,
                   header_timeout=cfg.http_header_timeout,
                   body_timeout=cfg.http_body_timeout,
                   max_connections=cfg.http_max_connections,
                   max_per_client=cfg.http_max_connections_per_client)

    @property
    def lingering_cap(self) -> int:
        """Refused connections left half-open for their answer to be read, at most."""
        return max(16, self.max_connections // 8)

    @property
    def sockets(self) -> int:
        """The most sockets the door holds at once: its connections and the lingering."""
        return self.max_connections + self.lingering_cap


def check_files(limits: DoorLimits, *, others: int) -> str | None:
    """Make sure this process may open the door's sockets and *others* files (its database
    connections, logs, a margin): raise the soft open-file limit up to the hard one where
    needed. Returns what was done, for the log, or None.

    Raises:
        ConfigError: the hard limit is too low (accept() would fail with EMFILE and new
            clients get no answer at all: 5 to 7 of 8 did, at the defaults under a soft
            limit of 1,024).
    """
    import resource

    need = limits.sockets + others
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return None
    if hard != resource.RLIM_INFINITY and hard < need:
        raise ConfigError(
            f"invalid setting --http-max-connections={limits.max_connections}: the door "
            f"needs about {need} open files and this process may open {hard} at most "
            "(ulimit -Hn); raise the limit (LimitNOFILE= for systemd, ulimits in Docker) or "
            "lower --http-max-connections")
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    return f"raised the open-file limit from {soft} to {need} (hard limit {hard})"


def refusal(status: int, reason: str, *, retry_after: int | None = None) -> bytes:
    """A whole HTTP/1.1 response: *reason* as ``{"error": ...}`` JSON, then close."""
    body = (json.dumps({"error": reason}, ensure_ascii=True) + "\n").encode()
    head = [f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}",
            "content-type: application/json", f"content-length: {len(body)}",
            "connection: close"]
    if retry_after is not None:
        head.append(f"retry-after: {retry_after}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def protocol_class(limits: DoorLimits) -> type[GuardedProtocol]:
    """The protocol class to give uvicorn (``http=``), with *limits*."""
    return type("GuardedProtocol", (GuardedProtocol,), {"limits": limits, "lingering": {}})


class _Refused(Exception):
    """Raised from a parser callback once the door has refused the request: it stops
    httptools from parsing the rest."""


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the door's deadlines and caps."""

    limits: DoorLimits
    lingering: dict[GuardedProtocol, None]
    """Refused connections still open for their answer to be read, oldest first (one dict
    per server: :func:`protocol_class`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._linger: asyncio.TimerHandle | None = None
        self._header_bytes = 0  # bytes received while the current headers are incomplete
        self._headers_seen = False  # a header block completed in the current read
        self._since = 0.0  # when it became idle or started sending headers (displacement)
        self._body_since = 0.0  # when its body started to arrive (displacement)
        self._raw_body = 0  # bytes received for the current body, framing and trailers too
        self._body_bytes = 0  # bytes of the current body itself
        self._chunks = 0  # chunks of the current body (their framing is allowed for)
        self._peer: str | None = None
        self._done = False  # the door refused or cut it: discard whatever still comes
        self._open = False

    # -- connection ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Start its header clock; over the connection limit, displace or refuse."""
        super().connection_made(transport)
        self._open = True
        self._peer = self.client[0] if self.client else None
        metrics.get().http_connections.inc()
        self._start_headers()
        cap = self.limits.max_per_client
        if cap and self._peer is not None and sum(
                1 for c in self.connections
                if isinstance(c, GuardedProtocol) and c._peer == self._peer) > cap and \
                not self._displace(same_client=True):
            self._refuse(503, f"this client has {cap} connections open, the most one client "
                         "may; finish or close some, then try again", "client_limit")
        elif len(self.connections) > self.limits.max_connections and not self._displace():
            self._refuse(503, "the server is at its connection limit; try again",
                         "connection_limit")
        self._shed_lingering()

    def connection_lost(self, exc: Exception | None) -> None:
        """Stop its clocks."""
        for timer in (self._header_timer, self._body_timer, self._linger):
            if timer is not None:
                timer.cancel()
        self._header_timer = self._body_timer = self._linger = None
        self.lingering.pop(self, None)
        if self._open:
            self._open = False
            metrics.get().http_connections.dec()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        """Feed httptools, counting header bytes; anything it cannot parse is a 400."""
        if self._done:
            return  # refused: the answer is out, the rest is read and dropped
        self._unset_keepalive_if_required()
        if self._idle():
            self._start_headers()  # the first byte after a keep-alive pause
        self._headers_seen = False
        in_body = self._body_timer is not None
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError:
            if not self._done:  # not a refusal raised from a callback: bad HTTP
                self._refuse(400, "malformed HTTP request", "malformed")
            return
        if self._header_timer is not None and not self._headers_seen:
            self._header_bytes += len(data)
            if self._header_bytes > self.limits.max_header_bytes:
                self._refuse(431, "request line and headers over the cap of "
                             f"{self.limits.max_header_bytes} bytes", "header_too_large")
        elif in_body and self._body_timer is not None:
            # Still the same body: what is not body is chunk framing (a few bytes a chunk)
            # or trailers, which get the headers' cap and no more.
            self._raw_body += len(data)
            if (self._raw_body - self._body_bytes - 32 * self._chunks
                    > self.limits.max_header_bytes):
                self._refuse(431, "chunk framing and trailers over the cap of "
                             f"{self.limits.max_header_bytes} bytes", "trailers_too_large")

    def send_400_response(self, msg: str) -> None:
        """uvicorn's plain-text 400, as the door's JSON refusal."""
        self._refuse(400, "malformed HTTP request", "malformed")

    # -- parser callbacks ----------------------------------------------------------------

    def on_message_begin(self) -> None:
        """A request begins: its header clock runs (unless it already does)."""
        super().on_message_begin()
        self._start_headers()  # a pipelined request right after another

    def on_headers_complete(self) -> None:
        """Headers in: stop their clock, refuse them over the cap, start the body's."""
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        self._headers_seen = True
        self._header_bytes = 0
        size = len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers)
        if size > self.limits.max_header_bytes:
            self._refuse(431, "request line and headers over the cap of "
                         f"{self.limits.max_header_bytes} bytes", "header_too_large")
            raise _Refused
        super().on_headers_complete()
        self._body_since = self.loop.time()
        self._raw_body = self._body_bytes = self._chunks = 0
        self._body_timer = self.loop.call_later(self.limits.body_timeout, self._body_late)

    def on_body(self, body: bytes) -> None:
        """Count the body's own bytes (the rest of what arrives is framing or trailers)."""
        self._body_bytes += len(body)
        super().on_body(body)

    def on_chunk_header(self) -> None:
        """Another chunk: its size line and CRLFs are framing, allowed for."""
        self._chunks += 1

    def on_message_complete(self) -> None:
        """Body in: stop its clock."""
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        super().on_message_complete()

    def on_response_complete(self) -> None:
        """Answered: idle from now (for displacement at the limit)."""
        self._since = self.loop.time()
        super().on_response_complete()

    # -- deadlines, limits, refusals -----------------------------------------------------

    def _idle(self) -> bool:
        """No request on this connection: between keep-alive requests."""
        return (self._header_timer is None and self._body_timer is None
                and not self.pipeline
                and (self.cycle is None or self.cycle.response_complete))

    def _start_headers(self) -> None:
        if self._header_timer is None and not self._done:
            self._header_bytes = 0
            self._since = self.loop.time()
            self._header_timer = self.loop.call_later(self.limits.header_timeout,
                                                      self._headers_late)

    def _headers_late(self) -> None:
        self._header_timer = None
        self._refuse(408, f"request headers not received within {self.limits.header_timeout:g}"
                     " s", "header_timeout")

    def _body_late(self) -> None:
        self._body_timer = None
        if self.flow.read_paused and not self.transport.is_closing():
            # The door stopped reading (the app has not taken the body yet, or an earlier
            # request is still being answered): not the client's delay.
            self._body_timer = self.loop.call_later(self.limits.body_timeout, self._body_late)
            return
        self._refuse(408, f"request body not received within {self.limits.body_timeout:g} s",
                     "body_timeout")

    def _displace(self, *, same_client: bool = False) -> bool:
        """Make room for this connection: close another (of this client's, with
        *same_client*): a refused one first, else the oldest that is idle or still sending
        its headers, else the one whose body has been arriving longest. False when every
        other has a request in the app."""
        waiting: GuardedProtocol | None = None  # idle or sending its headers
        sending: GuardedProtocol | None = None  # sending its body
        for conn in self.connections:
            if conn is self or not isinstance(conn, GuardedProtocol):
                continue
            if same_client and conn._peer != self._peer:
                continue
            if conn._done:
                waiting = conn
                break
            if conn._header_timer is not None or conn._idle():
                if waiting is None or conn._since < waiting._since:
                    waiting = conn
            elif conn._body_timer is not None and (
                    sending is None or conn._body_since < sending._body_since):
                sending = conn
        victim = waiting or sending
        if victim is None:
            return False
        answered = victim.cycle is not None and victim.cycle.response_complete
        if victim._done or (victim is waiting and victim._header_timer is None):
            victim.transport.close()  # idle: a client retries on a closed keep-alive
            if not victim._done:
                metrics.get().http_refused.labels("displaced").inc()
        elif victim is sending and answered:
            # Answered already (a route that never reads the body it was announced): the
            # body still awaited is only holding the slot.
            victim.transport.close()
            metrics.get().http_refused.labels("displaced_body").inc()
        elif victim is waiting:
            victim._refuse(503, "the server is at its connection limit and this request's "
                           "headers were the slowest; try again", "displaced")
        else:
            victim._refuse(503, "the server is at its connection limit and this request's "
                           "body was the slowest; try again", "displaced_body")
        self.connections.discard(victim)  # closing: it takes no connection's slot
        return True

    def _shed_lingering(self) -> None:
        """Close at once the oldest refused connections past :attr:`DoorLimits.lingering_cap`:
        their sockets count against the process's open files until closed."""
        while len(self.lingering) > self.limits.lingering_cap:
            oldest = next(iter(self.lingering))
            del self.lingering[oldest]
            oldest.transport.abort()

    def _refuse(self, status: int, reason: str, label: str) -> None:
        """Answer *status* with *reason* (when no other answer is under way on this
        connection), then close; count it under *label*."""
        if self._done:
            return
        self._done = True
        for timer in (self._header_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._header_timer = self._body_timer = None
        metrics.get().http_refused.labels(label).inc()
        cycle = self.cycle
        answer = True
        in_body = label in ("body_timeout", "displaced_body", "trailers_too_large")
        if cycle is not None and cycle.response_complete and in_body:
            answer = False  # answered already (its route never read the body): just close
        elif cycle is not None and not cycle.response_complete:
            # A request is in flight: its handler sees a disconnect, its answer is dropped.
            # Only a request cut in its own body, with nothing sent yet, gets the refusal.
            answer = in_body and not cycle.response_started
            cycle.disconnected = True
            cycle.message_event.set()
        if self.transport.is_closing():
            return
        if not answer:
            self.transport.close()
            return
        retry = 1 if status == 503 else None
        self.transport.write(refusal(status, reason, retry_after=retry))
        self.flow.resume_reading()  # drain what still comes, unread, until the client goes
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self._linger = self.loop.call_later(LINGER_S, self.transport.close)
            self.lingering[self] = None
        else:
            self.transport.close()

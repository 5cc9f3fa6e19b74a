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
- keeps at most ``max_connections`` open: at the limit, a new connection displaces the
  oldest connection that is idle (keep-alive) or still sending its headers, so stalled
  clients cannot lock others out; only when every connection carries a request is the new
  one refused;
- answers every refusal of its own (400 malformed, 408, 431, 503) as one line of JSON,
  ``{"error": "..."}``, like the app's, with ``Connection: close``, then closes after
  the client has had a moment (``LINGER_S``) to read it: the write side is shut first and
  what still arrives is discarded, so the answer is not lost to a reset.

A refusal never reaches the app: the request is counted in ``kestrel_http_refused_total``
(by reason) instead of ``kestrel_http_requests_total``. When the client is cut off
mid-body, the app's handler sees a disconnect and its answer is dropped.

It relies on uvicorn's httptools protocol internals (``parser``, ``cycle``, ``flow``,
``connections``), as of uvicorn 0.30-0.54; httptools is a dependency of kestrel-runtime.
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

LINGER_S = 2.0
"""Seconds a refused connection stays half-open so that the client reads the answer."""


@dataclass(frozen=True, slots=True)
class DoorLimits:
    """What one connection may take: see the module docstring."""

    max_header_bytes: int
    header_timeout: float
    body_timeout: float
    max_connections: int

    @classmethod
    def of(cls, cfg: Config) -> DoorLimits:
        """The limits set by ``--http-max-header-bytes``, ``--http-header-timeout``,
        ``--http-body-timeout`` and ``--http-max-connections``."""
        return cls(max_header_bytes=cfg.http_max_header_bytes,
                   header_timeout=cfg.http_header_timeout,
                   body_timeout=cfg.http_body_timeout,
                   max_connections=cfg.http_max_connections)


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
    return type("GuardedProtocol", (GuardedProtocol,), {"limits": limits})


class _Refused(Exception):
    """Raised from a parser callback once the door has refused the request: it stops
    httptools from parsing the rest."""


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the door's deadlines and caps."""

    limits: DoorLimits

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._linger: asyncio.TimerHandle | None = None
        self._header_bytes = 0  # bytes received while the current headers are incomplete
        self._headers_seen = False  # a header block completed in the current read
        self._since = 0.0  # when it became idle or started sending headers (displacement)
        self._done = False  # the door refused or cut it: discard whatever still comes
        self._open = False

    # -- connection ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Start its header clock; over the connection limit, displace or refuse."""
        super().connection_made(transport)
        self._open = True
        metrics.get().http_connections.inc()
        self._start_headers()
        if len(self.connections) > self.limits.max_connections and not self._displace():
            self._refuse(503, "the server is at its connection limit; try again",
                         "connection_limit")

    def connection_lost(self, exc: Exception | None) -> None:
        """Stop its clocks."""
        for timer in (self._header_timer, self._body_timer, self._linger):
            if timer is not None:
                timer.cancel()
        self._header_timer = self._body_timer = self._linger = None
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
        self._body_timer = self.loop.call_later(self.limits.body_timeout, self._body_late)

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

    def _displace(self) -> bool:
        """Make room for this connection: close the oldest that is idle or still sending
        its headers (a refused one first). False when every other carries a request."""
        victim: GuardedProtocol | None = None
        for conn in self.connections:
            if conn is self or not isinstance(conn, GuardedProtocol):
                continue
            if conn._done:
                victim = conn
                break
            if (conn._header_timer is not None or conn._idle()) and (
                    victim is None or conn._since < victim._since):
                victim = conn
        if victim is None:
            return False
        if victim._done or victim._header_timer is None:
            victim.transport.close()  # idle: a client retries on a closed keep-alive
            if not victim._done:
                metrics.get().http_refused.labels("displaced").inc()
        else:
            victim._refuse(503, "the server is at its connection limit and this request's "
                           "headers were the slowest; try again", "displaced")
        self.connections.discard(victim)  # closing: it no longer takes a slot
        return True

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
        if cycle is not None and not cycle.response_complete:
            # A request is in flight: its handler sees a disconnect, its answer is dropped.
            # Only a request cut in its own body, with nothing sent yet, gets the refusal.
            answer = label == "body_timeout" and not cycle.response_started
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
        else:
            self.transport.close()

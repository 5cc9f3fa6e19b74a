"""Named queues with limits, declared in code (:func:`queue`) or with ``--queue-limits``.

* ``concurrency``: at most this many executions of the queue running at once across every
  process and host (enforced in the database under the queue's row lock).
* ``per_process``: at most this many at once in one worker process.
* ``per_key``: at most this many running at once per concurrency key
  (``submit(…, concurrency_key="svc-a")``), and the keys take turns: a key with ten
  thousand queued does not hold back a key with one. Executions submitted without a key
  share one key. Exact across processes and hosts, as ``concurrency`` is.
* ``rate`` per ``period`` seconds: at most ``rate`` claims in any window of ``period`` (an
  exact sliding window). Every claim counts, a wake-up's too.

A queue without limits needs no declaration and costs nothing: its claims never touch the
limits table.
"""

from __future__ import annotations

from dataclasses import dataclass

from kestrel.codec import QUEUE_NAME
from kestrel.errors import ConfigError


@dataclass(frozen=True, slots=True, kw_only=True)
class QueueSpec:
    """One queue's limits; None means no limit of that kind.

    Raises:
        ConfigError: the name or a limit is invalid, or only one of *rate* and *period* is set.
    """

    name: str
    concurrency: int | None = None
    per_process: int | None = None
    rate: int | None = None
    period: float | None = None
    per_key: int | None = None

    def __post_init__(self) -> None:
        if not QUEUE_NAME.fullmatch(self.name):
            raise ConfigError(f"invalid queue name {self.name!r}: 1-128 of A-Z a-z 0-9 _ . : -")
        for field in ("concurrency", "per_process", "rate", "per_key"):
            value = getattr(self, field)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"queue {self.name!r}: {field} must be a whole number, got "
                                  f"{value!r}")
            if value < 1:
                raise ConfigError(f"queue {self.name!r}: {field} must be at least 1")
            if value >= 2**31:
                raise ConfigError(f"queue {self.name!r}: {field} must be below 2^31")
        if (self.rate is None) != (self.period is None):
            raise ConfigError(f"queue {self.name!r}: rate and period go together")
        if self.period is not None and not self.period > 0:
            raise ConfigError(f"queue {self.name!r}: period must be positive seconds")

    @property
    def limited(self) -> bool:
        """Whether claims go one queue at a time through the queue's row (any limit)."""
        return (self.concurrency is not None or self.rate is not None
                or self.per_process is not None or self.per_key is not None)


_declared: dict[str, QueueSpec] = {}


def queue(name: str, *, concurrency: int | None = None, per_process: int | None = None,
          rate: int | None = None, period: float | None = None,
          per_key: int | None = None) -> QueueSpec:
    """Declare queue *name* and its limits (call at import time of your app module)."""
    spec = QueueSpec(name=name, concurrency=concurrency, per_process=per_process, rate=rate,
                     period=period, per_key=per_key)
    _declared[name] = spec
    return spec


def declared() -> dict[str, QueueSpec]:
    """Return the queues declared with :func:`queue`, by name (a copy)."""
    return dict(_declared)


def parse_limits(text: str) -> dict[str, QueueSpec]:
    """Parse ``--queue-limits``: ``ai:concurrency=5,rate=60/60,per_process=2;ci:concurrency=2``
    (rate is N/SECONDS; ``per_key=1`` limits each concurrency key).

    Raises:
        ConfigError: the text does not parse; the message shows the bad part.
    """
    specs: dict[str, QueueSpec] = {}
    for part in (p.strip() for p in text.split(";") if p.strip()):
        name, _, opts = part.partition(":")
        values: dict[str, float | int] = {}
        for opt in (o.strip() for o in opts.split(",") if o.strip()):
            key, _, raw = opt.partition("=")
            try:
                if key == "rate":
                    n, _, secs = raw.partition("/")
                    values["rate"], values["period"] = int(n), float(secs)
                elif key in ("concurrency", "per_process", "per_key"):
                    values[key] = int(raw)
                else:
                    raise ValueError(f"unknown limit {key!r}")
            except ValueError as exc:
                raise ConfigError(f"invalid setting --queue-limits: {part!r}: {exc} (use e.g. "
                                  "ai:concurrency=5,rate=60/60,per_process=2)") from None
        specs[name.strip()] = QueueSpec(name=name.strip(), **values)  # type: ignore[arg-type]
    return specs

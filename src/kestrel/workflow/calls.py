"""What a Context does through internal steps: a signal sent to another execution, an event
published, tags changed, a child started (and waited for), and the recorded
``now``/``random``/``uuid``.

Each is an ordinary step with a runtime-made body (``StepContext._internal``), so it replays
as a step does: its effect happens once, under the step's idempotency key, and every replay
returns the checkpointed value.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

import orjson

from kestrel import codec
from kestrel.definitions import WorkflowFn, current_step, workflow_name
from kestrel.errors import ChildFailed, ConfigError, LeaseLost
from kestrel.workflow.waits import Waits


@dataclass(frozen=True, slots=True)
class ChildHandle:
    """A child execution started by :meth:`Context.start_child`."""

    id: UUID
    workflow: str


class Calls(Waits):
    """What a Context records through internal steps: signals sent, events, children (and
    the wait for one), recorded ``now``/``random``/``uuid``."""

    async def signal(self, execution_id: UUID | str, name: str, payload: Any = None
                     ) -> None:
        """Send signal *name* to another execution, exactly once however often this replays."""
        codec.check_text(name, what="signal name")
        encoded = codec.encode(payload, what=f"payload of signal {name!r}",
                               max_bytes=self.max_payload_bytes)
        target = UUID(str(execution_id))

        async def send() -> bool:
            key = current_step().idempotency_key
            return await self.writer.send_signal(self.lease, target, name, encoded, key)

        await self._internal(f"kestrel.send_signal:{name}", send)

    # -- events -------------------------------------------------------------------------------

    async def set_event(self, key: str, value: Any) -> None:
        """Publish *value* under *key* for callers (``Client.get_event``).

        The step's checkpoint records ``{"value": value}``, so a fork rebuilds the events
        its copied history had published (``Client.fork``)."""
        codec.check_text(key, what="event key")
        encoded = codec.encode(value, what=f"event {key!r}", max_bytes=self.max_payload_bytes)

        async def put() -> dict[str, orjson.Fragment]:
            if not await self.writer.set_event(self.lease, key, encoded):
                raise LeaseLost(f"execution {self.execution_id} is no longer ours")
            return {"value": orjson.Fragment(encoded)}

        await self._internal(f"kestrel.set_event:{key}", put)

    # -- tags ---------------------------------------------------------------------------------

    async def set_tags(self, tags: Mapping[str, str | None] | None = None, /,
                       **more: str | None) -> None:
        """Change the execution's tags (``submit(..., tags=...)``; ``list --tag``):
        ``ctx.set_tags(stage="shipping")`` or ``ctx.set_tags({"customer": "acme"})``. Each
        tag given is set, or removed when its value is None; the others stay.

        Checked before anything is sent (:func:`kestrel.codec.check_tags`); past 32 tags
        together with those the execution has, the database refuses the change and the
        step fails (``StepFailed``, the tags unchanged). Recorded as a step: a replay does
        not send it again, and a re-run after a crash sets the same tags again.

        Raises:
            ConfigError: not a mapping, more than 32 changes, or a bad tag name.
            SerializationError: a value that is not text (or None), is empty, longer than
                256 characters, or holds NUL or a lone surrogate.
        """
        if tags is not None and not isinstance(tags, Mapping):
            raise ConfigError(f"tags must be a dict of names to text, got "
                              f"{type(tags).__name__}")
        changes = codec.check_tags({**(tags or {}), **more}, removals=True)
        encoded = codec.encode(changes, what="tags")

        async def put() -> dict[str, orjson.Fragment]:
            if not await self.writer.set_tags(self.lease, encoded):
                raise LeaseLost(f"execution {self.execution_id} is no longer ours")
            return {"tags": orjson.Fragment(encoded)}

        await self._internal("kestrel.set_tags", put)

    # -- children -----------------------------------------------------------------------------

    async def start_child(self, wf: WorkflowFn | str, *args: Any, queue: str = "default",
                          priority: int = 0, timeout: float | None = None) -> ChildHandle:
        """Start a child execution, exactly once however often this workflow replays."""
        name = codec.check_text(workflow_name(wf), what="child workflow name")
        encoded = codec.encode(list(args), what=f"arguments of child workflow {name!r}",
                               max_bytes=self.max_payload_bytes)

        async def start() -> str:
            key = "kestrel.child:" + current_step().idempotency_key
            child = await self.writer.submit_child(
                self.lease, workflow=name, args=encoded, queue=queue, priority=priority,
                key=key, timeout_s=timeout)
            return str(child)

        child_id = await self._internal(f"kestrel.start_child:{name}", start)
        return ChildHandle(UUID(child_id), name)

    async def wait_child(self, child: ChildHandle) -> Any:
        """Wait durably for *child* to finish; return its result.

        Raises:
            ChildFailed: the child ended failed, cancelled or quarantined.
        """
        got = await self.wait_for_signal(f"kestrel.child:{child.id}")
        outcome = got.payload or {}
        if outcome.get("status") != "completed":
            raise ChildFailed(child.id, str(outcome.get("status")), outcome.get("error"))
        return outcome.get("result")

    async def child(self, wf: WorkflowFn | str, *args: Any, queue: str = "default",
                    priority: int = 0, timeout: float | None = None) -> Any:
        """Start a child execution and wait for its result (:meth:`start_child` +
        :meth:`wait_child`)."""
        handle = await self.start_child(wf, *args, queue=queue, priority=priority,
                                        timeout=timeout)
        return await self.wait_child(handle)

    # -- deterministic helpers ----------------------------------------------------------------

    async def now(self) -> datetime:
        """The current time by the database clock, recorded: a replay returns the same
        instant. It is the claim's database time plus the monotonic time since, so a
        worker's skewed or jumping wall clock does not leak in and it costs no round trip."""

        async def read() -> str:
            return self._db_now().isoformat()

        return datetime.fromisoformat(await self._internal("kestrel.now", read))

    async def random(self) -> float:
        """A random float in [0, 1), recorded: a replay returns the same number."""

        async def draw() -> float:
            return random.random()

        return float(await self._internal("kestrel.random", draw))

    async def uuid(self) -> UUID:
        """A random UUID, recorded: a replay returns the same one."""

        async def make() -> str:
            return str(uuid.uuid4())

        return UUID(await self._internal("kestrel.uuid", make))

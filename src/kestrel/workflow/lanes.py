"""Parallel calls inside one workflow: which asyncio task made each call, and the rules that
keep step positions a function of the workflow's code (README, "Parallel steps").

A call takes its position the moment it is made (``StepContext._take_position``), so calls
started together (``asyncio.gather``, ``TaskGroup``) are numbered in the order the code
starts them: each task runs to its first call before the next task starts. What comes after
a call *returned* is ordered by when it returned, which is timing, not code, whenever other
calls are in flight. So the calls are tracked per task, a *lane*: the task that runs the
workflow function is the root lane and may make any calls; any other task that makes a
call is a branch and:

- makes one call (a second would come after the first returned);
- is refused if the task that made it has made another call since, or if a call of the
  branch above it has returned: either way its place among the others would be timing.

Refused calls raise :class:`~kestrel.errors.ConcurrentCallError` before they take a
position, the same way on the first run and on every replay.

Waits in parallel: a wait that must park the execution first waits until no other call is
in flight but waits that would park too, and the first of those (by position) parks; the
others are asked again after the wake-up, so parallel waits park one after the other, each
at its own position. Whatever way the workflow function ends, branches still running are
cancelled and awaited (``asyncio.gather`` leaves the others running when one fails), so no
branch writes after the end.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any


class Unwind(BaseException):
    """What the runtime raises to end a workflow's run where it is (a park, the end of a
    read-only replay's history). A BaseException, so that workflow code cannot swallow it;
    :meth:`Lanes.run` takes it out of the exception group a TaskGroup wraps it in."""


@dataclass(eq=False, slots=True)
class Lane:
    """The kestrel calls of one asyncio task of a workflow: the root lane (the task that
    runs the workflow function), or a branch made by *parent*."""

    task: asyncio.Task[Any] | None
    parent: Lane | None
    calls: int = 0
    # A call of this branch has returned: what it does next depends on when that happened.
    returned: bool = False


# The running task's lane, whose context it is, and how many calls the lane had made when
# this value was set: a task made later inherits it, which is how a branch knows its parent
# and whether the parent went on after making it.
_LANE: contextvars.ContextVar[tuple[object, Lane, int] | None] = contextvars.ContextVar(
    "kestrel_lane", default=None)


class Lanes:
    """The lanes of one run of a workflow, its calls in flight and its parallel waits."""

    __slots__ = ("_branches", "_changed", "_parking", "_root", "in_flight")

    def __init__(self) -> None:
        self._root: Lane | None = None
        self.in_flight = 0  # calls between their position and their return
        self._branches: list[asyncio.Task[Any]] = []
        self._parking: set[int] = set()  # positions of waits waiting to park
        self._changed: asyncio.Future[None] | None = None  # set at each change of those

    async def run(self, owner: object, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Run ``fn(owner, *args)`` in this task, the root lane; whatever way it ends, stop
        the branches it left running, and unwrap an :class:`Unwind` from a TaskGroup's
        exception group."""
        self._root = root = Lane(asyncio.current_task(), None)
        token = _LANE.set((owner, root, 0))
        try:
            return await fn(owner, *args)
        except BaseExceptionGroup as group:
            unwound, _ = group.split(Unwind)
            first: BaseException | None = unwound
            while isinstance(first, BaseExceptionGroup):
                first = first.exceptions[0]
            if first is not None:
                raise first from None
            raise
        finally:
            _LANE.reset(token)
            await self.stop_branches()

    async def stop_branches(self) -> None:
        """Cancel the branches still running and wait until they have stopped."""
        left = [t for t in self._branches if not t.done()]
        self._branches.clear()
        for task in left:
            task.cancel()
        if left:
            await asyncio.wait(left)

    def enter(self, owner: object) -> str | None:
        """Count a call in, in its task's lane; or say why it is refused (nothing counted)."""
        got = _LANE.get()
        task = asyncio.current_task()
        if got is None or got[0] is not owner:
            # A call outside run() (a context driven by hand): one lane.
            if self._root is None:
                self._root = Lane(task, None)
            got = (owner, self._root, self._root.calls)
        lane, seen = got[1], got[2]
        if lane.task is not task:
            parent = lane
            if parent.calls != seen:
                return ("a branch (asyncio task) made its first call after the task that "
                        "started it had made another")
            above: Lane | None = parent
            while above is not None and above.parent is not None:
                if above.returned:
                    return ("a branch started after a call of the branch above it had "
                            "returned made a call")
                above = above.parent
            lane = Lane(task, parent)
            if task is not None:
                self._branches.append(task)
        elif lane.parent is not None and lane.returned:
            return ("a branch (asyncio task) made a second call; its place would depend on "
                    "when its first returned")
        lane.calls += 1
        self.in_flight += 1
        _LANE.set((owner, lane, lane.calls))
        return None

    def leave(self, owner: object) -> None:
        """Count a call out: its lane has had its result."""
        self.in_flight -= 1
        got = _LANE.get()
        if got is not None and got[0] is owner:
            got[1].returned = True
        self._notify()

    def _notify(self) -> None:
        changed, self._changed = self._changed, None
        if changed is not None and not changed.done():
            changed.set_result(None)

    async def quiet_to_park(self, position: int) -> None:
        """Before the wait at *position* parks the execution: wait until no other call is
        in flight but waits that would park too, and this one is the first of those."""
        self._parking.add(position)
        self._notify()
        try:
            while self.in_flight > len(self._parking) or min(self._parking) != position:
                if self._changed is None:
                    self._changed = asyncio.get_running_loop().create_future()
                await self._changed
        finally:
            self._parking.discard(position)
            self._notify()

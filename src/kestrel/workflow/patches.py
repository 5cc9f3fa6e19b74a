"""Patches: how a Context versions a change of workflow code with markers.

``ctx.patched(id)`` answers whether this execution takes the new path: True when it reaches
the point under code that has the patch (a marker is checkpointed at a negative id, outside
the numbering of steps, with the position it was asked at), False when its history went past
that point before the change. The markers a history holds and the check that this code knows
each of them (:class:`~kestrel.errors.CodeTooOld` otherwise) are part of every position's
checks, in :mod:`kestrel.workflow.steps`.
"""

from __future__ import annotations

from kestrel import codec
from kestrel.errors import NonDeterminismError
from kestrel.workflow.steps import PATCH_STEP, StepContext


class Patches(StepContext):
    """A Context's patch markers: ``patched`` and ``deprecate_patch``."""

    async def patched(self, patch_id: str) -> bool:
        """Whether this execution takes the new code path of change *patch_id*.

        True for an execution that reaches this point under code that has the patch: a
        marker is checkpointed (before this returns), so every replay answers True again.
        False for an execution that passed this point before the change (its history goes
        beyond here with no marker): it replays the old path it recorded. The answer for one
        id is the same for the whole execution, however often it is asked. Markers take no
        step position, so the steps after a patch keep their numbers, and removing the patch
        later (once no execution needs the old path: ``kestrel-runtime patches``) is safe.

        Raises:
            SerializationError: *patch_id* is not 1-1024 characters of storable text (no
                NUL, no lone surrogate, at most 2048 bytes of UTF-8); nothing is written.
        """
        codec.check_text(patch_id, what="patch id")
        return await self._patch(patch_id)

    async def deprecate_patch(self, patch_id: str) -> None:
        """Mark where the old path of *patch_id* was removed (the code keeps only the new one).

        Records the marker like :meth:`patched` (so code that still asks ``patched`` — a
        rollback — takes the new path for executions started here) and checks that this
        execution did not need the old path.

        Raises:
            SerializationError: *patch_id* is not storable text (see :meth:`patched`).
            NonDeterminismError: this execution passed this point before the change: the old
                path was removed while it still needed it.
        """
        codec.check_text(patch_id, what="patch id")
        if not await self._patch(patch_id):
            self._decide(NonDeterminismError(
                f"execution {self.execution_id} of workflow {self.workflow!r} passed patch "
                f"{patch_id!r} before the change and needs the old code path, which this "
                f"code removed (deprecate_patch); restore `if ctx.patched({patch_id!r})` until "
                f"`kestrel-runtime list --without-patch {patch_id}` shows no live executions"))

    async def _patch(self, patch_id: str) -> bool:
        if self.decision is not None:
            raise self.decision
        known = self._patches.get(patch_id)
        if known is not None:
            return known
        name = PATCH_STEP + patch_id
        if any(k < 0 and r.name == name for k, r in self.claimed.steps.items()):
            self._patches[patch_id] = True
            return True
        position = self._next_step
        if self._recorded_upto >= position:
            # Recorded before the change: the old path is what this history holds.
            self._patches[patch_id] = False
            return False
        self._check_can_start()
        # No new marker beside one this code does not know (also at this same position,
        # though this code might ask about it next): a marker written here would be one the
        # newer code does not know either, and neither version could go on.
        unknown = self._unknown_patches(position)
        if unknown:
            self._too_old(unknown, f"asked about patch {patch_id!r} at position {position}")
        marker = self._next_marker
        self._next_marker -= 1
        await self._record(marker, name, codec.encode({"at": position}, what="patch marker"),
                           None, 1, 0.0)
        self._patches[patch_id] = True
        return True

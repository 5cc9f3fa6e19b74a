"""Workflows, steps and the replay context: what a workflow author imports.

A workflow is an ``async def`` taking a :class:`Context` and its JSON arguments. Each
``await ctx.step(fn, *args)`` is numbered in call order. When a step already has a checkpoint
the recorded output is returned (or its recorded error raised) without running the body; when
it has none the body runs, its output is encoded and checkpointed, and the workflow goes on
only after that checkpoint has committed. Whatever the live run got back is exactly what every
replay gets back, because both read the stored value.

This module is the public face: the declarations (``@workflow``, ``@step``, the registry:
:mod:`kestrel.definitions`) and :class:`Context`, put together from its parts, each in a
module of its own:

- :mod:`kestrel.workflow.steps`: the Context's state, the step path (replay or run and
  record), sticky decisions, the checks every unrecorded position gets, the ``Writer`` port
  and ``HistoryEnd``;
- :mod:`kestrel.workflow.waits`: durable sleeps and signal waits, parking (``Park``),
  ``Signal``;
- :mod:`kestrel.workflow.patches`: ``patched`` and ``deprecate_patch``;
- :mod:`kestrel.workflow.calls`: signals sent, events, children (``ChildHandle``), recorded
  ``now``/``random``/``uuid``.
"""

from __future__ import annotations

# Re-exported (``X as X``): the declarations live in kestrel.definitions.
from kestrel.definitions import (
    P as P,
)
from kestrel.definitions import (
    RetryPolicy as RetryPolicy,
)
from kestrel.definitions import (
    StepInfo as StepInfo,
)
from kestrel.definitions import (
    StepSpec as StepSpec,
)
from kestrel.definitions import (
    T as T,
)
from kestrel.definitions import (
    W as W,
)
from kestrel.definitions import (
    WorkflowFn as WorkflowFn,
)
from kestrel.definitions import (
    _current_step as _current_step,
)
from kestrel.definitions import (
    _registry as _registry,
)
from kestrel.definitions import (
    _spec as _spec,
)
from kestrel.definitions import (
    current_step as current_step,
)
from kestrel.definitions import (
    describe_error as describe_error,
)
from kestrel.definitions import (
    registry as registry,
)
from kestrel.definitions import (
    step as step,
)
from kestrel.definitions import (
    workflow as workflow,
)
from kestrel.definitions import (
    workflow_name as workflow_name,
)
from kestrel.workflow.calls import Calls
from kestrel.workflow.calls import ChildHandle as ChildHandle
from kestrel.workflow.patches import Patches
from kestrel.workflow.waits import Signal as Signal


class Context(Calls, Patches):
    """Handed to every workflow: run steps, wait durably, talk to other executions.

    Every method that returns something a replay must see again (step outputs, signals,
    ``now``/``random``/``uuid``, child ids) is checkpointed at the next step position.
    """

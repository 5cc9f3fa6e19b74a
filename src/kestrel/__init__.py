"""kestrel: durable workflows for Python, with PostgreSQL as the orchestrator."""

from kestrel.client import Client, Handle, SyncClient, SyncHandle
from kestrel.config import Config
from kestrel.errors import (
    ConfigError,
    ExecutionNotFound,
    IdempotencyConflict,
    KestrelError,
    LeaseLost,
    MigrationError,
    NonDeterminismError,
    PayloadTooLarge,
    SerializationError,
    StepFailed,
    UnknownWorkflow,
    WorkflowFailed,
)
from kestrel.types import Execution, Status, StepRow
from kestrel.workflow import Context, RetryPolicy, StepInfo, current_step, step, workflow

__all__ = [
    "Client",
    "Config",
    "ConfigError",
    "Context",
    "Execution",
    "ExecutionNotFound",
    "Handle",
    "IdempotencyConflict",
    "KestrelError",
    "LeaseLost",
    "MigrationError",
    "NonDeterminismError",
    "PayloadTooLarge",
    "RetryPolicy",
    "SerializationError",
    "Status",
    "StepFailed",
    "StepInfo",
    "StepRow",
    "SyncClient",
    "SyncHandle",
    "UnknownWorkflow",
    "WorkflowFailed",
    "current_step",
    "step",
    "workflow",
]

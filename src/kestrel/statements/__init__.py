"""Every named statement of ``sql/queries``, as a typed builder: one module per file.

``sql/queries/<file>.sql`` holds the text under ``-- name:`` headers and
``kestrel/statements/<file>.py`` the builders that give each its parameters and decode its
rows into a result (:class:`Stmt`, or a :data:`Script` of several in one transaction). No
builder executes anything: :mod:`kestrel.db` runs them (``db.run(conn, stmt)``), so the
worker, both clients, the HTTP door, the CLI and the test kit share one definition of each.
Callers write ``statements.<file>.<name>(q, ...)``.
"""

from kestrel.statements import (
    client,
    executions,
    history,
    http,
    migrate,
    notify,
    queues,
    steps,
    sweeper,
    testing,
    ui,
    versions,
    waits,
)
from kestrel.statements.stmt import Script, Stmt, command, value

__all__ = ["Script", "Stmt", "client", "command", "executions", "history", "http", "migrate",
           "notify", "queues", "steps", "sweeper", "testing", "ui", "value", "versions",
           "waits"]

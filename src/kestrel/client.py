"""Submit executions and talk to them: :class:`Client` (async) and :class:`SyncClient`.

``submit`` calls the SQL function ``<schema>.submit`` in one statement. Pass ``conn=`` to run
it (or ``signal``, ``cancel``, ``retry``) inside your own psycopg transaction: it then
commits or rolls back with your data. Without ``conn`` it commits before the call returns.
``signal``, ``cancel``, ``retry`` and ``fork`` call the SQL functions of the same names, so
SQL, the CLI and Python behave alike. ``result`` and ``get_event`` wait on LISTEN/NOTIFY
with a polling fallback.

:class:`Client` (:mod:`kestrel.client_async`) is the one hand-written client;
:class:`SyncClient` (:mod:`kestrel.client_sync`) is generated from it.
"""

from __future__ import annotations

from kestrel._client_common import MAX_SECONDS, POLL_CAP_S, ClientBase
from kestrel.client_async import Client, Handle
from kestrel.client_sync import SyncClient, SyncHandle

__all__ = ["MAX_SECONDS", "POLL_CAP_S", "Client", "ClientBase", "Handle", "SyncClient",
           "SyncHandle"]

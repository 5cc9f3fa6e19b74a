"""P3: which database errors are retried until the database answers (FAULTS P3).

Only connection-level failures are transient. An error the server raised for a statement it
ran would most likely repeat identically, so retrying it for ever stalls the queue behind it
(the code before this fix treated every OperationalError subclass as transient, and
ProgramLimitExceeded, OutOfMemory, DiskFull and QueryCanceled are all OperationalErrors).
"""

from __future__ import annotations

import psycopg
from psycopg import errors
from psycopg_pool import PoolTimeout

from kestrel.db import is_transient

TRANSIENT = [
    psycopg.OperationalError("server closed the connection unexpectedly"),  # no SQLSTATE
    errors.ConnectionException(),  # 08000
    errors.ConnectionFailure(),  # 08006
    errors.SqlclientUnableToEstablishSqlconnection(),  # 08001
    errors.AdminShutdown(),  # 57P01
    errors.CrashShutdown(),  # 57P02
    errors.CannotConnectNow(),  # 57P03
    psycopg.InterfaceError("the connection is closed"),
    ConnectionResetError("reset by peer"),
    OSError("network is unreachable"),
    PoolTimeout("couldn't get a connection after 30.00 sec"),
]

NOT_TRANSIENT = [
    errors.ProgramLimitExceeded(),  # 54000: e.g. a history over jsonb's 256 MB
    errors.OutOfMemory(),  # 53200
    errors.DiskFull(),  # 53100
    errors.QueryCanceled(),  # 57014: statement_timeout
    errors.StringDataRightTruncation(),  # 22001
    errors.UntranslatableCharacter(),  # 22P05
    psycopg.DataError("PostgreSQL text fields cannot contain NUL (0x00) bytes"),
    errors.UniqueViolation(),  # 23505
    ValueError("a bug"),
]


def test_only_connection_level_errors_are_transient() -> None:
    table = [(exc, True) for exc in TRANSIENT] + [(exc, False) for exc in NOT_TRANSIENT]
    wrong = [f"{type(exc).__name__}({getattr(exc, 'sqlstate', None)}): expected "
             f"{'transient' if expected else 'not transient'}"
             for exc, expected in table if is_transient(exc) is not expected]
    assert wrong == []

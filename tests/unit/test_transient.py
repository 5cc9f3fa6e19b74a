"""P3: which database errors are retried until the database answers (FAULTS P3).

Only connection-level failures are transient (the database is unreachable: wait as long as
it takes). An error the server raised for a statement it ran is not: ProgramLimitExceeded,
OutOfMemory and QueryCanceled are OperationalErrors, and treating them all as transient
retried a value that can never be stored for ever. Contention (issue 22) is its own class,
retried while the leases hold: a lock or statement timeout, a deadlock, a serialization
failure, too many connections, a full disk.
"""

from __future__ import annotations

import psycopg
from psycopg import errors
from psycopg_pool import PoolTimeout

from kestrel.connections import is_transient

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
    errors.DiskFull(),  # 53100 (contended: retried, see below)
    errors.QueryCanceled(),  # 57014: statement_timeout (contended: retried, see below)
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


CONTENDED = [
    errors.LockNotAvailable(),  # 55P03: lock_timeout (FAULTS D10, O4, O6)
    errors.QueryCanceled(),  # 57014: statement_timeout
    errors.DeadlockDetected(),  # 40P01
    errors.SerializationFailure(),  # 40001
    errors.TooManyConnections(),  # 53300
    errors.DiskFull(),  # 53100: writes resume once space is freed (D13)
]


def test_contention_is_retried_and_a_refused_value_never_is() -> None:
    """Issue 22: contention is sent again unchanged (the group commit retries the whole
    batch); data errors and program limits are isolated and never retried; a pool timeout
    is told apart from the database being unreachable (FAULTS R3)."""
    from kestrel.connections import is_contended, is_data_error, is_pool_timeout

    assert [type(e).__name__ for e in CONTENDED if not is_contended(e)] == []
    assert [type(e).__name__ for e in CONTENDED if is_transient(e) or is_data_error(e)] == []
    never = [errors.ProgramLimitExceeded(), errors.StringDataRightTruncation(),
             errors.UntranslatableCharacter(), errors.UniqueViolation(), ValueError("a bug"),
             psycopg.OperationalError("server closed the connection unexpectedly"),
             PoolTimeout("couldn't get a connection after 2.00 sec")]
    assert [type(e).__name__ for e in never if is_contended(e)] == []
    assert is_pool_timeout(PoolTimeout("couldn't get a connection after 2.00 sec"))
    assert not is_pool_timeout(psycopg.OperationalError("connection refused"))

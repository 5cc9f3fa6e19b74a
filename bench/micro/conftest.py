"""The micro-benchmarks use the test suite's PostgreSQL and per-test schema fixtures."""

from tests.conftest import direct_dsn, pg_dsn, schema  # noqa: F401  (fixtures, re-exported)

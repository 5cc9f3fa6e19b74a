#!/usr/bin/env bash
# `make test`: the whole suite directly (tests, bench/micro), then tests/integration again
# through a real PgBouncer (KESTREL_TEST_VIA=pgbouncer). Each pass starts its own PostgreSQL
# and PgBouncer in a --basetemp of its own.
#
# TEST_PARALLEL=1 runs the two passes at once (about 30 minutes instead of 45 on 2 cores:
# most of the suite waits on processes, timers and the database). It is not the default
# yet: on 2 cores two of its tests failed in each of two such runs, and both causes are
# fixed since (a 6 × 16 MiB hook-budget race; the demo's Ctrl-C, ignored in the pass run in
# the background: a background job of a non-interactive shell starts with SIGINT ignored).
# With KESTREL_TEST_DSN (your server, shared by both) the passes always run one after the
# other: some tests read server-wide views (pg_stat_activity) that the other pass's tests
# on the same server would confuse.
set -uo pipefail
bin=${BIN:-.venv/bin}
root=${TMPDIR:-/tmp}/kestrel-tests-$$
direct=("$bin/pytest" -q --durations=25 --benchmark-disable --ignore=tests/citus --basetemp="$root/direct"
        tests bench/micro)
bouncer=("$bin/pytest" -q --durations=25 --basetemp="$root/pgbouncer" tests/integration)
mkdir -p "$root"
trap 'rm -rf "$root"' EXIT

if [ -n "${KESTREL_TEST_DSN:-}" ] || [ "${TEST_PARALLEL:-0}" != 1 ]; then
    "${direct[@]}"
    first_rc=$?
    echo "== tests/integration through PgBouncer"
    KESTREL_TEST_VIA=pgbouncer "${bouncer[@]}"
    second_rc=$?
else
    log="$root/pgbouncer.log"
    KESTREL_TEST_VIA=pgbouncer "${bouncer[@]}" >"$log" 2>&1 &
    second=$!
    # Ctrl-C or a kill of make stops both.
    trap 'kill "$second" 2>/dev/null; wait "$second" 2>/dev/null; rm -rf "$root"' EXIT
    echo "== the suite, directly (the PgBouncer pass runs alongside; its output follows)"
    "${direct[@]}"
    first_rc=$?
    wait "$second"
    second_rc=$?
    echo "== tests/integration through PgBouncer"
    cat "$log"
fi
if [ "$first_rc" -ne 0 ] || [ "$second_rc" -ne 0 ]; then
    echo "make test: direct pass exit $first_rc, PgBouncer pass exit $second_rc" >&2
    exit 1
fi

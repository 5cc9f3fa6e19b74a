#!/usr/bin/env bash
# `make test`: the whole suite directly (tests, bench/micro) and tests/integration again
# through a real PgBouncer (KESTREL_TEST_VIA=pgbouncer), the two passes at once, each spread
# over TEST_WORKERS pytest-xdist workers (default 2; files stay whole on one worker). Each
# worker of each pass starts its own PostgreSQL and PgBouncer in a --basetemp of its own.
#
# On 2 cores: about 18 minutes, against about 65 for the passes one after the other in one
# process each (most of the suite waits on processes, timers and the database). Measured in
# BENCHMARKS.md ("The test suite's wall time").
#
# TEST_PARALLEL=0 runs the passes one after the other; TEST_WORKERS=1 runs each pass in one
# process. With KESTREL_TEST_DSN (your server, shared by everything) both are forced: some
# tests read server-wide views (pg_stat_activity) that tests running beside them on the same
# server would confuse.
set -uo pipefail
bin=${BIN:-.venv/bin}
root=${TMPDIR:-/tmp}/kestrel-tests-$$
workers=${TEST_WORKERS:-2}
parallel=${TEST_PARALLEL:-1}
if [ -n "${KESTREL_TEST_DSN:-}" ]; then
    workers=1
    parallel=0
fi
spread=()
if [ "$workers" -gt 1 ]; then
    spread=(-n "$workers" --dist loadfile)
fi
direct=("$bin/pytest" -q --durations=25 "${spread[@]}" --benchmark-disable --ignore=tests/citus
        --basetemp="$root/direct" tests bench/micro)
bouncer=("$bin/pytest" -q --durations=25 "${spread[@]}" --basetemp="$root/pgbouncer"
         tests/integration)
mkdir -p "$root"
trap 'rm -rf "$root"' EXIT

if [ "$parallel" != 1 ]; then
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

#!/usr/bin/env bash
# `make test`: the whole suite directly (tests, bench/micro), and tests/integration again
# through a real PgBouncer (KESTREL_TEST_VIA=pgbouncer). Each pass starts its own PostgreSQL
# and PgBouncer, so the two run at once: most of the suite waits on real processes, timers
# and the database rather than on the CPU (the direct pass alone kept a 2-core machine at a
# load under 1), and CI's time halves. The PgBouncer pass prints when it ends, whole.
#
# Given KESTREL_TEST_DSN (your server, shared by both passes) or TEST_SERIAL=1, they run one
# after the other: some tests read server-wide views (pg_stat_activity) that another
# session's tests on the same server would confuse.
set -uo pipefail
bin=${BIN:-.venv/bin}
root=${TMPDIR:-/tmp}/kestrel-tests-$$
direct=("$bin/pytest" -q --benchmark-disable --ignore=tests/citus --basetemp="$root/direct"
        tests bench/micro)
bouncer=("$bin/pytest" -q --basetemp="$root/pgbouncer" tests/integration)
mkdir -p "$root"
trap 'rm -rf "$root"' EXIT

if [ -n "${KESTREL_TEST_DSN:-}" ] || [ "${TEST_SERIAL:-0}" = 1 ]; then
    "${direct[@]}" && KESTREL_TEST_VIA=pgbouncer "${bouncer[@]}"
    exit
fi

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
if [ "$first_rc" -ne 0 ] || [ "$second_rc" -ne 0 ]; then
    echo "make test: direct pass exit $first_rc, PgBouncer pass exit $second_rc" >&2
    exit 1
fi

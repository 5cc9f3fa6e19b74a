#!/usr/bin/env bash
# Does every dependency of kestrel-runtime install on CPython 3.11-3.13, x86_64 and aarch64?
# Downloads (never installs) with pip's --platform/--python-version; needs PyPI. README
# "Install" records what it printed. Usage: tools/pip_download_matrix.sh [PIP]
set -uo pipefail
PIP=${1:-pip}
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
CORE="psycopg>=3.2 psycopg-pool>=3.2 orjson>=3.10 uvloop>=0.19 prometheus-client>=0.20 cronsim>=2.8 starlette>=0.40 uvicorn>=0.30 httptools>=0.6 python-multipart>=0.0.9 jinja2>=3.1"
for plat in manylinux2014_x86_64 manylinux2014_aarch64; do
  for py in 3.11 3.12 3.13; do
    d=$OUT/$plat-$py
    if $PIP download -q --only-binary=:all: --platform "$plat" --python-version "$py" \
        -d "$d" $CORE psycopg-binary >/dev/null 2>"$d.err"; then
      echo "$plat py$py core: OK ($(ls "$d" | wc -l) wheels)"
    else
      echo "$plat py$py core: FAIL $(grep ERROR "$d.err" | head -1)"
    fi
    if $PIP download -q --only-binary=:all: --no-deps --platform "$plat" --python-version "$py" \
        -d "$d-emb" "pgserver>=0.1.4" >/dev/null 2>"$d-emb.err"; then
      echo "$plat py$py embedded extra (pgserver): OK"
    else
      echo "$plat py$py embedded extra (pgserver): none"
    fi
  done
done
if $PIP download -q --no-deps --no-binary=:all: -d "$OUT/sdist" psycopg-c >/dev/null 2>&1; then
  echo "psycopg-c (the C part of psycopg[c]): sdist $(ls "$OUT/sdist")"
else
  echo "psycopg-c: no sdist"
fi

# kestrel-runtime developer targets. `make help` lists them.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: help venv run test test-citus test-fast soak bench-soak bench-micro lint typecheck check clean unasync

help: ## list targets
	@grep -E '^[a-z/-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,embedded]'
	touch $(STAMP)

venv: $(STAMP) ## create .venv and install kestrel with its dev tools

run: $(STAMP) ## the main job: the runtime on an embedded PostgreSQL with the demo workload
	$(BIN)/kestrel-runtime demo

test: $(STAMP) ## the whole suite (starts its own PostgreSQL), then again through PgBouncer
	$(BIN)/pytest -q --benchmark-disable --ignore=tests/citus tests bench/micro
	KESTREL_TEST_VIA=pgbouncer $(BIN)/pytest -q tests/integration

test-citus: $(STAMP) ## the Citus tier on a running cluster (KESTREL_CITUS_DSN; /work/shared/citus/cluster.sh up)
	$(BIN)/pytest -q tests/citus

SOAK_MINUTES ?= 30

soak: $(STAMP) ## faults at length (~60 min): Hypothesis soak profiles (~30 min), then SOAK_MINUTES (30) of the nemesis with the ledger audit
	KESTREL_HYPOTHESIS_PROFILE=soak $(BIN)/pytest -q --timeout=5400 tests/property
	$(BIN)/python -m tests.chaos.soak --minutes $(SOAK_MINUTES) --out .soak

bench-soak: $(STAMP) ## a million workflows through the runtime: hot tables stay flat (BENCHMARKS.md)
	$(BIN)/python -m bench.soak --workflows 1000000

bench-micro: $(STAMP) ## pytest-benchmark micro-benchmarks of the hot path, timed
	$(BIN)/pytest -q bench/micro --benchmark-columns=mean,median,ops

test-fast: $(STAMP) ## unit tests only, no database
	$(BIN)/pytest -q tests/unit

lint: $(STAMP) ## ruff
	$(BIN)/ruff check src tests bench tools

unasync: $(STAMP) ## regenerate the sync client (client_sync.py) from the async one
	$(BIN)/python tools/unasync.py

typecheck: $(STAMP) ## mypy --strict on src
	$(BIN)/mypy

check: lint typecheck test-fast ## lint + typecheck + unit tests

clean: ## remove the virtualenv and the embedded database
	rm -rf $(VENV) .kestrel

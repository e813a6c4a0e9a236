# `make run`: set up .venv, generate the demo model once, start the control plane, ENGINES engines on it and
# the router in front of them (the OpenAI API on PORT).
# `make test`: set up .venv, lint, run the tests.
# Both install the engine extra (torch, the engine) and the test tools: `pip install -e ".[engine,test]"`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_DIR ?= .demo/model
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: run run-engine test lint venv bench bench-peer clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "torch==2.13.0"
	$(BIN)/python -m pip install --quiet -e ".[engine,test]"
	touch $(STAMP)

venv: $(STAMP)

$(DEMO_DIR)/config.json: $(STAMP)
	$(BIN)/loraplane demo-model $(DEMO_DIR)

CONTROL_PORT ?= 8080
ENGINE_PORT ?= 8100
ENGINES ?= 1
# REQUIRE_API_KEY=1: tenancy on (loraplane up --require-api-key): the router requires keys, a Redis is
# started for the quotas (LORAPLANE_REDIS_URL: use that one instead), tenant default's key in .loraplane/tenant-key
REQUIRE_API_KEY ?=

# the whole stack: the router (the OpenAI API) on PORT, the control plane (SQLite under .loraplane/) on
# CONTROL_PORT, ENGINES engines on ENGINE_PORT and up registered with it, the demo model and its 3
# adapters (written on first run) loaded through it
run: $(STAMP)
	$(BIN)/loraplane up --demo-dir $(DEMO_DIR) --host $(HOST) --router-port $(PORT) --port $(CONTROL_PORT) \
		--engine-port $(ENGINE_PORT) --engines $(ENGINES) $(if $(REQUIRE_API_KEY),--require-api-key)

# just the engine, serving the demo model and its adapters without a control plane
run-engine: $(STAMP) $(DEMO_DIR)/config.json
	$(BIN)/loraplane engine --model $(DEMO_DIR) --served-model-name demo --host $(HOST) --port $(PORT) \
		--enable-lora --lora-modules $(foreach a,demo-pirate demo-poet demo-short,$(a)=$(DEMO_DIR)/adapters/$(a))

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/pylint control_plane data_plane shared
	$(BIN)/mypy

# The tests run on TEST_WORKERS processes (pytest-xdist), a test module per unit (tests/conftest.py): most
# of the suite waits on servers it started (run one at a time it kept 0.8 of 2 CPUs busy), so two
# workers on 2 CPUs took 555 s where one took 966 s. TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2

# pylint's duplicate-code pass and mypy (about 3 min of one CPU on a clean clone) run beside the tests,
# in the CPU time the tests leave while they wait on their servers; their output follows the tests'.
# vLLM's CPU build in its own venv (bench/vllm_venv.py: .peer-venv/, or LORAPLANE_VLLM_VENV) for the tests
# against a real vLLM (tests/e2e/test_vllm_agent.py): made once (minutes), then found by its marker. Where it
# cannot be made, CI fails here; elsewhere those tests skip.
test: $(STAMP)
	$(BIN)/python bench/vllm_venv.py || test -z "$$CI"
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	@mkdir -p .loraplane
	@( $(BIN)/pylint control_plane data_plane shared; p=$$?; $(BIN)/mypy; m=$$?; exit $$((p | m)) ) \
		> .loraplane/static-checks.log 2>&1 & \
	checks=$$!; \
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --durations=20; \
	tests=$$?; wait $$checks; static=$$?; \
	echo "pylint (duplicate code) and mypy, run beside the tests:"; cat .loraplane/static-checks.log; \
	test $$tests -eq 0 && test $$static -eq 0

bench: $(STAMP) $(DEMO_DIR)/config.json
	$(BIN)/python bench/throughput.py --model $(DEMO_DIR)

# loraplane against vLLM's CPU build on this host (docs/performance.md, "Against vLLM on the CPU"): sets up
# vLLM in .peer-venv/ and the llama-250m model in .peer-model/ on first use; minutes per repeat
bench-peer: $(STAMP)
	$(BIN)/python bench/peer.py

clean:
	rm -rf $(VENV) .demo .loraplane

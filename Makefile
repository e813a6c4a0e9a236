# `make run`: set up .venv, generate the demo model once, start the engine on it.
# `make test`: set up .venv, lint, run the tests.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_DIR ?= .demo/model
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: run test lint venv bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "torch==2.13.0"
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

$(DEMO_DIR)/config.json: $(STAMP)
	$(BIN)/loraplane demo-model $(DEMO_DIR)

DEMO_ADAPTERS := demo-pirate demo-poet demo-short

# `loraplane demo-model` also writes the demo adapters (DIR/adapters/<name>) when they are missing
$(DEMO_DIR)/adapters/demo-short/adapter_config.json: $(STAMP)
	$(BIN)/loraplane demo-model $(DEMO_DIR)

# serves the base as `demo` and each demo adapter under its own name (choose it with `model`)
run: $(STAMP) $(DEMO_DIR)/config.json $(DEMO_DIR)/adapters/demo-short/adapter_config.json
	$(BIN)/loraplane engine --model $(DEMO_DIR) --served-model-name demo --host $(HOST) --port $(PORT) \
		--enable-lora --lora-modules $(foreach a,$(DEMO_ADAPTERS),$(a)=$(DEMO_DIR)/adapters/$(a))

lint: $(STAMP)
	$(BIN)/ruff check .

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -p no:cacheprovider

bench: $(STAMP) $(DEMO_DIR)/config.json
	$(BIN)/python bench/throughput.py --model $(DEMO_DIR)

clean:
	rm -rf $(VENV) .demo

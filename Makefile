# The two commands of the README: `make demo` and `make test`. Each creates .venv and installs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-long lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/pgdispatch demo

test: $(STAMP)
	$(BIN)/lint-imports
	$(BIN)/pytest -q

# The longer local profile of the randomized fault run (see README, "Tests").
test-long: $(STAMP)
	PGDISPATCH_FAULT_SECONDS=120 $(BIN)/pytest -q tests/concurrency

bench: $(STAMP)
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) .pgdispatch

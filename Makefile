# The two commands of the README: `make demo` and `make test`. Each creates .venv and installs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-long lint bench bench-smoke clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/pgdispatch demo

# Two workers (pytest-xdist), each file on one of them: its tests share its fixtures and
# its embedded server, as they do in a serial run; then the tests marked solo (the fairness
# measurements) alone (docs/contributing.md).
test: $(STAMP)
	$(BIN)/lint-imports
	$(BIN)/pytest -q -n 2 --dist loadfile -m "not solo"
	$(BIN)/pytest -q -m solo

# The longer local profile of the randomized fault run (see README, "Tests").
test-long: $(STAMP)
	PGDISPATCH_FAULT_SECONDS=120 $(BIN)/pytest -q tests/concurrency tests/faults/test_random_faults.py

# Benchmarks (docs/benchmarks.md): installs the peers and the chart library of
# bench/requirements.txt, then every table of docs/benchmarks.md in turn, timed
# (`python -m bench plan`, bench/plan.py: under 30 minutes on the 2-core machine).
# BENCH_QUICK=1: the smoke run instead (every benchmark at sizes that take seconds).
bench: $(STAMP)
	$(BIN)/pip install --quiet -r bench/requirements.txt
	@case "$$BENCH_QUICK" in 1|true|yes|on) $(BIN)/python -m bench smoke --strict;; \
	  *) $(BIN)/python -m bench plan;; esac

# Every benchmark once at sizes that take seconds, on one embedded server (bench/smoke.py): a
# benchmark that no longer runs fails it. `make test` runs it too (tests/bench/test_smoke.py);
# here the peers of bench/requirements.txt are installed first, so that their series run and
# a series that cannot run fails (--strict).
bench-smoke: $(STAMP)
	$(BIN)/pip install --quiet -r bench/requirements.txt
	$(BIN)/python -m bench smoke --strict

clean:
	rm -rf $(VENV) .pgdispatch

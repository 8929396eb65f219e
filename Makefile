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
# bench/requirements.txt, then runs every series alternated on one server, latency and the
# report (`python -m bench all`), then the fairness benchmark. BENCH_QUICK=1: a smoke run
# (small sizes, fairness skipped).
bench: $(STAMP)
	$(BIN)/pip install --quiet -r bench/requirements.txt
	$(BIN)/python -m bench all
	@case "$$BENCH_QUICK" in 1|true|yes|on) echo "BENCH_QUICK: fairness skipped";; \
	  *) $(BIN)/python -m bench fairness;; esac

# Every benchmark once at sizes that take seconds, on one embedded server (bench/smoke.py): a
# benchmark that no longer runs fails it. `make test` runs it too (tests/bench/test_smoke.py);
# here the peers of bench/requirements.txt are installed first, so that their series run and
# a series that cannot run fails (--strict).
bench-smoke: $(STAMP)
	$(BIN)/pip install --quiet -r bench/requirements.txt
	$(BIN)/python -m bench smoke --strict

clean:
	rm -rf $(VENV) .pgdispatch

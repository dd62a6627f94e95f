# The two commands of the README: `make demo` (the main job) and `make test` (the suite).
# Both create .venv first when it is missing.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test venv bench compare typecheck

venv:
	@./scripts/venv.sh

demo: venv
	$(PY) -m optzoo.demo

test: venv
	$(PY) -m mypy
	$(PY) -m pytest -q

# One table and plot for every registered optimizer, written into docs/benchmarks.md (~10 min on 2 CPU cores).
compare: venv
	$(PY) -m benchmarks.compare

bench: venv
	$(PY) -m pytest benchmarks --benchmark-enable -q
	$(PY) -m benchmarks.bench_routing
	$(PY) -m benchmarks.bench_step

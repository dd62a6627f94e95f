# The two commands of the README: `make demo` (the main job) and `make test` (the suite).
# Both create .venv first when it is missing.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test venv bench typecheck

venv:
	@./scripts/venv.sh

demo: venv
	$(PY) -m optzoo.demo

test: venv
	$(PY) -m mypy
	$(PY) -m pytest -q

bench: venv
	$(PY) -m pytest benchmarks --benchmark-enable -q
	$(PY) -m benchmarks.bench_routing
	$(PY) -m benchmarks.bench_step

# `make run`: the example on 8 simulated CPU devices; `make test`: the test suite (both tiers);
# `make test-fast`: the fast tier alone (no end-to-end XLA runs); `make fuzz`: the long fuzzing run.
# Each creates .venv and installs the project (with its test extra) on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-fast fuzz bench clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	XLA_FLAGS=--xla_force_host_platform_device_count=8 $(PY) examples/gpt.py

# Test processes at once: the suite is mostly XLA compiles and planning, one core each; on CI's
# 2 cores, two workers (sharing one compilation cache, tests/conftest.py) take about 9 minutes.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --durations=20 tests

test-fast: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --durations=10 -m "not slow" tests

# Property-based fuzzing, long profile: 200 random steps, meshes and searches (tests/test_fuzz.py).
fuzz: $(STAMP)
	AUTOPAR_FUZZ=long $(PY) -m pytest -q -s tests/test_fuzz.py

clean:
	rm -rf $(VENV) .pytest_cache plans

bench: $(STAMP)
	$(PY) -m benchmarks $(BENCH_ARGS)

# `make run`: the example on 8 simulated CPU devices; `make test`: the test suite (both tiers);
# `make test-fast`: the fast tier alone (no end-to-end XLA runs); `make fuzz`: the long fuzzing run.
# Each creates .venv and installs the project (with its test extra) on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-fast fuzz reliability bench clean chromium docs

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	XLA_FLAGS=--xla_force_host_platform_device_count=8 $(PY) examples/gpt.py

# Test processes at once: the suite is mostly XLA compiles and planning, one core each; on CI's
# 2 cores, two workers (sharing one compilation cache, tests/conftest.py) take 12 to 16 minutes
# (the target is 10: docs/decisions.md, "Where the suite's time goes").
TEST_WORKERS ?= 2

# Headless Chromium renders Plan.to_html's page in tests/test_plan_html.py: Debian's package,
# installed where the tests run (as root, with apt); elsewhere that one test skips, saying so.
chromium:
	@command -v chromium >/dev/null || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] \
		&& apt-get install -y -q chromium >/dev/null 2>&1; } \
		|| echo "chromium is not installed: tests/test_plan_html.py skips rendering the page"

test: $(STAMP) chromium
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=20 tests

test-fast: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=10 -m "not slow" tests

# Property-based fuzzing, long profile: 200 random steps, meshes and searches (tests/test_fuzz.py),
# and thousands of malformed plans, options and hardware profiles (tests/test_malformed.py).
fuzz: $(STAMP)
	AUTOPAR_FUZZ=long $(PY) -m pytest -q -s tests/test_fuzz.py tests/test_malformed.py

# docs/reliability.md from what the fault and fuzz tests record as they run: the malformed-input
# fuzzing in its long profile, the correctness fuzzing in its fast one, and the fault tests
# RELIABILITY_RUNS times each (a fault's timing varies from run to run).
RELIABILITY_LOG := .pytest_cache/reliability.jsonl
RELIABILITY_RUNS ?= 3
reliability: $(STAMP)
	mkdir -p .pytest_cache && rm -f $(RELIABILITY_LOG)
	export AUTOPAR_RELIABILITY_LOG=$(CURDIR)/$(RELIABILITY_LOG) && \
	AUTOPAR_FUZZ=long $(PY) -m pytest -q tests/test_malformed.py && \
	$(PY) -m pytest -q tests/test_fuzz.py && \
	for run in $$(seq $(RELIABILITY_RUNS)); do \
		$(PY) -m pytest -q tests/test_faults.py tests/test_determinism.py || exit 1; done
	$(PY) -m benchmarks.reliability $(RELIABILITY_LOG) docs/reliability.md

clean:
	rm -rf $(VENV) .pytest_cache plans

# The docs site in site/: the guides in docs/ and the API reference from the docstrings;
# warnings (a broken link, a missing page, a docstring that does not parse) are errors.
docs: $(STAMP)
	$(PY) -m pip install -q -e '.[docs]'
	$(PY) -m mkdocs build --strict --clean

bench: $(STAMP)
	$(PY) -m benchmarks $(BENCH_ARGS)

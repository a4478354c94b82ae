VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
SERVE_ARGS ?=

.PHONY: install test serve clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed

# Two processes: the modules that start servers hold engines (KV pools, threads) for their
# duration; a process of their own returns that memory before the rest runs.
SERVER_TESTS := $(sort $(wildcard tests/test_server*.py)) tests/test_hostile_inputs.py

test: install
	$(PY) -m pytest -q --durations=25 tests $(addprefix --ignore=,$(SERVER_TESTS))
	$(PY) -m pytest -q --durations=25 $(SERVER_TESTS)

serve: install
	$(VENV)/bin/lifeline serve $(SERVE_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info

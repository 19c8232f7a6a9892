# Two commands do the whole set-up on a fresh machine (Python 3.11, no GPU):
#   make serve   -- the server on the embedded default (cpu profile, tiny random-weight demo model)
#   make test    -- the test suite
# Both create or reuse .venv and install what they need. torch is pinned to the CPU wheel here;
# the package itself accepts torch>=2.9 (the GPU image has 2.11).
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: serve test venv bench-ipc

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/mossvox serve $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(ARGS)

bench-ipc: $(STAMP)
	$(PY) -m ipc.bench $(ARGS)

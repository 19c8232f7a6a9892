# Two commands do the whole set-up on a fresh machine (Python 3.11, no GPU):
#   make serve   -- the server on the embedded default (cpu profile, tiny random-weight demo model)
#   make test    -- the test suite
# Both create or reuse .venv and install what they need. torch is pinned to the CPU wheel here;
# the package itself accepts torch>=2.9 (the GPU image has 2.11).
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: serve test venv bench-ipc chromium

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/mossvox serve $(ARGS)

# The suite runs over every core (pytest-xdist; a module's tests stay in one worker, so a server a
# module starts is started once); JOBS=0 runs it in this process.
JOBS ?= auto
test: $(STAMP) chromium
	$(PY) -m pytest -q -n $(JOBS) --dist loadscope $(ARGS)

# The demo-page test drives headless Chromium; it skips (saying why) when none can be installed.
chromium:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  { command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && \
	    { apt-get install -y -qq chromium >/dev/null 2>&1 || \
	      { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium >/dev/null 2>&1; }; }; } || \
	  echo "chromium not installed: the demo-page browser test will be skipped"

bench-ipc: $(STAMP)
	$(PY) -m bench.ipc $(ARGS)

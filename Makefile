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

# Quiet but not silent: one line a step (pip's own output only on an error).
$(STAMP): pyproject.toml
	@echo "mossvox: setting up $(VENV) (first time: a few minutes, mostly torch's download)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	@echo "mossvox: [1/3] pip"
	@$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	@echo "mossvox: [2/3] torch 2.13.0 (the largest download)"
	@$(PY) -m pip install -q --disable-pip-version-check "torch==2.13.0"
	@echo "mossvox: [3/3] mossvox and its dependencies (editable, with the test extra)"
	@$(PY) -m pip install -q --disable-pip-version-check -e ".[test]"
	@touch $(STAMP)
	@echo "mossvox: $(VENV) ready"

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

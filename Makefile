# Two commands for a fresh machine: `make run` and `make test` (`make test-browser` adds Chromium).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ARGS ?=

.PHONY: run test test-browser install clean

# --no-compile: Python compiles a module's bytecode when it is first imported, and the server and
# the suite import a small part of what is installed (pip compiling all of it took two thirds of
# the install); run and test therefore keep bytecode caches on, whatever the environment says.
PIP_INSTALL := $(PY) -m pip install -q --no-compile

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) --upgrade pip
	# torch first and pinned: a looser pin would pull several GB of CUDA wheels.
	$(PIP_INSTALL) torch==2.13.0
	$(PIP_INSTALL) -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

run: export PYTHONDONTWRITEBYTECODE :=
run: $(STAMP)
	$(PY) -m app $(ARGS)

# Two workers (the suite waits on server processes as much as it computes), then the few tests
# that look at the whole machine's /dev/shm or load it, by themselves; status 5: ARGS selected none.
# Bytecode caches on (git-ignored): the suite starts well over a hundred Python processes
# (servers, engines, CLIs), and each would otherwise compile the project and its imports again.
TEST_WORKERS ?= 2
test: export PYTHONDONTWRITEBYTECODE :=
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(ARGS)
	$(PY) -m pytest -q --alone $(ARGS) || test $$? -eq 5

# The chat page in headless Chromium: installs Debian's chromium and chromium-driver when missing
# (apt-get, as root or through sudo), then runs the browser test alone.
test-browser: $(STAMP)
	@if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then \
		SUDO=$$(test "$$(id -u)" = 0 || echo sudo); \
		$$SUDO apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q chromium chromium-driver; \
	fi
	$(PY) -m pytest -q tests/server/test_browser.py $(ARGS)

clean:
	rm -rf $(VENV) *.egg-info

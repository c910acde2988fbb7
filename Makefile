# One command for people and CI: `make test` sets up .venv, then runs lint, types and tests.
# `make check` is the loop of development (about 75 s here): the same lint and types, and
# every test but those needing real vLLM, the browser, Prometheus, a Docker engine (compose)
# or minutes (the soak), without installing any of those. `make test` is the full suite CI runs.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: test check install lint typecheck pytest quick-pytest run bench benchmarks clean

test: install vllm browser prometheus lint typecheck pytest

check: install lint typecheck quick-pytest

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Installs (editable, every extra) only when pyproject.toml changed since the last time.
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	@# setuptools' notice that folders named like the packages shadow them: that is the layout.
	PYTHONWARNINGS='ignore:Editable installation' $(BIN)/pip install -q -e '.[dev]'
	touch $@

lint:
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	@# the console's script (no build step): at least it parses, as the module the page loads,
	@# where Node.js is at hand (a module's rules: a name declared twice is an error)
	@if command -v node >/dev/null; then \
		node --input-type=module --check < gateway/admin/console/console.js; fi

typecheck:
	$(BIN)/mypy

pytest:
	$(BIN)/pytest $(PYTEST_ARGS)

# The markers: pyproject.toml's [tool.pytest.ini_options]; given by folder in tests/conftest.py.
# Test files spread over every core (pytest-xdist; a file's tests stay in one process, with
# its module fixtures): most of the suite waits on sockets and subprocesses.
quick-pytest:
	$(BIN)/pytest -m 'not compose and not vllm and not browser and not soak and not prometheus' \
		-n auto --dist loadfile $(PYTEST_ARGS)

# Two simulated backends and the gateway in front of them (no GPU needed).
run: install
	$(BIN)/llm-gateway demo

bench: install
	$(BIN)/python -m loadtest.bench.overhead

# Every scenario under its policies plus the overhead benchmark; rewrites docs/benchmarks.md
# (plots in docs/img/, raw results in docs/results/). About 8 minutes on 2 cores.
benchmarks: install
	$(BIN)/llm-gateway loadtest report-all

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache

# Real vLLM (CPU build) in its own virtualenv, .venv-vllm, for tests/e2e; does nothing when
# already installed. `e2e` runs only the end-to-end tests (two vLLM servers, about a minute
# to start).
.PHONY: vllm e2e browser prometheus compose-test

vllm:
	scripts/install_vllm.sh

# Chromium for the console's browser tests (Debian's package where apt is at hand).
browser:
	scripts/install_browser.sh

# Prometheus and promtool for the alert rules' and dashboard's tests (Debian's package).
prometheus:
	scripts/install_prometheus.sh

# compose.yaml for real (tests/compose): installs and starts what it needs when missing (the
# Docker engine, the compose plugin, local base images made with debootstrap; see
# scripts/compose_env.sh), builds the image, then starts, scales, breaks and stops the sim
# profile. Removes every container, network and volume it made. About 5 minutes here.
compose-test: install
	$(BIN)/pytest -m compose tests/compose $(PYTEST_ARGS)

e2e: install vllm
	$(BIN)/pytest tests/e2e $(PYTEST_ARGS)

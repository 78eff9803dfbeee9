"""The playground at `/` in headless Chromium against a real `llmserve serve` process:
streamed answers, stop and regenerate, HTML in answers shown as text, the content
security policy, the keyboard, a phone-width screen, and a gateway's API key."""
from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys

from tests.web.browser import console_errors, open_page, save_screenshot, server_status, wait_for
from tests.web.conftest import TENANT_KEY

pytestmark = pytest.mark.slow

# Records the text length of the streaming answer at every DOM change, so the test sees
# tokens arrive one render after another (not only the finished answer).
WATCH_STREAM = """
window.__lengths = [];
new MutationObserver(() => {
  const msg = document.querySelector('#messages li[data-state="streaming"] .content');
  if (msg) window.__lengths.push(msg.textContent.length);
}).observe(document.getElementById('messages'), {childList: true, subtree: true,
                                                 characterData: true});
"""


def set_field(browser: Any, field: str, value: Any) -> None:
    browser.execute_script(
        "const el = document.getElementById(arguments[0]);"
        "if (el.type === 'checkbox') el.checked = arguments[1]; else el.value = arguments[1];"
        "el.dispatchEvent(new Event('change', {bubbles: true}));", field, value)


def assistant_messages(browser: Any) -> list[Any]:
    return browser.find_elements(By.CSS_SELECTOR, '#messages li[data-role="assistant"]')


def last_state(browser: Any) -> str:
    msgs = assistant_messages(browser)
    return msgs[-1].get_attribute("data-state") if msgs else ""


def ask(browser: Any, question: str) -> None:
    box = browser.find_element(By.ID, "prompt")
    box.click()
    box.send_keys(question)
    box.send_keys(Keys.ENTER)


def test_question_streams_tokens_and_completes(plain_server, browser, screenshots) -> None:
    open_page(browser, plain_server.url("/"))
    wait_for(lambda: browser.execute_script("return document.body.dataset.ready") == "true",
             what="the model list")
    model = browser.find_element(By.ID, "model")
    assert model.get_attribute("value") and model.text   # picked from /v1/models
    for field, value in (("max_tokens", 160), ("temperature", 0), ("ignore_eos", True),
                         ("system", "You are terse.")):
        set_field(browser, field, value)
    browser.execute_script(WATCH_STREAM)

    box = browser.find_element(By.ID, "prompt")   # Shift+Enter is a new line, not a send
    box.send_keys("first line", Keys.SHIFT, Keys.ENTER, Keys.SHIFT, "second line")
    assert box.get_attribute("value") == "first line\nsecond line"
    assert not assistant_messages(browser)
    box.clear()

    ask(browser, "What is a paged KV cache?")
    wait_for(lambda: last_state(browser) == "done", 60, "the answer to complete")
    lengths = browser.execute_script("return window.__lengths")
    growing = sorted({n for n in lengths if n > 0})
    assert len(growing) >= 3, f"the answer did not stream in pieces: {lengths[:20]}"
    answer = assistant_messages(browser)[-1]
    assert len(answer.find_element(By.CSS_SELECTOR, ".content").text) >= growing[-1] // 2
    figures = answer.find_element(By.CSS_SELECTOR, ".figures").text
    assert "TTFT" in figures and "tok/s" in figures and "160 tokens" in figures
    assert "cached" in figures and "length" in figures
    save_screenshot(browser, screenshots, "playground.png")

    saved = json.loads(browser.execute_script("return localStorage['llmserve.conversations']"))
    assert saved[0]["messages"][0] == {"role": "user", "content": "What is a paged KV cache?"}
    assert saved[0]["messages"][1]["stats"]["completion_tokens"] == 160
    browser.refresh()   # the conversation comes back from local storage
    wait_for(lambda: len(assistant_messages(browser)) == 1, what="the saved conversation")
    assert not console_errors(browser)


def test_stop_mid_stream_frees_the_engine_and_regenerate_replaces(plain_server, browser) -> None:
    open_page(browser, plain_server.url("/"))
    wait_for(lambda: browser.execute_script("return document.body.dataset.ready") == "true",
             what="the model list")
    set_field(browser, "max_tokens", 3500)
    set_field(browser, "ignore_eos", True)
    ask(browser, "Count to ten thousand.")
    wait_for(lambda: last_state(browser) == "streaming" and
             assistant_messages(browser)[-1].find_element(By.CSS_SELECTOR, ".content").text,
             30, "the first tokens")
    assert server_status(plain_server.base_url)["now"]["running"] == 1
    browser.find_element(By.ID, "stop").click()
    wait_for(lambda: last_state(browser) == "stopped", 10, "the stopped state")
    wait_for(lambda: server_status(plain_server.base_url)["now"]["running"] == 0, 10,
             "the server's running count to return to 0")
    assert "stopped" in assistant_messages(browser)[-1].text

    set_field(browser, "max_tokens", 8)
    browser.find_element(By.ID, "regenerate").click()
    wait_for(lambda: last_state(browser) == "done", 30, "the regenerated answer")
    assert len(assistant_messages(browser)) == 1   # replaced, not appended
    assert "8 tokens" in assistant_messages(browser)[-1].text


PAYLOAD = ('Here: <script>window.xssRan = 1</script> and '
           '<img src="x" onerror="window.xssRan = 2"> **bold** `<b>code</b>`\n\n'
           '```html\n<script>window.xssRan = 3</script>\n```\n- item <i>one</i>')


def test_html_in_answers_renders_as_text(plain_server, browser) -> None:
    conversation = [{"id": "xss", "title": "xss", "created": 1, "messages": [
        {"role": "user", "content": "<img src=x onerror='window.xssRan=4'>"},
        {"role": "assistant", "content": PAYLOAD}]}]
    open_page(browser, plain_server.url("/"))
    browser.execute_script("localStorage['llmserve.conversations'] = arguments[0];"
                           "localStorage['llmserve.current'] = '\"xss\"';",
                           json.dumps(conversation))
    browser.refresh()
    wait_for(lambda: len(assistant_messages(browser)) == 1, what="the saved conversation")
    messages = browser.find_element(By.ID, "messages")
    assert not messages.find_elements(By.CSS_SELECTOR, "script, img, b, i, iframe")
    text = messages.text
    assert "<script>window.xssRan = 1</script>" in text and 'onerror="window.xssRan = 2"' in text
    assert messages.find_element(By.CSS_SELECTOR, "strong").text == "bold"
    assert messages.find_element(By.CSS_SELECTOR, "p code").text == "<b>code</b>"
    assert "window.xssRan = 3" in messages.find_element(By.CSS_SELECTOR, "pre code").text
    assert messages.find_element(By.CSS_SELECTOR, ".content ul li").text == "item <i>one</i>"

    # the function the streaming path renders every increment with, on the raw payload
    found = browser.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "import('/ui/markdown.js').then((m) => { const div = document.createElement('div');"
        "  m.renderInto(div, arguments[0]);"
        "  done([div.querySelectorAll('script, img, b, i').length, div.textContent]); });",
        PAYLOAD)
    assert found[0] == 0 and "<img src=\"x\" onerror=" in found[1]
    # defence in depth: the content security policy blocks inline handlers outright
    browser.execute_script("document.body.insertAdjacentHTML('beforeend',"
                           "'<img src=\"/nope\" onerror=\"window.xssRan = 5\">')")
    browser.execute_async_script("setTimeout(arguments[arguments.length - 1], 300)")
    assert browser.execute_script("return window.xssRan") is None


def test_pages_send_security_headers(plain_server) -> None:
    for path in ("/", "/dashboard", "/ui/playground.js", "/ui/style.css"):
        r = httpx.get(plain_server.url(path), timeout=10)
        assert r.status_code == 200, path
        csp = r.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
        assert "unsafe-inline" not in csp
        assert r.headers["x-content-type-options"] == "nosniff"
        assert r.headers["x-frame-options"] == "DENY"
        assert r.headers["referrer-policy"] == "no-referrer"
    page = httpx.get(plain_server.url("/"), timeout=10).text
    assert "<script>" not in page and " on" not in page.replace(" one", "")
    assert httpx.get(plain_server.url("/ui/../pyproject.toml"), timeout=10).status_code == 404
    assert httpx.get(plain_server.url("/v1/models"), timeout=10).status_code == 200


def test_phone_width_has_no_horizontal_scroll(plain_server, browser) -> None:
    browser.set_window_size(390, 844)
    try:
        open_page(browser, plain_server.url("/"))
        wait_for(lambda: browser.execute_script("return document.body.dataset.ready") == "true",
                 what="the model list")
        width = browser.execute_script("return document.documentElement.scrollWidth")
        assert width <= browser.execute_script("return window.innerWidth")
        assert browser.find_element(By.ID, "prompt").is_displayed()
        browser.find_element(By.TAG_NAME, "body").send_keys(Keys.TAB)   # the skip link first
        assert browser.switch_to.active_element.get_attribute("class") == "skip"
    finally:
        browser.set_window_size(1280, 900)


def test_gateway_page_asks_for_a_key_and_works_with_it(gateway_server, browser) -> None:
    open_page(browser, gateway_server.url("/"))
    wait_for(lambda: browser.execute_script("return document.body.dataset.ready") == "needs-key",
             what="the key prompt")
    assert browser.find_element(By.ID, "key-box").is_displayed()
    assert "API key" in browser.find_element(By.ID, "notice").text
    assert browser.switch_to.active_element.get_attribute("id") == "api-key"
    ask(browser, "Hello?")   # without a key the server answers 401 and nothing is added
    wait_for(lambda: not browser.find_element(By.ID, "send").get_attribute("disabled"), 10,
             "the request to end")
    assert not assistant_messages(browser)

    browser.find_element(By.ID, "api-key").send_keys(TENANT_KEY, Keys.ENTER)
    wait_for(lambda: browser.execute_script("return document.body.dataset.ready") == "true",
             what="the model list with the key")
    assert browser.execute_script("return sessionStorage['llmserve.apiKey']") == TENANT_KEY
    set_field(browser, "max_tokens", 6)
    set_field(browser, "ignore_eos", True)
    ask(browser, "Hello again?")
    wait_for(lambda: last_state(browser) == "done", 30, "the answer with the key")
    assert "6 tokens" in assistant_messages(browser)[-1].text

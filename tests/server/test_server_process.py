"""`llmserve serve` as a real server process (the default model), driven like a user would."""
from __future__ import annotations

import re
import time

import httpx
import openai
import pytest

from tests.gateway.gateway_server_helpers import ServerProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def base_url(tmp_path_factory):
    server = ServerProcess(None, ["--num-kv-blocks", "256", "--max-model-len", "2048",
                                  "--num-threads", "2", "--dtype", "float32"],
                           tmp_path_factory.mktemp("srv") / "server.log")
    yield server.start().base_url
    server.stop()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    m = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def test_chat_answer_from_real_process(base_url):
    r = _client(base_url).chat.completions.create(
        model="SmolLM2-135M-Instruct", max_tokens=24, temperature=0,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in r.choices[0].message.content
    assert r.system_fingerprint.startswith("fp_")


def test_streamed_cjk_and_emoji_equal_non_streamed(base_url):
    c = _client(base_url)
    prompt = "翻译成中文并加表情：你好，世界！🙂🎉 我喜欢学习。日本語も少し。"
    kw = dict(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=48, temperature=1.0,
              seed=11, extra_body={"ignore_eos": True})
    done = c.completions.create(**kw).choices[0]
    full = done.text
    pieces = [ch.choices[0].text for ch in c.completions.create(stream=True, **kw) if ch.choices]
    assert "".join(pieces) == full
    # a cut at max_tokens inside a character's bytes ends the text (both ways alike) with one
    # replacement character, as decoding the token ids does; never before the end
    if done.finish_reason == "length" and full.endswith("\ufffd"):
        full, pieces[-1] = full.rstrip("\ufffd"), pieces[-1].rstrip("\ufffd")
    assert "\ufffd" not in full and all("\ufffd" not in p for p in pieces)
    assert any(ord(ch) > 127 for ch in full)  # multi-byte characters really streamed


def test_second_identical_long_request_hits_prefix_cache(base_url):
    c = _client(base_url)
    long = "You are a meticulous assistant. " * 40
    msgs = [{"role": "system", "content": long}, {"role": "user", "content": "Say hi."}]
    first = c.chat.completions.create(model="SmolLM2-135M-Instruct", messages=msgs, max_tokens=4)
    second = c.chat.completions.create(model="SmolLM2-135M-Instruct", messages=msgs, max_tokens=4)
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.usage.prompt_tokens_details.cached_tokens >= \
        first.usage.prompt_tokens_details.cached_tokens


def test_disconnect_frees_kv_and_counts_abort(base_url):
    used0 = _metric(base_url, "llmserve_kv_cache_blocks_used")
    aborted0 = _metric(base_url, "llmserve_request_aborted_total")
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "Count: 1, 2, 3,", "max_tokens": 1500,
            "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", base_url + "/v1/completions", json=body) as resp:
            events = 0
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events += 1
                    if events == 2:
                        break
    deadline = time.time() + 1.0
    while time.time() < deadline:
        if (_metric(base_url, "llmserve_kv_cache_blocks_used") == used0
                and _metric(base_url, "llmserve_request_aborted_total") > aborted0):
            break
        time.sleep(0.05)
    assert _metric(base_url, "llmserve_kv_cache_blocks_used") == used0
    assert _metric(base_url, "llmserve_request_aborted_total") > aborted0


@pytest.mark.parametrize("body,status", [
    (b"{not json", 400),
    (b'{"model": "SmolLM2-135M-Instruct", "messages": []}', 400),
    (b'{"model": "SmolLM2-135M-Instruct", "prompt": "x", "max_tokens": 99999999}', 400),
    (b'{"model": "SmolLM2-135M-Instruct", "prompt": "x", "bogus_field": 1}', 400),
    (b'{"model": "SmolLM2-135M-Instruct", "prompt": "\xff\xfe"}', 400),
    (b'{"model": "nope", "prompt": "x"}', 404),
])
def test_bad_input_is_openai_error_and_server_keeps_serving(base_url, body, status):
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    r = httpx.post(base_url + path, content=body, headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    assert httpx.get(base_url + "/ready", timeout=5).status_code == 200

"""Every variable-size input is bounded: over the bound is a 400 naming the field, before
any tokenization; at the bound is fine (docs/GATEWAY.md, "Input limits")."""
from __future__ import annotations

import httpx
import pytest

from llmserve.server.limits import RequestLimits
from tests.server.server_fakes import FakeEngine
from tests.server.server_helpers import assert_openai_error

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
LIMITS = RequestLimits(max_messages=4, max_content_parts=3, max_prompt_bytes=200,
                       max_prompts=3, max_prompt_token_ids=50, max_stop_strings=2,
                       max_stop_string_chars=8, max_stop_token_ids=3, max_name_chars=10)


@pytest.fixture(scope="module")
def server():
    from tests.server.conftest import LiveServer

    live = LiveServer(FakeEngine(), input_limits=LIMITS).start()
    yield live
    live.stop()


def user(content="hi", **kw):
    return {"role": "user", "content": content, **kw}


OVER = [
    # (case, path, body, param, code)
    ("stop-count", COMPLETIONS, {"prompt": "x", "stop": ["a", "b", "c"]}, "stop", "too_many_items"),
    ("stop-length", COMPLETIONS, {"prompt": "x", "stop": "123456789"}, "stop", "string_too_long"),
    ("stop-length-list", CHAT, {"messages": [user()], "stop": ["ok", "123456789"]}, "stop",
     "string_too_long"),
    ("stop-ids", COMPLETIONS, {"prompt": "x", "stop_token_ids": [1, 2, 3, 4]}, "stop_token_ids",
     "too_many_items"),
    ("messages", CHAT, {"messages": [user()] * 5}, "messages", "too_many_items"),
    ("content-parts", CHAT, {"messages": [user([{"type": "text", "text": "a"}] * 4)]},
     "messages[0].content", "too_many_items"),
    ("name", CHAT, {"messages": [user(name="n" * 11)]}, "messages[0].name", "string_too_long"),
    ("user", CHAT, {"messages": [user()], "user": "u" * 11}, "user", "string_too_long"),
    ("chat-bytes", CHAT, {"messages": [user("é" * 101)]}, "messages", "prompt_too_large"),
    ("chat-bytes-parts", CHAT, {"messages": [user([{"type": "text", "text": "x" * 100}] * 2),
                                             user("y")]}, "messages", "prompt_too_large"),
    ("prompt-bytes", COMPLETIONS, {"prompt": ["x" * 150, "y" * 60]}, "prompt",
     "prompt_too_large"),
    ("prompt-count", COMPLETIONS, {"prompt": ["a", "b", "c", "d"]}, "prompt", "too_many_items"),
    ("prompt-ids", COMPLETIONS, {"prompt": [[5] * 30, [6] * 30]}, "prompt", "prompt_too_large"),
    ("part-extra-field", CHAT, {"messages": [user([{"type": "text", "text": "a", "x": 1}])]},
     "messages[0].content[0].x", "unknown_parameter"),
    ("n", COMPLETIONS, {"prompt": "x", "n": 129}, "n", None),
    ("top-logprobs", CHAT, {"messages": [user()], "logprobs": True, "top_logprobs": 21},
     "top_logprobs", None),
    ("logprobs", COMPLETIONS, {"prompt": "x", "logprobs": 21}, "logprobs", None),
    ("max-tokens", COMPLETIONS, {"prompt": "x", "max_tokens": 5000}, "max_tokens",
     "context_length_exceeded"),
]


@pytest.mark.parametrize("case,path,body,param,code", OVER, ids=[c[0] for c in OVER])
def test_over_a_bound_is_400(server, case, path, body, param, code):
    r = httpx.post(server.url(path), json=body, timeout=30)
    assert_openai_error(r, 400, param=param, code=code)


AT = [
    (COMPLETIONS, {"prompt": "x", "stop": ["12345678", "b"], "stop_token_ids": [1, 2, 3],
                   "max_tokens": 4}),
    (CHAT, {"messages": [user([{"type": "text", "text": "a"}] * 3, name="n" * 10)] * 4,
            "max_tokens": 4, "user": "u" * 10}),
    (COMPLETIONS, {"prompt": ["x" * 100, "y" * 99, "z"], "max_tokens": 2}),
    (COMPLETIONS, {"prompt": [[5] * 25, [6] * 25], "max_tokens": 2}),
]


@pytest.mark.parametrize("path,body", AT)
def test_at_the_bound_is_served(server, path, body):
    r = httpx.post(server.url(path), json=body, timeout=30)
    assert r.status_code == 200, r.text


def test_over_bound_never_reaches_tokenizer_or_engine(server):
    calls = len(server.engine.calls)
    r = httpx.post(server.url(CHAT), json={"messages": [user("x" * 10_000)]}, timeout=30)
    assert_openai_error(r, 400, code="prompt_too_large")
    assert len(server.engine.calls) == calls


def test_default_limits_are_sane():
    d = RequestLimits()
    assert (d.max_stop_strings, d.max_stop_string_chars, d.max_stop_token_ids) == (16, 1024, 256)
    assert d.max_prompt_bytes == 1 << 20 and d.max_messages == 1024
    with pytest.raises(ValueError, match="max_messages"):
        RequestLimits(max_messages=0)

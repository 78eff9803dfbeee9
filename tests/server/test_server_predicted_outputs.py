"""OpenAI Predicted Outputs through the official client on a live server (tiny model):
the prediction is replayed as speculative drafts, the output is unchanged, and usage
reports accepted / rejected prediction tokens; a malformed prediction is a 400."""
from __future__ import annotations

import openai
import pytest

from llmserve.async_llm import AsyncLLM
from llmserve.config import EngineConfig
from tests.model.tiny_checkpoints import make_tiny_checkpoint

MESSAGES = [{"role": "user", "content": "Repeat: the cat sat on the mat."}]


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    path = make_tiny_checkpoint(str(tmp_path_factory.mktemp("pred")), arch="llama",
                                num_heads=4, num_kv_heads=2, seed=5)
    engine = AsyncLLM.from_config(EngineConfig.from_kwargs(model=path, dtype="float32", num_kv_blocks=256,
                                               block_size=4, device="cpu"))
    yield engine
    engine.shutdown()


def test_prediction_is_replayed_and_reported_in_usage(tiny_engine, start_server):
    server = start_server(tiny_engine)
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="x", max_retries=0, timeout=60)

    def chat(**kw):
        return client.chat.completions.create(model=tiny_engine.model_name, messages=MESSAGES,
                                              max_tokens=24, temperature=0,
                                              extra_body={"ignore_eos": True}, **kw)

    plain = chat()
    assert plain.usage.completion_tokens_details is None or \
        plain.usage.completion_tokens_details.accepted_prediction_tokens in (None, 0)
    text = plain.choices[0].message.content
    right = chat(prediction={"type": "content", "content": text})
    assert right.choices[0].message.content == text
    details = right.usage.completion_tokens_details
    assert details.accepted_prediction_tokens >= right.usage.completion_tokens // 2
    wrong = chat(prediction={"type": "content",
                             "content": [{"type": "text", "text": "zebra quantum " * 6}]})
    assert wrong.choices[0].message.content == text
    d = wrong.usage.completion_tokens_details
    assert d.rejected_prediction_tokens > d.accepted_prediction_tokens
    with pytest.raises(openai.BadRequestError) as err:
        chat(prediction={"type": "text", "content": "x"})
    assert err.value.body["param"] == "prediction"

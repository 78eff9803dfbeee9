"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF): a real answer, and logits equal to
transformers running the same dequantized weights."""
from __future__ import annotations

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.model.executor.capture import LogitsCapture

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm():
    # the file dequantized to float32 on every tier (the avx2 tier's auto keeps it packed)
    return LLM(None, num_kv_blocks=256, dtype="float32", quantization="none")


def test_capital_of_france(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=24))[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason in ("stop", "length")


def test_logits_match_transformers_on_same_dequantized_weights(llm):
    from llmserve.model.loading.loader import load_checkpoint

    ckpt = load_checkpoint(llm.engine.model_path)
    mc = ckpt.config
    assert (mc.num_hidden_layers, mc.hidden_size, mc.num_attention_heads,
            mc.num_key_value_heads, mc.vocab_size) == (30, 576, 9, 3, 49152)
    from llmserve.bench.hf_baseline import load_transformers_model

    hf = load_transformers_model(llm.engine.model_path)
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}])
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    runner = llm.engine.runner
    runner.capture = LogitsCapture.ALL
    inner = runner.execute
    captured = []

    def execute(step):
        out = inner(step)
        captured.append(out)
        return out

    runner.execute = execute
    try:
        out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0))[0]
    finally:
        runner.execute = inner
        runner.capture = LogitsCapture.NONE
    ours = captured[0].all_logits[out.request_id]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    # the shared system-prompt blocks may come from the prefix cache: compare what was computed
    assert ours.shape[0] == len(ids) - out.num_cached_tokens
    ref = ref[out.num_cached_tokens:]
    torch.testing.assert_close(ours, ref, atol=2e-3, rtol=1e-3)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))

"""Mistral with sliding-window attention against transformers (fp32, tiny random checkpoint).

The window (20 positions) is shorter than the prompts and spans more than one 16-token KV
block, so keys leave the window mid-block during prefill, chunked prefill and decode. Decode
runs on both attention backends (reference: groups by width; paged: one batch), which lay
decodes out differently; prefill chunks take the same grouped path in both.
"""
from __future__ import annotations

import pytest
import torch

from llmserve import SamplingParams
from llmserve.model.loading.loader import load_model_config
from tests.model.family_parity import (
    ATOL,
    RTOL,
    StepRecorder,
    check_batch_vs_alone,
    check_decode,
    check_greedy,
    check_prefill,
    load_hf,
    make_llm,
)
from tests.model.tiny_checkpoints import make_tiny_checkpoint

pytest.importorskip("transformers")

WINDOW = 20
PROMPTS = [[5, 17, 300, 42, 9, 1000, 77], list(range(100, 145)), [11, 12]]


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    path = make_tiny_checkpoint(str(tmp_path_factory.mktemp("mistral")), arch="mistral",
                                num_heads=4, num_kv_heads=2, seed=3,
                                config_overrides={"sliding_window": WINDOW})
    return path, load_hf(path)


def test_config_reads_the_window(mistral):
    cfg = load_model_config(mistral[0])
    assert cfg.architecture == "mistral" and cfg.sliding_window == WINDOW
    assert all(cfg.layer_window(i) == WINDOW for i in range(cfg.num_hidden_layers))


def test_prefill_logits_match(mistral):
    check_prefill(*mistral, PROMPTS)


@pytest.mark.parametrize("backend", ["reference", "paged"])
def test_decode_logits_match_step_by_step(mistral, backend):
    check_decode(*mistral, PROMPTS[1], steps=12, attention_backend=backend)


def test_batch_of_different_lengths_matches_each_alone(mistral):
    check_batch_vs_alone(mistral[0], PROMPTS)


def test_greedy_generation_matches_transformers_generate(mistral):
    check_greedy(*mistral, PROMPTS[1])


def test_window_changes_the_logits(mistral):
    """The mask matters: the same weights without the window give other logits."""
    path, hf = mistral
    hf.config.sliding_window = None
    try:
        full = hf(torch.tensor([PROMPTS[1]])).logits[0]
    finally:
        hf.config.sliding_window = WINDOW
    llm = make_llm(path)
    rec = StepRecorder(llm, all_logits=True)
    out = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=1, temperature=0))
    got = rec.steps[0].all_logits[out[0].request_id]
    assert (got[WINDOW:] - full[WINDOW:].detach()).abs().max() > 1e-3
    torch.testing.assert_close(got[:WINDOW], full[:WINDOW].detach(), atol=ATOL, rtol=RTOL)


def test_chunked_prefill_matches_one_shot(mistral):
    path, _ = mistral
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    one = make_llm(path)
    r1 = StepRecorder(one)
    a = one.generate([PROMPTS[1]], params)[0]
    chunked = make_llm(path, max_num_batched_tokens=8)
    r2 = StepRecorder(chunked)
    b = chunked.generate([PROMPTS[1]], params)[0]
    assert len(r2.steps) >= len(PROMPTS[1]) // 8   # really chunked
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    torch.testing.assert_close(r2.sampled_logits(b.request_id), r1.sampled_logits(a.request_id),
                               atol=ATOL, rtol=RTOL)

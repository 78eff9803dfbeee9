"""A prefix-cache hit gives the same logits as a miss; versions never share a namespace."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from llmserve import LLM, SamplingParams
from tests.model.test_parity import StepRecorder
from tests.model.tiny_checkpoints import make_tiny_checkpoint

BS = 4
SHARED = list(range(200, 200 + 3 * BS))  # 3 full blocks


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("pc")), arch="llama",
                                num_heads=4, num_kv_heads=2, seed=5)


def logits_for(llm: LLM, prompt: list[int], salt=None):
    rec = StepRecorder(llm)
    out = llm.generate([prompt], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
                       cache_salt=salt)[0]
    rec.runner.execute = rec.runner.__class__.execute.__get__(rec.runner)  # unwrap
    return out, torch.stack(rec.sampled_logits(out.request_id))


@pytest.mark.parametrize("suffix", [[], [7], [7, 8, 9], list(range(300, 300 + BS))],
                         ids=["ends-on-boundary", "one-more", "partial-block", "full-extra-block"])
def test_hit_logits_equal_miss_logits(tiny_path, suffix):
    off = LLM(tiny_path, dtype="float32", num_kv_blocks=64, block_size=BS, enable_prefix_caching=False)
    on = LLM(tiny_path, dtype="float32", num_kv_blocks=64, block_size=BS, check_invariants=True)
    warm, _ = logits_for(on, SHARED + [1, 2])           # fills the cache with SHARED's blocks
    prompt = SHARED + suffix
    hit, hit_logits = logits_for(on, prompt)
    miss, miss_logits = logits_for(off, prompt)
    expected = len(SHARED) if suffix else len(SHARED) - BS  # the last token is always recomputed
    assert hit.num_cached_tokens == expected
    assert miss.num_cached_tokens == 0
    assert hit.outputs[0].token_ids == miss.outputs[0].token_ids
    torch.testing.assert_close(hit_logits, miss_logits, atol=1e-5, rtol=1e-5)


def test_tenants_do_not_share(tiny_path):
    llm = LLM(tiny_path, dtype="float32", num_kv_blocks=64, block_size=BS)
    prompt = SHARED + [1]
    a1, _ = logits_for(llm, prompt, salt="tenant:a")
    b1, _ = logits_for(llm, prompt, salt="tenant:b")
    a2, _ = logits_for(llm, prompt, salt="tenant:a")
    assert (a1.num_cached_tokens, b1.num_cached_tokens, a2.num_cached_tokens) == (0, 0, len(SHARED))
    stats = llm.get_stats()
    assert stats.prefix_hit_tokens_by_tenant["tenant:a"] == len(SHARED)
    assert stats.prefix_hit_tokens_by_tenant["tenant:b"] == 0


def _fingerprint(path, **kw):
    kw.setdefault("dtype", "float32")
    return LLM(path, num_kv_blocks=16, block_size=kw.pop("block_size", BS), **kw).engine.fingerprint


def test_fingerprint_covers_everything_that_changes_kv(tiny_path, tmp_path):
    base = _fingerprint(tiny_path)
    assert _fingerprint(tiny_path) == base  # stable
    other_weights = make_tiny_checkpoint(str(tmp_path / "w"), arch="llama", num_heads=4,
                                         num_kv_heads=2, seed=6)
    assert _fingerprint(other_weights) != base
    assert _fingerprint(tiny_path, block_size=8) != base
    assert _fingerprint(tiny_path, dtype="bfloat16") != base
    assert _fingerprint(tiny_path, kv_cache_dtype="bfloat16") != base   # fp32 weights, bf16 KV
    templ = str(tmp_path / "templ")
    shutil.copytree(tiny_path, templ)
    cfg_path = os.path.join(templ, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["chat_template"] = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    assert _fingerprint(templ) != base


def test_fingerprint_follows_what_json_whitespace_allows(tiny_path, monkeypatch):
    """Cached structured answers are keyed by the fingerprint: ``compact`` differs from
    ``flexible``, and so does a new bound on what ``flexible`` lets through."""
    from llmserve.structured_output import spec

    base = _fingerprint(tiny_path)
    assert _fingerprint(tiny_path, json_whitespace="compact") != base
    monkeypatch.setattr(spec, "FLEXIBLE_WHITESPACE", r"\x20{1,4}")
    assert _fingerprint(tiny_path) != base

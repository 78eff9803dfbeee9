"""Draft-model speculation on tiny random models: another model with the same tokenizer
and the self-draft (the target's own weights quantized) keep greedy outputs identical and
sampled outputs on the target distribution; a tokenizer mismatch is a start-up error."""
from __future__ import annotations

import itertools
import json
import math
import os
import shutil
from collections import Counter

import pytest

from llmserve import LLM, SamplingParams
from tests.model.tiny_checkpoints import make_tiny_checkpoint
from tests.spec_decode.test_spec_decode_model import PROMPTS, _chi2_critical, chi_square


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft")
    target = make_tiny_checkpoint(str(root / "target"), arch="llama", num_heads=4,
                                  num_kv_heads=2, seed=5)
    other = make_tiny_checkpoint(str(root / "other"), arch="llama", num_heads=2,
                                 num_kv_heads=1, hidden=32, layers=1, seed=8)
    return target, other


def _llm(target, draft=None, quant="auto", **kw):
    """Speculating engines always draft (no adaptivity: what the cost model plans depends
    on step times, and these tests count drafts)."""
    args = dict(dtype="float32", num_kv_blocks=128, block_size=4, check_invariants=True)
    if draft is not None:
        args.update(speculative_method="draft", draft_model=draft, draft_quantization=quant,
                    num_speculative_tokens=3, speculative_adaptive=False)
    args.update(kw)
    return LLM(target, **args)


@pytest.mark.parametrize("which", ["other", "self-int8"])
def test_greedy_identical_with_a_draft_model(paths, which):
    target, other = paths
    params = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                             repetition_penalty=1.2)] * 2 + \
             [SamplingParams(max_tokens=10, temperature=0.8, seed=3, ignore_eos=True)]
    ref = _llm(target).generate(PROMPTS, params)
    llm = (_llm(target, other) if which == "other" else _llm(target, target, quant="int8"))
    got = llm.generate(PROMPTS, params)
    for r, g, p in zip(ref, got, params):
        if p.temperature == 0:
            assert g.outputs[0].token_ids == r.outputs[0].token_ids
        assert len(g.outputs[0].token_ids) == p.max_tokens
    stats = llm.engine.spec.stats
    assert stats.proposed_tokens > 0
    if which == "self-int8":   # the same weights at int8 nearly always agree
        assert stats.accepted_tokens > 0.7 * stats.proposed_tokens, stats
    assert llm.engine.spec.proposer.pool.num_used_blocks == 0   # draft KV released


def test_sampled_with_a_draft_model_follow_the_target(paths):
    target, other = paths
    vocab = 4
    prompt = [0, 1, 3, 0, 1, 3, 0, 1]
    exact = _llm(target, num_kv_blocks=256)
    exact.engine.runner.sample_vocab_size = vocab
    probe = SamplingParams(max_tokens=1, temperature=0, logprobs=vocab, ignore_eos=True)
    prefixes = [()] + [(a,) for a in range(vocab)] + list(itertools.product(range(vocab), repeat=2))
    outs = exact.generate([prompt + list(p) for p in prefixes], probe)
    cond = {p: {t.token_id: math.exp(t.logprob) for t in o.outputs[0].logprobs[0].top_logprobs}
            for p, o in zip(prefixes, outs)}
    expected = {s: cond[()][s[0]] * cond[s[:1]][s[1]] * cond[s[:2]][s[2]]
                for s in itertools.product(range(vocab), repeat=3)}
    llm = _llm(target, other, num_kv_blocks=512, max_num_seqs=64, speculative_max_batch=64,
               check_invariants=False)
    llm.engine.runner.sample_vocab_size = vocab
    llm.engine.spec.proposer.runner.sample_vocab_size = vocab
    n = 1500
    out = llm.generate([prompt], SamplingParams(n=n, max_tokens=3, temperature=1.0,
                                                ignore_eos=True))[0]
    counts = Counter(tuple(c.token_ids) for c in out.outputs)
    stats = llm.engine.spec.stats
    assert stats.proposed_tokens > 300 and 0 < stats.accepted_tokens < stats.proposed_tokens
    stat, df = chi_square(counts, expected, n)
    assert stat < _chi2_critical(df), (stat, df)


def test_tokenizer_mismatch_is_a_clear_start_up_error(paths, tmp_path):
    target, other = paths
    odd = str(tmp_path / "odd")
    shutil.copytree(other, odd)
    tok_file = os.path.join(odd, "tokenizer.json")
    with open(tok_file) as f:
        tok = json.load(f)
    tok["added_tokens"].append({"id": 49152, "content": "<|odd|>", "single_word": False,
                                "lstrip": False, "rstrip": False, "normalized": False,
                                "special": True})
    with open(tok_file, "w") as f:
        json.dump(tok, f)
    with pytest.raises(ValueError, match="another tokenizer"):
        _llm(target, odd)


def test_the_draft_runs_compiled_decode_steps_like_the_target(paths, monkeypatch):
    """With compiled steps on, the draft model's runner compiles its decode step before the
    engine is ready and runs its k passes a step through it; greedy answers stay the
    target's own."""
    from llmserve.model.executor.compile import CompiledDecodeStep

    target, other = paths
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    ref = _llm(target, enforce_eager=True).generate(PROMPTS, params)
    llm = _llm(target, other, enforce_eager=False, max_num_seqs=8)
    draft = llm.engine.spec.proposer.runner
    assert draft.compiled is not None and draft.graphs_ready
    calls = Counter()
    call = CompiledDecodeStep.__call__

    def counted(self, staged):
        calls["draft" if self is draft.compiled else "target"] += 1
        return call(self, staged)

    monkeypatch.setattr(CompiledDecodeStep, "__call__", counted)
    got = llm.generate(PROMPTS, params)
    assert [g.outputs[0].token_ids for g in got] == [r.outputs[0].token_ids for r in ref]
    assert llm.engine.spec.stats.proposed_tokens > 0
    assert calls["draft"] > 0, calls

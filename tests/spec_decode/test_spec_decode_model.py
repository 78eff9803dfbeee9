"""Speculative decoding on a real (tiny, random) model, n-gram, suffix and draft-model
(the target's own weights at int8) proposers: greedy
outputs token-identical to decoding without speculation (mixed batches, penalties,
logprobs, preemption, prefix-cache hits), and sampled outputs that follow the target
distribution (chi-square against exact probabilities)."""
from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest

from llmserve import LLM, SamplingParams
from tests.model.tiny_checkpoints import make_tiny_checkpoint

# repetitive prompts: the n-gram proposer finds matches in them
PROMPTS = [[40, 41, 42, 43, 40, 41, 42, 43, 40, 41], [7, 8, 9] * 5, list(range(100, 117)),
           [55, 56, 55, 56, 55, 56, 57, 55, 56], [300 + (i * 7) % 11 for i in range(23)]]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_spec")), arch="llama",
                                num_heads=4, num_kv_heads=2, seed=5)


METHODS = ["ngram", "suffix", "draft"]


def _llm(path, spec, **kw):
    """``spec``: False, True (n-gram) or a method name. Speculating engines always draft
    (no adaptivity: the step-cost model may find drafts do not pay on this tiny model, and
    these tests are about what verification yields)."""
    args = dict(dtype="float32", num_kv_blocks=128, block_size=4, check_invariants=True)
    if spec:
        args.update(speculative_adaptive=False)
    if spec is True or spec == "ngram":
        args.update(speculative_method="ngram", num_speculative_tokens=4, ngram_min=1,
                    ngram_max=3)
    elif spec == "draft":   # a self-draft: the target's weights at int8 (mostly agree)
        args.update(speculative_method="draft", draft_model=path, draft_quantization="int8",
                    num_speculative_tokens=4)
    elif spec:
        args.update(speculative_method=spec, num_speculative_tokens=4)
    args.update(kw)
    return LLM(path, **args)


def _mixed_params():
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    return [greedy,
            SamplingParams(max_tokens=33, temperature=0, ignore_eos=True, logprobs=2),
            SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                           repetition_penalty=1.3, presence_penalty=0.2),
            greedy,
            SamplingParams(max_tokens=25, temperature=0, ignore_eos=True, min_tokens=20,
                           stop_token_ids=[43, 56])]


@pytest.mark.parametrize("method", METHODS)
def test_greedy_identical_with_speculation(tiny_path, method):
    params = _mixed_params()
    ref = _llm(tiny_path, spec=False).generate(PROMPTS, params)
    llm = _llm(tiny_path, spec=method)
    got = llm.generate(PROMPTS, params)
    for r, g in zip(ref, got):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        assert g.outputs[0].finish_reason == r.outputs[0].finish_reason
    lp_ref = [lp for lp in ref[1].outputs[0].logprobs]
    lp_got = [lp for lp in got[1].outputs[0].logprobs]
    assert [t.token_id for t in lp_got] == [t.token_id for t in lp_ref]
    assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(lp_got, lp_ref))
    assert [[x.token_id for x in t.top_logprobs] for t in lp_got] == \
        [[x.token_id for x in t.top_logprobs] for t in lp_ref]
    stats = llm.engine.spec.stats
    assert stats.accepted_tokens > 10, stats
    assert llm.engine.kv.num_used_blocks == 0


@pytest.mark.parametrize("method", METHODS)
def test_greedy_identical_through_preemption(tiny_path, method):
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in _llm(tiny_path, spec=False).generate(PROMPTS, params)]
    tight = _llm(tiny_path, spec=method, num_kv_blocks=30, max_num_batched_tokens=24)
    got = [o.outputs[0].token_ids for o in tight.generate(PROMPTS, params)]
    assert tight.get_stats().num_preemptions > 0
    assert tight.engine.spec.stats.accepted_tokens > 0
    assert got == ref


@pytest.mark.parametrize("method", METHODS)
def test_greedy_identical_after_prefix_cache_hits(tiny_path, method):
    """The second round reads its prompts from the prefix cache, and (suffix) drafts from
    the first round's answers in the global tree: the same tokens as without either."""
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in _llm(tiny_path, spec=False).generate(PROMPTS, params)]
    llm = _llm(tiny_path, spec=method, enable_prefix_caching=True)
    first = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    accepted = llm.engine.spec.stats.accepted_tokens
    second = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert first == ref and second == ref
    assert llm.get_stats().prefix_hit_tokens > 0
    gained = llm.engine.spec.stats.accepted_tokens - accepted
    assert gained > 0
    if method == "suffix":   # the answers repeat: most of the second round is drafted
        assert gained > 0.6 * sum(len(t) for t in ref), (gained, accepted)


def _chi2_critical(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.09: p = 0.001)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_square(counts: Counter, expected: dict, n: int) -> tuple[float, int]:
    """Pearson's statistic, bins with expected count < 5 merged into one; (stat, df)."""
    stat, df, low_obs, low_exp = 0.0, -1, 0, 0.0
    for key, p in expected.items():
        e = n * p
        if e < 5:
            low_obs += counts.get(key, 0)
            low_exp += e
            continue
        stat += (counts.get(key, 0) - e) ** 2 / e
        df += 1
    if low_exp > 0:
        stat += (low_obs - low_exp) ** 2 / max(low_exp, 1e-9)
        df += 1
    return stat, df


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_sampled_outputs_follow_the_target_distribution(tiny_path, method):
    """A 4-token vocabulary (the runner samples from the first 4 logits): the exact
    probability of every 3-token continuation against sampling with n-gram drafts. (A draft
    model proposes from its whole vocabulary: test_spec_draft_model.py has that case.)"""
    _check_target_distribution(tiny_path, method, {})


def test_sampled_outputs_follow_the_target_distribution_on_the_default_path(tmp_path):
    """The same on the default path's arithmetic: a Q4_1 GGUF kept packed, bf16 activations
    and KV, int8 activations in the products where the CPU has VNNI (eager steps: compiled
    ones give the same bits, tests/model/test_batch_invariance.py)."""
    from tests.model.tiny_checkpoints import make_tiny_gguf

    hf = make_tiny_checkpoint(str(tmp_path / "hf"), arch="llama", num_heads=4, num_kv_heads=2,
                              seed=5)
    path = make_tiny_gguf(hf, str(tmp_path / "tiny-q4_1.gguf"), quant="Q4_1", with_tokenizer=True)
    llm = _check_target_distribution(path, "suffix", dict(dtype="auto", quantization="auto"))
    from llmserve.model.native.ops import cpu_tier
    q = llm.engine.runner.quantization
    # packed, except on the none tier, where --dtype auto is float32 and auto dequantizes
    assert "int4" in q or (cpu_tier() == "none" and q.startswith("linear:dense")), q


def _check_target_distribution(path, method, settings):
    vocab = 4
    prompt = [0, 1, 3, 0, 1, 3, 0, 1]
    exact_llm = _llm(path, spec=False, num_kv_blocks=256, **settings)
    exact_llm.engine.runner.sample_vocab_size = vocab
    probe = SamplingParams(max_tokens=1, temperature=0, logprobs=vocab, ignore_eos=True)
    prefixes = [()] + [(a,) for a in range(vocab)] + list(itertools.product(range(vocab), repeat=2))
    outs = exact_llm.generate([prompt + list(p) for p in prefixes], probe)
    cond = {p: {t.token_id: math.exp(t.logprob) for t in o.outputs[0].logprobs[0].top_logprobs}
            for p, o in zip(prefixes, outs)}
    expected = {seq: cond[()][seq[0]] * cond[seq[:1]][seq[1]] * cond[seq[:2]][seq[2]]
                for seq in itertools.product(range(vocab), repeat=3)}
    assert abs(sum(expected.values()) - 1) < 1e-4

    llm = _llm(path, spec=method, num_kv_blocks=512, max_num_seqs=64,
               speculative_max_batch=64, check_invariants=False, **settings)
    llm.engine.runner.sample_vocab_size = vocab
    n = 2000
    params = SamplingParams(n=n, max_tokens=3, temperature=1.0, ignore_eos=True)
    out = llm.generate([prompt], params)[0]
    counts = Counter(tuple(c.token_ids) for c in out.outputs)
    stats = llm.engine.spec.stats
    assert stats.proposed_tokens > 500 and 0 < stats.accepted_tokens < stats.proposed_tokens
    stat, df = chi_square(counts, expected, n)
    assert stat < _chi2_critical(df), (stat, df, counts.most_common(8))
    return llm


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed-k", "adaptive"])
@pytest.mark.parametrize("method", METHODS)
def test_seeded_sampling_with_speculation_is_reproducible(tiny_path, method, adaptive):
    """A seeded request's tokens are the same alone and among other sampled requests; with
    the adaptive planner on too (its cost model, uniform steps and the prefill rule leave a
    seeded request's drafts to its own history)."""
    llm = _llm(tiny_path, spec=method, speculative_adaptive=adaptive)
    p = SamplingParams(max_tokens=20, temperature=0.8, top_k=20, seed=11, ignore_eos=True)
    alone = llm.generate([PROMPTS[1]], p)[0].outputs[0].token_ids
    others = [SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)] * 3
    mixed = llm.generate([PROMPTS[1]] + PROMPTS[2:5], [p] + others)[0].outputs[0].token_ids
    assert mixed == alone and len(alone) == 20

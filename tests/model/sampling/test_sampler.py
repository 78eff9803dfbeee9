"""Sampler tests: empirical distributions (chi-square), greedy, penalties, seeds, logprobs."""
from __future__ import annotations

import math

import pytest
import torch

from llmserve.model.sampling.sampler import Sampler, SamplingBatch
from llmserve.sampling_params import SamplingParams

N_DRAWS = 20_000
# Chi-square critical values at significance 0.001 by degrees of freedom (standard table).
# A correct sampler exceeds them with probability 0.1%; the draws are seeded, so no flakiness.
CHI2_CRIT_001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12}

# Probabilities placed at shuffled token ids so that "largest" is not simply "first".
BASE_PROBS = {2: 0.4, 0: 0.3, 4: 0.15, 1: 0.1, 3: 0.05}
BASE_LOGITS = [math.log(BASE_PROBS[i]) for i in range(5)]


def make_batch(params, vocab, prompts=None, outputs=None, generators=None, eos=()):
    b = len(params)
    return SamplingBatch.build(
        params=params,
        prompt_token_ids=prompts if prompts is not None else [[] for _ in range(b)],
        output_token_ids=outputs if outputs is not None else [[] for _ in range(b)],
        generators=generators if generators is not None else [None] * b,
        vocab_size=vocab,
        device="cpu",
        eos_token_ids=eos,
    )


def draw(logits_row, params, n=N_DRAWS, seed=0):
    """Sample n times from one row of logits (the row repeated as a batch of n)."""
    logits = torch.tensor([logits_row], dtype=torch.float32).expand(n, -1).contiguous()
    batch = make_batch([params] * n, logits.shape[1])
    return torch.tensor(Sampler(seed=seed)(logits, batch).token_ids)


def normalise(weights: dict[int, float]) -> dict[int, float]:
    total = sum(weights.values())
    return {k: v / total for k, v in weights.items()}


def assert_distribution(tokens: torch.Tensor, expected: dict[int, float], vocab: int) -> None:
    """Tokens outside `expected` never occur; counts inside fit `expected` (chi-square)."""
    counts = torch.bincount(tokens, minlength=vocab).tolist()
    n = len(tokens)
    outside = {t: c for t, c in enumerate(counts) if t not in expected and c}
    assert not outside, f"tokens sampled outside the allowed set: {outside}"
    chi2 = sum((counts[t] - n * p) ** 2 / (n * p) for t, p in expected.items())
    dof = len(expected) - 1
    if dof == 0:
        assert counts[next(iter(expected))] == n
        return
    assert chi2 < CHI2_CRIT_001[dof], f"chi2={chi2:.2f} (dof {dof}) {counts=} {expected=}"


def test_temperature_one_matches_softmax():
    assert_distribution(draw(BASE_LOGITS, SamplingParams(temperature=1.0)), BASE_PROBS, 5)


def test_temperature_sharpens_and_flattens():
    # logits / T = log(p) / T, so the distribution becomes p ** (1/T) renormalised.
    for temp in (0.5, 2.0):
        expected = normalise({t: p ** (1 / temp) for t, p in BASE_PROBS.items()})
        assert_distribution(draw(BASE_LOGITS, SamplingParams(temperature=temp)), expected, 5)


def test_top_k_keeps_k_most_likely():
    expected = normalise({2: 0.4, 0: 0.3, 4: 0.15})
    assert_distribution(draw(BASE_LOGITS, SamplingParams(top_k=3)), expected, 5)


def test_top_p_keeps_smallest_prefix_reaching_p():
    # 0.4 < 0.65, 0.4 + 0.3 = 0.7 >= 0.65: exactly the two most likely survive.
    expected = normalise({2: 0.4, 0: 0.3})
    assert_distribution(draw(BASE_LOGITS, SamplingParams(top_p=0.65)), expected, 5)
    # A tiny top_p still keeps the most likely token.
    assert_distribution(draw(BASE_LOGITS, SamplingParams(top_p=0.01)), {2: 1.0}, 5)


def test_min_p_drops_tokens_below_fraction_of_max():
    # threshold 0.3 * 0.4 = 0.12: 0.1 and 0.05 go.
    expected = normalise({2: 0.4, 0: 0.3, 4: 0.15})
    assert_distribution(draw(BASE_LOGITS, SamplingParams(min_p=0.3)), expected, 5)


def test_combined_filters_apply_in_documented_order():
    # T=2: weights sqrt(p) -> 0.632, 0.548, 0.387, 0.316, 0.224 (sum 2.107).
    # top_k=4 drops token 3; renormalised over 1.883: 0.336, 0.291, 0.206, 0.168.
    # top_p=0.7: masses before are 0, 0.336, 0.627, 0.833 -> tokens 2, 0, 4 survive.
    # min_p=0.62: token 4 has 0.387 / 0.632 = 0.61 of the top weight and goes; token 0 (0.87) stays.
    params = SamplingParams(temperature=2.0, top_k=4, top_p=0.7, min_p=0.62)
    expected = normalise({2: math.sqrt(0.4), 0: math.sqrt(0.3)})
    assert_distribution(draw(BASE_LOGITS, params), expected, 5)
    # Without min_p the third token survives top-p.
    params = SamplingParams(temperature=2.0, top_k=4, top_p=0.7)
    expected = normalise({2: math.sqrt(0.4), 0: math.sqrt(0.3), 4: math.sqrt(0.15)})
    assert_distribution(draw(BASE_LOGITS, params), expected, 5)


def test_rows_with_different_params_in_one_batch():
    half = N_DRAWS // 2
    logits = torch.tensor([BASE_LOGITS], dtype=torch.float32).expand(2 * half, -1).contiguous()
    params = [SamplingParams(top_k=2), SamplingParams(temperature=0.5, min_p=0.3)] * half
    out = torch.tensor(Sampler(seed=3)(logits, make_batch(params, 5)).token_ids)
    assert_distribution(out[0::2], normalise({2: 0.4, 0: 0.3}), 5)
    # T=0.5 squares p; min_p keeps p^2 >= 0.3 * 0.16: only tokens 2 and 0 (0.15^2 / 0.4^2 = 0.14).
    expected = normalise({2: 0.4**2, 0: 0.3**2})
    assert_distribution(out[1::2], expected, 5)


def test_topk_path_and_sort_path_agree_on_large_vocab():
    vocab = 64
    g = torch.Generator().manual_seed(7)
    row = (torch.randn(vocab, generator=g) * 2).tolist()
    top4 = sorted(range(vocab), key=lambda i: -row[i])[:4]
    expected = normalise({t: math.exp(row[t]) for t in top4})
    # All rows top-k only: the torch.topk path (k <= vocab / 4).
    assert_distribution(draw(row, SamplingParams(top_k=4)), expected, vocab)
    # Half the rows use top-p alone, which forces the full sort for the whole batch.
    half = N_DRAWS // 2
    logits = torch.tensor([row], dtype=torch.float32).expand(2 * half, -1).contiguous()
    params = [SamplingParams(top_k=4), SamplingParams(top_p=0.5)] * half
    out = torch.tensor(Sampler(seed=1)(logits, make_batch(params, vocab)).token_ids)
    assert_distribution(out[0::2], expected, vocab)


def reference_support(row: list[float], top_k: int, top_p: float) -> set[int]:
    """Tokens kept by top-k then top-p, computed from the definition in float64."""
    order = sorted(range(len(row)), key=lambda i: -row[i])[: top_k if top_k > 0 else len(row)]
    top = row[order[0]]
    weights = [math.exp(row[i] - top) for i in order]
    total = sum(weights)
    kept, mass = set(), 0.0
    for i, w in zip(order, weights):
        if mass >= top_p:
            break
        kept.add(i)
        mass += w / total
    return kept


def test_top_p_candidates_and_full_sort_fallback_match_definition():
    vocab = 4096  # 1024 candidates are a quarter of it: the torch.topk path
    g = torch.Generator().manual_seed(21)
    logits = torch.cat([
        torch.randn(3, vocab, generator=g) * 4,    # peaked: 0.9 of the mass in few tokens
        torch.randn(1, vocab, generator=g) * 0.1,  # flat: top-p needs most of the vocabulary
    ])
    params = [SamplingParams(top_p=0.9), SamplingParams(top_k=300, top_p=0.8),
              SamplingParams(), SamplingParams(top_p=0.9)]
    for rows in ([0, 1, 2], [0, 1, 2, 3]):  # without, then with a row that forces the sort
        batch = make_batch([params[r] for r in rows], vocab)
        filtered = Sampler.filter_logits(logits[rows], batch)
        for out_row, r in enumerate(rows):
            kept = set(torch.isfinite(filtered[out_row]).nonzero().flatten().tolist())
            p = params[r]
            assert kept == reference_support(logits[r].tolist(), p.top_k, p.top_p), (rows, r)
    assert len(kept) > 1024  # the flat row really needed more than the candidates


def test_all_equal_logits_are_uniform():
    expected = {t: 1 / 6 for t in range(6)}
    assert_distribution(draw([0.5] * 6, SamplingParams()), expected, 6)
    assert_distribution(draw([0.5] * 6, SamplingParams(top_k=100)), expected, 6)


def test_neg_inf_logits_are_never_sampled():
    row = [1.0, float("-inf"), 0.0, float("-inf"), -1.0]
    expected = normalise({0: math.e, 2: 1.0, 4: math.exp(-1)})
    assert_distribution(draw(row, SamplingParams()), expected, 5)
    hot = draw(row, SamplingParams(temperature=50.0))
    assert not bool(((hot == 1) | (hot == 3)).any())


def test_top_k_larger_than_vocab_is_no_filter():
    logits = torch.tensor([BASE_LOGITS] * 64)

    def run(top_k):
        gens = [torch.Generator().manual_seed(100 + i) for i in range(64)]
        batch = make_batch([SamplingParams(top_k=top_k, seed=1)] * 64, 5, generators=gens)
        return Sampler()(logits, batch).token_ids

    assert run(1000) == run(-1)
    assert len(set(run(1000))) > 1


def test_greedy_is_argmax_and_ignores_filters():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 100, generator=g)
    params = [SamplingParams(temperature=0.0, top_k=5, top_p=0.1, min_p=0.9)] * 16
    out = Sampler()(logits, make_batch(params, 100))
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs is None and out.top_logprobs is None


def test_greedy_and_sampled_rows_mixed():
    logits = torch.tensor([BASE_LOGITS] * 2000)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 1000
    out = torch.tensor(Sampler()(logits, make_batch(params, 5)).token_ids)
    assert bool((out[0::2] == 2).all())
    assert len(set(out[1::2].tolist())) == 5


def test_penalties_match_hand_computed_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    batch = make_batch([params], 5, prompts=[[0, 1]], outputs=[[3, 3, 1]])
    got = Sampler.process_logits(logits, batch)
    # token 0: prompt, positive: 2 / 2. token 1: seen, negative: -1 * 2, then output once:
    # -0.5 - 0.25. token 2: unseen. token 3: 3 / 2, twice in output: -1.0 - 0.25. token 4: unseen.
    expected = torch.tensor([[1.0, -2.75, 0.5, 0.25, -2.0]])
    torch.testing.assert_close(got, expected)
    # Frequency/presence ignore prompt tokens; repetition alone leaves counts unused.
    only_freq = make_batch([SamplingParams(frequency_penalty=1.0)], 5, prompts=[[4]], outputs=[[2]])
    assert only_freq.repetition_index is None and only_freq.count_index is not None
    torch.testing.assert_close(
        Sampler.process_logits(logits, only_freq), torch.tensor([[2.0, -1.0, -0.5, 3.0, -2.0]])
    )
    plain = make_batch([SamplingParams()], 5, prompts=[[0]], outputs=[[1]])
    assert not plain.needs_penalties


def test_penalties_change_greedy_choice_per_row():
    logits = torch.tensor([[2.0, 1.9, 0.0]] * 2)
    params = [SamplingParams(temperature=0.0, presence_penalty=0.5),
              SamplingParams(temperature=0.0)]
    batch = make_batch(params, 3, outputs=[[0], [0]])
    assert Sampler()(logits, batch).token_ids == [1, 0]


def seeded_run(seed, others, steps=20, vocab=50):
    """Tokens of a seeded row over several steps, placed at position len(others) // 2."""
    g = torch.Generator().manual_seed(1234)
    row_logits = torch.randn(vocab, generator=g)
    mine = SamplingParams(seed=seed, top_p=0.9)
    gen = torch.Generator().manual_seed(seed)
    pos = len(others) // 2
    params = others[:pos] + [mine] + others[pos:]
    gens = [None if p.seed is None else torch.Generator().manual_seed(p.seed) for p in params]
    gens[pos] = gen
    sampler = Sampler(seed=99)
    tokens = []
    for _ in range(steps):
        logits = torch.randn(len(params), vocab, generator=g)
        logits[pos] = row_logits
        out = sampler(logits, make_batch(params, vocab, generators=gens))
        tokens.append(out.token_ids[pos])
    return tokens


def test_seeded_row_independent_of_batch():
    alone = seeded_run(42, [])
    others = [SamplingParams(), SamplingParams(seed=7, top_k=3), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.3, min_p=0.2)]
    assert seeded_run(42, others) == alone
    assert seeded_run(42, others[:1]) == alone
    assert seeded_run(43, others) != alone


def test_unseeded_rows_reproducible_from_sampler_seed():
    logits = torch.randn(256, 50, generator=torch.Generator().manual_seed(5))
    batch = make_batch([SamplingParams()] * 256, 50)
    assert Sampler(seed=1)(logits, batch).token_ids == Sampler(seed=1)(logits, batch).token_ids
    assert Sampler(seed=1)(logits, batch).token_ids != Sampler(seed=2)(logits, batch).token_ids


def test_min_tokens_masks_eos_and_stop_tokens():
    logits = torch.tensor([[0.0, 1.0, 9.0, 2.0, 0.5, 8.0]] * 4)  # EOS=2 best, stop id 5 next
    params = [
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5]),
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5], ignore_eos=True),
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5]),
        SamplingParams(temperature=0.0, stop_token_ids=[5]),
    ]
    outputs = [[7], [7], [7, 7, 7], []]
    out = Sampler()(logits, make_batch(params, 6, outputs=outputs, eos={2}))
    assert out.token_ids == [3, 3, 2, 2]
    rows = 2000
    batch = make_batch([SamplingParams(min_tokens=2, stop_token_ids=[5])] * rows, 6,
                       outputs=[[1]] * rows, eos={2})
    logits = torch.tensor([[0.0, 1.0, 9.0, 2.0, 0.5, 8.0]] * rows)
    drawn = torch.tensor(Sampler()(logits, batch).token_ids)
    assert not bool(((drawn == 2) | (drawn == 5)).any())


def test_rows_without_finite_logits_raise():
    ninf = float("-inf")
    logits = torch.tensor([[0.0, 1.0, 2.0], [ninf, ninf, ninf]])
    batch = make_batch([SamplingParams(), SamplingParams()], 3)
    with pytest.raises(RuntimeError, match=r"rows \[1\]"):
        Sampler()(logits, batch)
    with pytest.raises(RuntimeError, match="NaN or all -inf"):
        nan_row = torch.tensor([[0.0, float("nan"), 1.0]])
        Sampler()(nan_row, make_batch([SamplingParams(temperature=0.0)], 3))
    only_eos = torch.tensor([[ninf, 3.0, ninf]])
    batch = make_batch([SamplingParams(min_tokens=1)], 3, eos={1})
    with pytest.raises(RuntimeError):
        Sampler()(only_eos, batch)


def test_logprobs_are_raw_log_softmax_and_top_n_sorted():
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(4, 30, generator=g)
    original = logits.clone()
    params = [
        SamplingParams(logprobs=5, temperature=0.7, repetition_penalty=1.5, top_k=3),
        SamplingParams(),
        SamplingParams(logprobs=0, temperature=0.0, presence_penalty=1.0),
        SamplingParams(logprobs=2, seed=3),
    ]
    gens = [None, None, None, torch.Generator().manual_seed(3)]
    batch = make_batch(params, 30, prompts=[[1, 2, 3]] * 4, outputs=[[4, 5]] * 4, generators=gens)
    out = Sampler()(logits, batch)
    torch.testing.assert_close(logits, original)  # input untouched
    ref = torch.log_softmax(original, dim=-1)
    for row, tok in enumerate(out.token_ids):
        assert out.logprobs[row] == pytest.approx(ref[row, tok].item(), abs=1e-6)
    assert [len(t) for t in out.top_logprobs] == [5, 0, 0, 2]
    for row in (0, 3):
        top = out.top_logprobs[row]
        values = [v for _, v in top]
        assert values == sorted(values, reverse=True)
        ref_vals, ref_ids = ref[row].topk(len(top))
        assert [t for t, _ in top] == ref_ids.tolist()
        assert values == pytest.approx(ref_vals.tolist(), abs=1e-6)


def test_logprobs_request_larger_than_vocab_and_bf16_logits():
    logits = torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.bfloat16)
    out = Sampler()(logits, make_batch([SamplingParams(logprobs=20, temperature=0.0)], 3))
    assert out.token_ids == [2]
    assert [t for t, _ in out.top_logprobs[0]] == [2, 1, 0]


def test_build_and_call_validate_shapes():
    with pytest.raises(ValueError, match="same length"):
        SamplingBatch.build([SamplingParams()], [[]], [[], []], [None], 5, "cpu", ())
    with pytest.raises(ValueError, match="no rows"):
        SamplingBatch.build([], [], [], [], 5, "cpu", ())
    with pytest.raises(ValueError, match="does not match"):
        Sampler()(torch.zeros(2, 5), make_batch([SamplingParams()], 5))
    with pytest.raises(ValueError, match="token ids"):
        make_batch([SamplingParams(repetition_penalty=1.2)], 5, prompts=[[9]])


@pytest.mark.parametrize("vocab", [4096, 5000, 49152, 8193])
def test_row_max_is_max_with_the_first_index_of_ties(vocab):
    """The chunked argmax of wide rows: the same values and first indices as ``max(dim=-1)``
    with ties inside and across chunks, a maximum only in the tail, all -inf rows, NaN rows
    and a column slice of a wider tensor (the sampled vocabulary of a padded head)."""
    from llmserve.model.sampling.sampler import row_max

    gen = torch.Generator().manual_seed(vocab)
    for trial in range(40):
        x = torch.randint(-3, 3, (6, vocab + 7), generator=gen).float()[:, :vocab]
        x[1] = float("-inf")
        x[2, vocab - 1] = 9.0                          # the tail (or the last chunk)
        x[3, 5] = x[3, 3000] = 9.0                     # a tie across chunks: the first wins
        if trial % 2:
            x[4, trial * 13] = float("nan")
        values, index = row_max(x)
        ref_values, ref_index = x.max(dim=-1)
        assert torch.equal(values.isnan(), ref_values.isnan())
        ok = ~ref_values.isnan()
        assert torch.equal(values[ok], ref_values[ok])
        assert torch.equal(index[ok], ref_index[ok]), trial
        assert index[3] == 5


def test_row_logsumexp_sums_a_row_the_same_alone_and_in_any_batch():
    """A wide row's log-sum-exp has the same bits alone as in a batch (PyTorch splits one
    row's sum between threads, so a seeded top-p draw depended on its batch), and equals
    torch.logsumexp up to float rounding; rows of -inf give -inf."""
    from llmserve.model.sampling.sampler import row_logsumexp

    gen = torch.Generator().manual_seed(0)
    for vocab in (49152, 50000, 1000):
        x = torch.randn(9, vocab, generator=gen) * 3
        x[4] = float("-inf")
        x[5, : vocab // 2] = float("-inf")
        batch = row_logsumexp(x)
        for i in range(9):
            assert torch.equal(row_logsumexp(x[i:i + 1]), batch[i:i + 1]), (vocab, i)
        assert torch.equal(row_logsumexp(x[2:7]), batch[2:7])
        assert batch[4].item() == float("-inf")
        finite = torch.isfinite(batch)
        torch.testing.assert_close(batch[finite], torch.logsumexp(x, dim=-1)[finite],
                                   rtol=1e-6, atol=1e-5)

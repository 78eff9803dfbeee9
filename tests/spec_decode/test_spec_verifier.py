"""The speculative verifier alone, on synthetic logits: greedy acceptance, and rejection
sampling whose output follows the filtered target distribution (chi-square) for one-hot
drafts (n-gram) and for a draft model's distributions, with penalties and filters."""
from __future__ import annotations

import pytest
import torch

from llmserve.engine.step_types import SequenceSampling, StepInput
from llmserve.model.sampling.sampler import Sampler, SamplingBatch
from llmserve.sampling_params import SamplingParams
from llmserve.spec_decode.verifier import verify_drafts

N = 20_000
VOCAB = 6
CHI2_CRIT_001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}


def make_step(drafts_per_seq, params, output=(5,), draft_probs=None):
    step = StepInput()
    for i, drafts in enumerate(drafts_per_seq):
        samp = SequenceSampling(params, [1, 2], list(output))
        if draft_probs is not None:
            samp.draft_probs = draft_probs[i]
        step.add(f"s{i}", [3] + list(drafts), 10, [0], 1 + len(drafts), samp)
    return step


def target_probs(row_logits, params, output, drafts):
    """Row j's distribution as the sampler would build it with drafts[:j] already output."""
    rows = []
    for j, logits in enumerate(row_logits):
        batch = SamplingBatch.build([params], [[1, 2]], [list(output) + list(drafts[:j])],
                                    [None], VOCAB, "cpu")
        x = Sampler.filter_logits(Sampler.process_logits(logits.unsqueeze(0), batch), batch)
        rows.append(torch.softmax(x, dim=-1)[0])
    return rows


def chi2(samples: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    counts = torch.bincount(samples, minlength=VOCAB).double()
    exp = probs.double() * samples.numel()
    keep = exp > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    return float(((counts[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1


def test_greedy_accepts_the_argmax_prefix():
    logits = torch.full((3 * 3, VOCAB), -1.0)
    best = [[4, 1, 2], [4, 0, 2], [0, 0, 0]]
    for s, row in enumerate(best):
        for j, t in enumerate(row):
            logits[3 * s + j, t] = 3.0
    params = SamplingParams(temperature=0)
    step = make_step([[4, 1], [4, 1], [4, 1]], params)
    tokens, lps, tops = verify_drafts(logits, step, [0, 1, 2], [None] * 3, Sampler())
    assert tokens == [[4, 1, 2], [4, 0], [0]]
    assert lps is None and tops is None


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.9),
    SamplingParams(temperature=1.3, top_k=4, top_p=0.85, repetition_penalty=1.5,
                   frequency_penalty=0.3),
    SamplingParams(temperature=0.7, min_p=0.1, presence_penalty=0.5),
])
def test_one_hot_drafts_follow_the_target(params):
    gen = torch.Generator().manual_seed(1)
    row_logits = torch.randn(3, VOCAB, generator=gen) * 1.5
    drafts = []   # each draft: the second most likely token where it is proposed
    for j in range(2):
        drafts.append(int(target_probs(row_logits, params, (5,), drafts)[j].argsort()[-2]))
    p = target_probs(row_logits, params, (5,), drafts)
    logits = row_logits.repeat(N, 1)
    step = make_step([drafts] * N, params)
    tokens, _, _ = verify_drafts(logits, step, list(range(N)), [None] * N, Sampler(seed=3))
    t = torch.tensor([x + [-1] * (3 - len(x)) for x in tokens])
    for j in range(3):   # position j given that every earlier draft was accepted
        given = torch.ones(N, dtype=torch.bool)
        for i in range(j):
            given &= t[:, i] == drafts[i]
        stat, df = chi2(t[given, j], p[j])
        assert stat < CHI2_CRIT_001[df], (j, stat, df)
        assert int(given.sum()) > 500
    assert ((t[:, 0] == drafts[0]).float().mean() - p[0][drafts[0]]).abs() < 0.02


def test_draft_model_distributions_follow_the_target():
    params = SamplingParams(temperature=1.0, top_k=5)
    gen = torch.Generator().manual_seed(7)
    row_logits = torch.randn(3, VOCAB, generator=gen)
    q = torch.softmax(torch.randn(2, VOCAB, generator=gen) * 2, dim=-1)
    drafts = torch.stack([torch.multinomial(q[j], N, replacement=True, generator=gen)
                          for j in range(2)], dim=1).tolist()
    # in this synthetic model row j's logits do not depend on the drafts before it
    plain = SamplingParams(temperature=1.0, top_k=5)
    p = target_probs(row_logits, plain, (5,), [0, 0])
    step = make_step(drafts, params, draft_probs=[q] * N)
    tokens, _, _ = verify_drafts(row_logits.repeat(N, 1), step, list(range(N)), [None] * N,
                                 Sampler(seed=5))
    first = torch.tensor([x[0] for x in tokens])
    stat, df = chi2(first, p[0])
    assert stat < CHI2_CRIT_001[df], stat
    second = torch.tensor([x[1] for x in tokens if len(x) > 1])
    stat, df = chi2(second, p[1])
    assert stat < CHI2_CRIT_001[df], stat
    assert 0.2 < len(second) / N < 0.95   # acceptance happens, and rejection too


def test_seeded_sequences_ignore_the_batch():
    params = SamplingParams(temperature=1.0, seed=4)
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(2))
    one = verify_drafts(logits, make_step([[1, 2]], params), [0],
                        [torch.Generator().manual_seed(4)], Sampler(seed=0))[0]
    other = SamplingParams(temperature=1.0)
    step = make_step([[1, 2]], params)
    step2 = make_step([[3]], other)
    step.add("x", [3, 3], 10, [0], 2, step2.sampling[0])
    both = verify_drafts(torch.cat([logits, logits[:2]]), step, [0, 1],
                         [torch.Generator().manual_seed(4), None], Sampler(seed=9))[0]
    assert both[0] == one[0]


def test_all_masked_row_raises_and_restores_seeded_generators():
    params = SamplingParams(temperature=1.0, seed=1)
    logits = torch.full((2, VOCAB), float("-inf"))
    g = torch.Generator().manual_seed(1)
    state = g.get_state()
    with pytest.raises(RuntimeError, match="NaN or all -inf"):
        verify_drafts(logits, make_step([[1]], params), [0], [g], Sampler())
    assert torch.equal(g.get_state(), state)

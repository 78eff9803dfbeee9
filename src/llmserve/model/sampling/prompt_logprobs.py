"""Logprobs of prompt tokens (``prompt_logprobs``, /v1/completions ``echo`` + ``logprobs``).

For a prefill chunk of a request that asks, the logits of the chunk's positions are
computed (only those rows of the hidden states), log-softmaxed in float32 (the raw model
distribution, like sampled-token logprobs), and each position's next prompt token is
gathered with one ``gather`` and one ``topk`` over the chunk; no loop over tokens.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch


def score_prompt_tokens(model: Any, hidden: torch.Tensor, row_starts: Sequence[int],
                        order: Sequence[int], step: Any) -> dict[str, tuple[int, list]]:
    """request id -> (first prompt position scored, [(logprob, [(token, logprob)])]).

    ``hidden``: the step's hidden states (runner row order); ``row_starts[pos]``: the first
    row of the sequence at runner position ``pos``; ``order[pos]``: its StepInput index.
    """
    out: dict[str, tuple[int, list]] = {}
    for pos, i in enumerate(order):
        rid = step.request_ids[i]
        want = step.prompt_logprob_targets.get(rid)
        if want is None or not want[1]:
            continue
        k, targets = want
        r0 = row_starts[pos]
        rows = hidden[r0:r0 + len(targets)]
        logprobs = torch.log_softmax(model.compute_logits(rows).float(), dim=-1)
        index = torch.tensor(targets, dtype=torch.int64, device=logprobs.device)
        chosen = logprobs.gather(1, index.unsqueeze(1)).squeeze(1).tolist()
        if k > 0:
            values, ids = logprobs.topk(min(k, logprobs.shape[1]), dim=-1)
            tops = [list(zip(t, v)) for t, v in zip(ids.tolist(), values.tolist())]
        else:
            tops = [[] for _ in targets]
        out[rid] = (step.start_positions[i] + 1, list(zip(chosen, tops)))
    return out

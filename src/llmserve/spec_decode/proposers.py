"""Speculative-decoding proposers: cheap guesses at a sequence's next tokens (no torch).

A proposer looks at running sequences and proposes up to ``k`` draft tokens for each; the
target model then scores all ``k + 1`` positions in one step and keeps the longest prefix
its own sampling agrees with (spec_decode/verifier.py). Proposals never change a request's
tokens: they live in ``Request.spec_token_ids`` until verified.

Two proposers live here, both deterministic (their draft distribution is one-hot):

* :class:`NgramProposer`: prompt-lookup decoding. The last ``n`` tokens (``n`` from
  ``ngram_max`` down to ``ngram_min``) are looked up among the sequence's earlier tokens
  (prompt and output) and what followed their latest occurrence is proposed. An
  :class:`NgramIndex` per sequence maps every n-gram to its latest end position and grows
  by O(ngram_max - ngram_min + 1) dictionary writes per new token, so a lookup is O(1)
  and the whole index costs O(tokens) per sequence.
* predictions (OpenAI Predicted Outputs): a request's predicted text is indexed the same
  way and matched first, so a prediction that is mostly right is replayed token by token.

A draft *model* proposer (spec_decode/draft_model.py) implements the same interface.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

from llmserve.engine.request import Request


@dataclass
class Proposal:
    """Draft tokens for one sequence.

    ``draft_probs``: the draft model's distributions the tokens were sampled from (an
    opaque runner-side ``[k, vocab]`` object), None for a deterministic draft (q one-hot).
    ``from_prediction``: the tokens come from the request's predicted output.
    """

    token_ids: list[int]
    draft_probs: object = None
    from_prediction: bool = False


EMPTY = Proposal([])


class Proposer(Protocol):
    """Proposes up to ``num_tokens[i]`` draft tokens for ``requests[i]`` (all decoding)."""

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]
                ) -> list[Proposal]: ...

    # optional: ``release(request_id)``, called when a request ends; ``confident_drafts``
    # (True: a draft is only what the proposer's counts make likely, so a request whose
    # drafts were rejected does not back off: decoder.py, "Adaptive k")


class NgramIndex:
    """The latest end position of every n-gram (``n_min <= n <= n_max``) of a growing token
    list, for n-grams that something follows (those ending before the last token).

    ``extend(tokens)`` indexes whatever was appended since the last call; ``tokens`` must
    only ever grow (a request's ``all_token_ids`` does).
    """

    __slots__ = ("n_min", "n_max", "tables", "num_indexed")

    def __init__(self, n_min: int, n_max: int) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {n_min}, {n_max}")
        self.n_min = n_min
        self.n_max = n_max
        self.tables: list[dict[tuple[int, ...], int]] = [{} for _ in range(n_min, n_max + 1)]
        self.num_indexed = 0   # n-grams ending at positions < num_indexed are in the tables

    def extend(self, tokens: Sequence[int], include_last: bool = False) -> None:
        """Index the n-grams ending at new positions (all but the last token's unless
        ``include_last``: a sequence's own suffix must not find itself)."""
        end = len(tokens) if include_last else len(tokens) - 1
        n_min, tables = self.n_min, self.tables
        for e in range(self.num_indexed, end):
            for j, table in enumerate(tables):
                n = n_min + j
                if e + 1 < n:
                    break
                table[tuple(tokens[e + 1 - n:e + 1])] = e
        self.num_indexed = max(self.num_indexed, end)

    def match(self, suffix_source: Sequence[int]) -> Optional[int]:
        """End position of the latest indexed occurrence of the longest suffix of
        ``suffix_source`` (n from n_max down to n_min), or None."""
        size = len(suffix_source)
        for j in range(len(self.tables) - 1, -1, -1):
            n = self.n_min + j
            if size < n:
                continue
            pos = self.tables[j].get(tuple(suffix_source[size - n:]))
            if pos is not None:
                return pos
        return None


class NgramProposer:
    """Prompt-lookup decoding over each request's own tokens, predictions first."""

    def __init__(self, ngram_min: int = 1, ngram_max: int = 4, use_history: bool = True) -> None:
        NgramIndex(ngram_min, ngram_max)  # validates the range
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.use_history = use_history   # False: only requests with a prediction speculate

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]
                ) -> list[Proposal]:
        out = []
        for req, k in zip(requests, num_tokens):
            out.append(self._propose_one(req, k) if k > 0 else EMPTY)
        return out

    def _propose_one(self, req: Request, k: int) -> Proposal:
        state = req.spec_state   # a SpecState (spec_decode/decoder.py): it owns the index
        prediction = getattr(state, "prediction", None)
        if prediction is not None:
            proposal = self._from_prediction(req, prediction, k)
            if proposal is not None:
                return proposal
        if not self.use_history or state is None:
            return EMPTY
        index = state.ngram_index
        if index is None:
            index = state.ngram_index = NgramIndex(self.ngram_min, self.ngram_max)
        tokens = req.all_token_ids
        index.extend(tokens)
        pos = index.match(tokens)
        if pos is None:
            return EMPTY
        return Proposal(tokens[pos + 1:pos + 1 + k])

    def _from_prediction(self, req: Request, prediction: "PredictionState", k: int
                         ) -> Optional[Proposal]:
        tokens = prediction.token_ids
        if req.num_output_tokens == 0:
            draft = tokens[:k]
        else:
            pos = prediction.index.match(req.all_token_ids)
            if pos is None:
                return None
            draft = tokens[pos + 1:pos + 1 + k]
        return Proposal(list(draft), from_prediction=True) if draft else None


class PredictionState:
    """A request's predicted output, indexed for lookup (built once, when it arrives)."""

    __slots__ = ("token_ids", "index")

    def __init__(self, token_ids: Sequence[int], ngram_min: int, ngram_max: int) -> None:
        self.token_ids = list(token_ids)
        self.index = NgramIndex(ngram_min, ngram_max)
        self.index.extend(self.token_ids, include_last=True)

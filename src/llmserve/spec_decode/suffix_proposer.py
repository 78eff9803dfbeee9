"""Suffix decoding (``--speculative-method suffix``): drafts from what followed the current
suffix of a sequence before, in its own prompt and output or in recent requests' outputs
(no torch, no draft model).

Two :class:`~llmserve.spec_decode.suffix_tree.SuffixTree` s of depth ``max_depth``:

* **per request**, over its prompt and generated tokens, grown by the tokens appended
  since its last step (O(new tokens * live suffixes));
* **global**, over the outputs of recent finished requests (agent loops re-emit earlier
  answers, tool calls, code), bounded to ``cache_max_nodes`` nodes by evicting whole
  requests, least recently inserted or drafted from first. Each live request keeps a
  :class:`GlobalCursor`: the nodes its current suffixes reach in the global tree, moved
  by each new token (O(new tokens * cursors)).

A draft starts at one of the nodes the sequence's suffixes reach (a match of length
``node.depth``) and follows the most frequent continuation while its *confidence* (the
product of each step's share: the chosen child's count over all continuations seen there)
stays at or above ``min_confidence``; a path seen once continues with share 1. Every
match of the two trees is scored by its expected accepted tokens (the sum of the
confidences of its draft prefixes) and the best one is proposed, longest match on ties.
A draft is at most ``MAX_SPEC_FACTOR`` times its match length, so a one-token match never
proposes a long guess. A seeded request drafts from its own tokens only: its samples
depend on its drafts, and must not depend on which requests ran before it. Proposing costs O(live matches * k), never a pass over the context.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Optional, Sequence

from llmserve.engine.request import Request
from llmserve.spec_decode.proposers import EMPTY, Proposal
from llmserve.spec_decode.suffix_tree import Node, SuffixTree

logger = logging.getLogger(__name__)

MAX_SPEC_FACTOR = 1.0      # draft length <= factor * match length (+ MIN_DRAFT)
MIN_DRAFT = 1


class GlobalCursor:
    """Where a sequence's current suffixes reach in the global tree, as
    ``(start, node, extra)``: the suffix from ``start`` matches the path to ``node`` and
    ``extra`` more tokens along its compressed tail. Read-only: it never counts."""

    __slots__ = ("matches", "num_seen")

    def __init__(self) -> None:
        self.matches: list[tuple[int, Node, int]] = []
        self.num_seen = 0

    def advance(self, tree: SuffixTree, tokens: Sequence[int]) -> None:
        """Move by the tokens appended since the last call."""
        root, max_depth = tree.root, tree.max_depth
        matches = self.matches
        for pos in range(self.num_seen, len(tokens)):
            token = tokens[pos]
            moved: list[tuple[int, Node, int]] = []
            for start, node, extra in matches + [(pos, root, 0)]:
                if node.count <= 0 and node is not root:
                    continue                      # evicted
                if extra and node.tail is None:   # expanded since: walk the spelled-out path
                    found = _walk(node, tokens[start + node.depth:start + node.depth + extra])
                    if found is None:
                        continue
                    node, extra = found
                step = _step(node, extra, token)
                if step is not None and step[0].depth + step[1] < max_depth:
                    moved.append((start, step[0], step[1]))
            matches = moved
        self.matches = matches
        self.num_seen = len(tokens)


def _step(node: Node, extra: int, token: int) -> Optional[tuple[Node, int]]:
    if not extra:
        child = node.child(token)
        if child is not None and child.count > 0:
            return child, 0
    if node.tail_token(extra) == token:
        return node, extra + 1
    return None


def _walk(node: Node, tokens: Sequence[int]) -> Optional[tuple[Node, int]]:
    extra = 0
    for token in tokens:
        step = _step(node, extra, token)
        if step is None:
            return None
        node, extra = step
    return node, extra


def draft_from(node: Node, extra: int, k: int, min_confidence: float
               ) -> tuple[list[int], float]:
    """Up to ``k`` tokens following the path to ``node`` (+ ``extra`` tail tokens) and
    their score (expected accepted tokens: the sum of each prefix's confidence)."""
    out: list[int] = []
    confidence, score = 1.0, 0.0
    while len(out) < k:
        if node.tail is not None:       # seen once: its continuation, share 1 each
            tail, pos = node.tail, node.tail_start + node.depth + extra
            taken = tail[pos:pos + k - len(out)]
            out.extend(taken)
            score += confidence * len(taken)
            break
        if extra or node.cont <= 0 or node.children is None:
            break
        child = node.children.get(node.best)
        if child is None:
            break
        confidence *= child.count / node.cont
        if confidence < min_confidence:
            break
        out.append(node.best)
        score += confidence
        node = child
    return out, score


class _RequestIndex:
    """A live request's suffix tree over its own tokens and its cursor in the global one."""

    __slots__ = ("tokens", "num_prompt", "tree", "cursor")

    def __init__(self, req: Request, max_depth: int) -> None:
        self.tokens = req.all_token_ids
        self.num_prompt = req.num_prompt_tokens
        self.tree = SuffixTree(max_depth)
        self.cursor = GlobalCursor()


class SuffixProposer:
    """Suffix decoding over each request's own tokens and recent requests' outputs."""

    #: each draft token comes with its share among the tree's continuations (Proposer)
    confident_drafts = True

    def __init__(self, max_depth: int = 32, min_confidence: float = 0.1,
                 cache_max_nodes: int = 200_000) -> None:
        if not 0.0 <= min_confidence <= 1.0:
            raise ValueError(f"suffix min_confidence must be in [0, 1], got {min_confidence}")
        if cache_max_nodes < 0:
            raise ValueError(f"suffix cache_max_nodes must be >= 0, got {cache_max_nodes}")
        self.max_depth = max_depth
        self.min_confidence = min_confidence
        self.cache_max_nodes = cache_max_nodes
        self.global_tree = SuffixTree(max_depth)
        self._cached: OrderedDict[int, list[int]] = OrderedDict()   # id -> output tokens
        self._requests: dict[str, _RequestIndex] = {}

    @property
    def num_cached_requests(self) -> int:
        """Finished requests whose outputs the global tree holds."""
        return len(self._cached)

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]
                ) -> list[Proposal]:
        return [self._propose_one(r, k) if k > 0 else EMPTY
                for r, k in zip(requests, num_tokens)]

    def track(self, requests: Sequence[Request]) -> None:
        """Follow ``requests`` without proposing: their outputs join the global tree when
        they end even if nothing was ever drafted for them (drafting was off)."""
        for req in requests:
            self._index(req)

    def _index(self, req: Request) -> _RequestIndex:
        index = self._requests.get(req.request_id)
        if index is None or index.tokens is not req.all_token_ids:
            index = self._requests[req.request_id] = _RequestIndex(req, self.max_depth)
        return index

    def _propose_one(self, req: Request, k: int) -> Proposal:
        index = self._index(req)
        tokens = index.tokens
        live = index.tree.extend(tokens)
        best: list[int] = []
        best_score = 0.0
        source: Optional[list[int]] = None
        for _, node in live:     # longest match first: ties keep the longer one
            draft, score = draft_from(node, 0, self._cap(k, node.depth),
                                      self.min_confidence)
            if score > best_score:
                best, best_score = draft, score
        if self._cached and req.sampling_params.seed is None:
            index.cursor.advance(self.global_tree, tokens)
            for _, node, extra in index.cursor.matches:
                draft, score = draft_from(node, extra, self._cap(k, node.depth + extra),
                                          self.min_confidence)
                if score > best_score:
                    best, best_score, source = draft, score, node.tail
        if source is not None and id(source) in self._cached:
            self._cached.move_to_end(id(source))     # drafted from: recently used
        return Proposal(best) if best else EMPTY

    @staticmethod
    def _cap(k: int, match_len: int) -> int:
        return min(k, max(MIN_DRAFT, int(MAX_SPEC_FACTOR * match_len)))

    def release(self, request_id: str) -> None:
        """A request ended: its output joins the global tree (oldest evicted past the cap)."""
        index = self._requests.pop(request_id, None)
        if index is None or self.cache_max_nodes == 0:
            return
        output = list(index.tokens[index.num_prompt:])
        if len(output) < 2:
            return
        tree = self.global_tree
        tree.extend(output)
        tree.finish(output)
        self._cached[id(output)] = output
        while tree.num_nodes > self.cache_max_nodes and self._cached:
            _, oldest = self._cached.popitem(last=False)
            tree.remove(oldest)

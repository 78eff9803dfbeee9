"""The suffix tree and the suffix-decoding proposer (no torch): counts against a brute
force, incremental growth, compressed leaves, eviction, drafts by frequency and confidence,
the global tree over finished requests' outputs."""
from __future__ import annotations

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from llmserve.engine.request import Request
from llmserve.sampling_params import SamplingParams
from llmserve.spec_decode.suffix_proposer import SuffixProposer, draft_from
from llmserve.spec_decode.suffix_tree import Node, SuffixTree


def _spelled(tree: SuffixTree) -> Counter:
    """Every substring the tree holds with its count, compressed tails spelled out."""
    out: Counter = Counter()

    def visit(node: Node, path: tuple) -> None:
        if node is not tree.root:
            out[path] += node.count
        if node.tail is not None:
            pos = node.tail_start + node.depth
            for extra in range(len(node.tail[pos:node.tail_start + tree.max_depth])):
                out[path + tuple(node.tail[pos:pos + extra + 1])] += 1
            return
        assert node.cont == sum(c.count for c in (node.children or {}).values())
        if node.children:
            assert node.children[node.best].count == max(c.count for c in node.children.values())
        for tok, child in (node.children or {}).items():
            visit(child, path + (tok,))

    visit(tree.root, ())
    return out


def _brute(seqs, depth: int) -> Counter:
    out: Counter = Counter()
    for s in seqs:
        for i in range(len(s)):
            for j in range(i + 1, min(len(s), i + depth) + 1):
                out[tuple(s[i:j])] += 1
    return out


def _grow(tree: SuffixTree, seq: list[int], chunks: list[int]) -> list[int]:
    tokens: list[int] = []
    pos = 0
    for n in chunks:
        tokens.extend(seq[pos:pos + n])
        pos += n
        tree.extend(tokens)
    tokens.extend(seq[pos:])
    tree.extend(tokens)
    return tokens


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=40), min_size=1, max_size=4),
       st.integers(2, 7), st.lists(st.integers(1, 5), max_size=8), st.integers(0, 3))
def test_counts_match_brute_force_through_growth_and_removal(seqs, depth, chunks, drop):
    tree = SuffixTree(depth)
    lists = [_grow(tree, s, chunks) for s in seqs]
    for t in lists:
        tree.finish(t)
    assert _spelled(tree) == _brute(seqs, depth)
    kept = [s for i, s in enumerate(lists) if i != drop]
    if drop < len(lists):
        tree.remove(lists[drop])
    assert _spelled(tree) == _brute(kept, depth)
    for t in kept:
        tree.remove(t)
    assert tree.num_nodes == 0 and not tree.root.children


def test_random_text_stays_compressed():
    rng = random.Random(0)
    tokens = [rng.randrange(5000) for _ in range(4000)]
    tree = SuffixTree(32)
    tree.extend(tokens)
    assert tree.num_nodes < 2 * len(tokens)          # not tokens * depth


def test_live_suffixes_are_the_matches_of_the_current_suffix():
    tree = SuffixTree(8)
    tokens = [1, 2, 3, 4, 9, 1, 2, 3]
    live = tree.extend(tokens)
    # (1, 2, 3) occurred before; so did (2, 3) and (3,): longest first
    assert [n.depth for _, n in live] == [3, 2, 1]
    draft, score = draft_from(live[0][1], 0, 4, 0.1)
    assert draft == [4, 9, 1, 2] and score == 4.0


def test_draft_follows_the_most_frequent_continuation_within_confidence():
    tree = SuffixTree(8)
    tokens = [5, 1, 5, 1, 5, 1, 5, 2, 5, 3, 5]
    live = tree.extend(tokens)
    node = live[-1][1]      # (5,): followed by 1 three times, 2 once, 3 once
    draft, _ = draft_from(node, 0, 3, 0.5)
    assert draft == [1, 5]      # 1 is 3/5 of what follows 5, then 5 always; (5, 1, 5) -> 1 is 2/3
    assert draft_from(node, 0, 3, 0.7)[0] == []


def _req(rid, prompt, out=()):
    r = Request(rid, list(prompt), SamplingParams(max_tokens=100), max_model_len=4096)
    for t in out:
        r.append_token(t)
    return r


def test_proposer_own_tokens_and_bounded_draft():
    p = SuffixProposer(max_depth=16, min_confidence=0.1, cache_max_nodes=1000)
    body = list(range(100, 130))
    r = _req("a", body + [7] + body[:6])
    assert p.propose([r], [5])[0].token_ids == body[6:11]
    r.append_token(body[6])
    r.append_token(body[7])
    assert p.propose([r], [3])[0].token_ids == body[8:11]
    # a one-token match drafts one token (MAX_SPEC_FACTOR)
    r2 = _req("b", [1, 2, 3, 4, 1])
    assert p.propose([r2], [4])[0].token_ids == [2]


def test_global_tree_drafts_from_earlier_outputs_and_evicts_whole_requests():
    p = SuffixProposer(max_depth=16, min_confidence=0.1, cache_max_nodes=200)
    answer = list(range(500, 540))
    done = _req("a", [1, 2, 3], answer)
    p.propose([done], [4])
    p.release("a")
    assert p.num_cached_requests == 1
    # a new request whose prompt does not hold the answer, once it starts repeating it
    r = _req("b", [9, 9, 8], answer[:5])
    assert p.propose([r], [4])[0].token_ids == answer[5:9]
    r.append_token(answer[5])
    assert p.propose([r], [4])[0].token_ids == answer[6:10]
    # more outputs than the cap: the oldest go, whole, and the tree stays under it
    for i in range(10):
        out = [1000 * (i + 1) + j for j in range(40)]
        q = _req(f"c{i}", [1], out)
        p.propose([q], [1])
        p.release(f"c{i}")
        assert p.global_tree.num_nodes <= 200
    assert p.num_cached_requests < 10
    r.append_token(answer[6])
    assert p.propose([r], [4])[0].token_ids == []     # "a" was evicted


def test_seeded_requests_draft_from_their_own_tokens_only():
    p = SuffixProposer(max_depth=16, min_confidence=0.1, cache_max_nodes=1000)
    answer = list(range(500, 540))
    p.propose([_req("a", [1, 2, 3], answer)], [1])
    p.release("a")
    seeded = Request("s", [9, 9, 8] + answer[:5],
                     SamplingParams(max_tokens=100, seed=4, temperature=1.0), max_model_len=4096)
    assert p.propose([seeded], [4])[0].token_ids == []
    plain = _req("p", [9, 9, 8] + answer[:5])
    assert p.propose([plain], [4])[0].token_ids == answer[5:9]

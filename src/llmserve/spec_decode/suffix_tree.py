"""A suffix tree of bounded depth with compressed leaves, grown one token at a time (no
torch): the index behind suffix decoding (spec_decode/suffix_proposer.py).

The tree holds every substring of length <= ``max_depth`` of the token sequences given to
it, with how many times each occurred (``Node.count``: occurrences of the path from the
root to the node). A path that occurred once is not spelled out node by node: its last
shared node is a *compressed leaf* that points into the sequence (``tail``,
``tail_start``), and is expanded by one level only when a second occurrence reaches it.
So the tree has O(tokens) nodes in practice (at most two new nodes per live suffix and
token), not ``tokens * max_depth``.

Appending is incremental: :meth:`SuffixTree.extend` keeps the *live* suffixes of each
sequence (those still walking a shared path, at most ``max_depth``) and moves each down by
the new token; a suffix that leaves every earlier path becomes a compressed leaf and stops
costing anything. Appending ``n`` tokens costs O(n * live suffixes) <= O(n * max_depth)
dictionary operations, never a pass over the whole sequence. Removing a sequence
(:meth:`SuffixTree.remove`) walks each of its suffixes down to where it became unique.

Invariants: a node with a ``tail`` has ``count == 1`` and no children; ``cont`` is the
sum of the children's counts (occurrences that continue past the node); ``best`` is the
child with the highest count (the most frequent continuation), or -1.
"""
from __future__ import annotations

from typing import Optional


class Node:
    """One substring of the indexed sequences (the path from the root)."""

    __slots__ = ("count", "cont", "best", "children", "depth", "tail", "tail_start")

    def __init__(self, depth: int) -> None:
        self.count = 0
        self.cont = 0                      # sum of the children's counts
        self.best = -1                     # token of the most frequent child
        self.children: Optional[dict[int, Node]] = None
        self.depth = depth
        self.tail: Optional[list[int]] = None   # compressed leaf: its one occurrence
        self.tail_start = 0                # ... starts at tail[tail_start]

    def child(self, token: int) -> Optional["Node"]:
        children = self.children
        return None if children is None else children.get(token)

    def tail_token(self, extra: int) -> Optional[int]:
        """The token ``extra`` positions past this node on its compressed path, if any."""
        tail = self.tail
        if tail is None:
            return None
        pos = self.tail_start + self.depth + extra
        return tail[pos] if pos < len(tail) else None


class SuffixTree:
    """Substrings of length <= ``max_depth`` of several sequences, with counts.

    A sequence is a list of token ids that only grows; the tree keeps a reference to it
    (compressed leaves read their continuation from it), so the caller must not mutate
    it other than by appending.
    """

    def __init__(self, max_depth: int) -> None:
        if max_depth < 2:
            raise ValueError(f"suffix tree depth must be >= 2, got {max_depth}")
        self.max_depth = max_depth
        self.root = Node(0)
        self.num_nodes = 0
        # per sequence (by id(list)): (tokens indexed, live suffixes as [start, node])
        self._live: dict[int, tuple[list[int], list[tuple[int, Node]]]] = {}
        self._indexed: dict[int, int] = {}

    # ---- growing ---------------------------------------------------------------------
    def extend(self, tokens: list[int]) -> list[tuple[int, Node]]:
        """Index the tokens appended to ``tokens`` since the last call for this list;
        returns its live suffixes as ``(start, node)`` pairs, longest first: the nodes of
        the sequence's current suffixes that earlier occurrences share."""
        key = id(tokens)
        entry = self._live.get(key)
        if entry is None:
            entry = self._live[key] = (tokens, [])
            self._indexed[key] = 0
        live = entry[1]
        done = self._indexed[key]
        for pos in range(done, len(tokens)):
            live = self._advance(tokens, live, pos)
        self._indexed[key] = len(tokens)
        self._live[key] = (tokens, live)
        return live

    def finish(self, tokens: list[int]) -> None:
        """Stop tracking the live suffixes of ``tokens`` (it will not grow any more)."""
        self._live.pop(id(tokens), None)
        self._indexed.pop(id(tokens), None)

    def _advance(self, tokens: list[int], live: list[tuple[int, Node]], pos: int
                 ) -> list[tuple[int, Node]]:
        token = tokens[pos]
        max_depth = self.max_depth
        out: list[tuple[int, Node]] = []
        for start, node in live + [(pos, self.root)]:
            child = self._step_down(node, token, tokens, start)
            if child is not None and child.depth < max_depth:
                out.append((start, child))
        return out

    def _step_down(self, node: Node, token: int, tokens: list[int], start: int
                   ) -> Optional[Node]:
        """Count the occurrence starting at ``start`` one level deeper, through ``token``;
        returns the node it reached if other occurrences share it (it stays live)."""
        children = node.children
        if children is None:
            children = node.children = {}
        child = children.get(token)
        if child is None:
            # a path no earlier occurrence took: a compressed leaf for this one
            child = children[token] = Node(node.depth + 1)
            self.num_nodes += 1
            child.count = 1
            child.tail, child.tail_start = tokens, start
            self._counted(node, token, child)
            return None
        if child.tail is not None:
            self._expand(child)
        child.count += 1
        self._counted(node, token, child)
        return child

    @staticmethod
    def _counted(node: Node, token: int, child: Node) -> None:
        node.cont += 1
        if node.best < 0 or (node.best != token and node.children is not None
                             and child.count > node.children[node.best].count):
            node.best = token

    def _expand(self, leaf: Node) -> None:
        """Spell out one more level of a compressed leaf (a second occurrence arrived)."""
        tail, start = leaf.tail, leaf.tail_start
        leaf.tail = None
        if tail is None or leaf.depth >= self.max_depth:
            return
        pos = start + leaf.depth
        if pos >= len(tail):
            return            # its occurrence ends here
        token = tail[pos]
        child = Node(leaf.depth + 1)
        self.num_nodes += 1
        child.count = 1
        child.tail, child.tail_start = tail, start
        leaf.children = {token: child}
        leaf.cont, leaf.best = 1, token

    # ---- shrinking -------------------------------------------------------------------
    def remove(self, tokens: list[int]) -> None:
        """Forget every occurrence that starts in ``tokens`` (indexed whole, not live)."""
        self.finish(tokens)
        n = len(tokens)
        for start in range(n):
            node = self.root
            for pos in range(start, min(n, start + self.max_depth)):
                token = tokens[pos]
                child = node.child(token)
                if child is None:
                    break   # cannot happen for an indexed sequence; stay safe
                mine = child.tail is tokens and child.tail_start == start
                child.count -= 1
                node.cont -= 1
                if child.count <= 0:
                    self._drop(node, token, child)
                elif node.best == token:
                    self._rebest(node)
                if mine:
                    break
                node = child

    def _drop(self, parent: Node, token: int, child: Node) -> None:
        children = parent.children
        if children is not None:
            children.pop(token, None)
        self.num_nodes -= 1
        child.count = 0        # dead: cursors holding it let go
        child.tail = None
        if parent.best == token:
            self._rebest(parent)

    @staticmethod
    def _rebest(node: Node) -> None:
        children = node.children
        if not children:
            node.best = -1
            return
        node.best = max(children, key=lambda t: children[t].count)

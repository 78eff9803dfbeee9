"""Pinned prefixes: chains of cached KV blocks held by a name, never evicted (no torch).

A prompt bundle's KV is prefilled once (an ordinary request) and then pinned here: the
pin looks up the chained hashes of the prefix's full blocks in the prefix cache and
takes one reference on each block found, in order, stopping at the first miss. The
pool records the reference in its pin table (``BlockPool.pin_refs``), so the ledger
check counts a pin as an owner, and a pinned block is never in the free queue, so
never evicted. Unpinning gives the references back; the blocks stay cached (free,
LRU) until evicted.
"""
from __future__ import annotations

from typing import Iterator, Optional, Sequence

from llmserve.engine.kv.block_hash import extend_block_hashes
from llmserve.engine.kv.block_pool import BlockPool, KVBlock


class PrefixPins:
    """The pin table of one KV pool: pin id -> the blocks it holds, in chain order."""

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self._pins: dict[str, list[KVBlock]] = {}

    def pin(self, pin_id: str, token_ids: Sequence[int], root: bytes,
            max_blocks: Optional[int] = None) -> int:
        """Pin the cached full blocks of ``token_ids`` in the namespace of ``root``.

        Takes the longest chain of cached blocks from the start (at most ``max_blocks``);
        a pin id already held is released first. Returns the number of blocks pinned
        (0 when the first block is not cached, e.g. evicted since its prefill).
        """
        if not pin_id:
            raise ValueError("a pin id must be a non-empty string")
        if max_blocks is not None and max_blocks < 0:
            raise ValueError(f"max_blocks must be >= 0, got {max_blocks}")
        self.unpin(pin_id)
        hashes: list[bytes] = []
        extend_block_hashes(hashes, list(token_ids), self.block_size, root)
        if max_blocks is not None:
            hashes = hashes[:max_blocks]
        blocks: list[KVBlock] = []
        for h in hashes:
            block = self.pool.lookup(h)
            if block is None:
                break
            blocks.append(block)
        if blocks:
            self.pool.pin(blocks)
            self._pins[pin_id] = blocks
        return len(blocks)

    def unpin(self, pin_id: str) -> int:
        """Release a pin (unknown ids are ignored); returns how many blocks it held."""
        blocks = self._pins.pop(pin_id, None)
        if not blocks:
            return 0
        self.pool.unpin(reversed(blocks))
        return len(blocks)

    def blocks_of(self, pin_id: str) -> list[int]:
        """Block ids a pin holds (empty if none)."""
        return [b.block_id for b in self._pins.get(pin_id, ())]

    def items(self) -> Iterator[tuple[str, list[int]]]:
        """(pin id, block ids) of every pin."""
        for pin_id, blocks in self._pins.items():
            yield pin_id, [b.block_id for b in blocks]

    @property
    def num_pinned_blocks(self) -> int:
        """Distinct blocks held by at least one pin."""
        return len(self.pool.pin_refs)

    def __len__(self) -> int:
        return len(self._pins)

"""The pool of KV blocks: reference counts, LRU free queues and the prefix-cache map (no torch).

Every block is in exactly one of four states::

    in use        ref_cnt > 0, in no queue, may carry a hash (shared prefix)
    free cached   ref_cnt == 0, in a free queue, carries a hash (can still be hit)
    free empty    ref_cnt == 0, in the cold queue, no hash
    reserve       ref_cnt == 0, in no queue, never handed out (ids >= next_reserve)

    cold queue:  head (evicted first) <-> ... <-> tail (freed most recently)
    hot queue:   the same, for cached blocks that served a prefix hit (``hot``)

The runner's CPU pool commits memory as it is first written (a first write takes a page
fault per 2 MB page of one layer's K or V, costly on these VMs: docs/BENCHMARKS.md). Blocks
``[0, committed)`` start in the cold queue (the runner writes them at start); the rest are
the reserve::

    ids:  0 ........ committed ........ next_reserve ........ num_blocks
          |  in a queue or in use          |   reserve: free, never used  |

Allocation takes the cold queue's head (evicting the hash of a block nobody hit), then the
reserve (committing memory), then the hot queue's head: blocks that were never reused are
recycled before the pool grows, blocks that were are kept until the reserve is gone. So
resident KV memory follows the peak in use plus the reused prefixes (at least
``committed``), not the traffic's history. Freeing appends at a queue's tail; a prefix
hit unlinks a free cached block from the middle and marks it hot. All O(1).
``committed = num_blocks`` (the default here) has no reserve.

Pins (prompt bundles) are an extra owner: ``pin`` takes one reference per block and
records it in ``pin_refs``, so a pinned block is never in the free queue and never
evicted; ``unpin`` gives the references back. A cached block remembers the hash it was
chained from (``parent_hash``: the previous block's hash or the namespace root), so the
ledger check can verify that no chain crosses namespaces.
"""
from __future__ import annotations

from typing import Iterable, Optional, Protocol

from llmserve.engine.kv.block_hash import BlockHash


class CacheRemovals(Protocol):
    """Told when cached hashes leave the map (the KV event log: engine/kv/kv_events.py)."""

    def removed(self, block_hashes: Iterable[BlockHash]) -> None: ...

    def cleared(self) -> None: ...


class KVBlock:
    """Metadata of one KV block; its tensors live in the model runner at index ``block_id``."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "namespace", "parent_hash", "hot", "prev",
                 "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.hot = False        # served a prefix hit since it was cached: in the hot queue
        self.block_hash: Optional[BlockHash] = None
        self.namespace: Optional[str] = None  # tenant salt of a cached block
        self.parent_hash: Optional[BlockHash] = None  # the hash its own hash was chained from
        self.prev: Optional[KVBlock] = None
        self.next: Optional[KVBlock] = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) popleft, append and remove."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)  # sentinels
        self._tail = KVBlock(-2)
        self._head.next = self._tail
        self._tail.prev = self._head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev
        if last is None or block.prev is not None or block.next is not None:
            raise RuntimeError(f"{block} is already in the free queue")
        last.next = block
        block.prev = last
        block.next = self._tail
        self._tail.prev = block
        self.num_free += 1

    def remove(self, block: KVBlock) -> None:
        if block.prev is None or block.next is None:
            raise RuntimeError(f"{block} is not in the free queue")
        block.prev.next = block.next
        block.next.prev = block.prev
        block.prev = block.next = None
        self.num_free -= 1

    def popleft(self) -> KVBlock:
        first = self._head.next
        if first is None or first is self._tail:
            raise RuntimeError("no free KV block")
        self.remove(first)
        return first

    def __iter__(self):
        node = self._head.next
        while node is not None and node is not self._tail:
            yield node
            node = node.next


class BlockPool:
    """Owns all KVBlock objects; hands them out and takes them back."""

    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 committed_blocks: Optional[int] = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        committed = num_blocks if committed_blocks is None else \
            max(0, min(num_blocks, committed_blocks))
        self.free_queue = FreeBlockQueue(self.blocks[:committed])   # the cold queue
        self.hot_queue = FreeBlockQueue(())
        self.next_reserve = committed   # blocks from here on were never handed out
        self.cached: dict[BlockHash, KVBlock] = {}
        self.num_evictions = 0
        self.pin_refs: dict[int, int] = {}   # block id -> references held by pins
        self.removals: Optional[CacheRemovals] = None   # KV events (off: None)

    @property
    def num_reserve_blocks(self) -> int:
        """Free blocks never handed out (their memory not committed yet)."""
        return self.num_blocks - self.next_reserve

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free + self.hot_queue.num_free + self.num_reserve_blocks

    def queued_blocks(self) -> list[KVBlock]:
        """The free blocks in either queue (cold first), for the ledger check."""
        return [*self.free_queue, *self.hot_queue]

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def lookup(self, block_hash: BlockHash) -> Optional[KVBlock]:
        return self.cached.get(block_hash) if self.enable_caching else None

    def allocate(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks: the cold queue's LRU end, the reserve, the hot queue's LRU end
        (evicting the hashes of cached ones)."""
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} KV blocks, only {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            if self.free_queue.num_free:
                block = self.free_queue.popleft()
            elif self.next_reserve < self.num_blocks:
                block = self.blocks[self.next_reserve]
                self.next_reserve += 1
            else:
                block = self.hot_queue.popleft()
            block.hot = False
            if block.block_hash is not None:
                self._drop_hash(block)
                self.num_evictions += 1
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on prefix-hit blocks (they turn hot); a free one leaves its queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self._queue_of(block).remove(block)
            block.ref_cnt += 1
            block.hot = block.block_hash is not None

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference on each block; blocks reaching zero go to a queue's tail (the
        hot one for cached blocks that served a hit).

        Callers pass a sequence's blocks last-first, so its tail blocks (least likely
        to be shared) are evicted before its head blocks.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:   # hot implies a hash: _drop_hash clears both
                self._queue_of(block).append(block)

    def pin(self, blocks: Iterable[KVBlock]) -> None:
        """Take a pin reference on each block (it leaves the free queue; never evicted)."""
        blocks = list(blocks)
        self.touch(blocks)
        for block in blocks:
            self.pin_refs[block.block_id] = self.pin_refs.get(block.block_id, 0) + 1

    def unpin(self, blocks: Iterable[KVBlock]) -> None:
        """Give back one pin reference on each block (pass them last-first)."""
        blocks = list(blocks)
        for block in blocks:
            held = self.pin_refs.get(block.block_id, 0)
            if held <= 0:
                raise RuntimeError(f"unpin of {block}, which holds no pin")
            if held == 1:
                del self.pin_refs[block.block_id]
            else:
                self.pin_refs[block.block_id] = held - 1
        self.free(blocks)

    def cache_block(self, block: KVBlock, block_hash: BlockHash, namespace: Optional[str],
                    parent_hash: Optional[BlockHash] = None) -> bool:
        """Register a full block under its chained hash (first writer wins); True when
        the hash is new to the cache."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self.cached:
            return False  # an identical block is already cached; this one stays private
        block.block_hash = block_hash
        block.namespace = namespace
        block.parent_hash = parent_hash
        self.cached[block_hash] = block
        return True

    def uncache(self, blocks: Iterable[KVBlock]) -> int:
        """Forget the hashes of these blocks (a free cached one becomes free empty)."""
        dropped = 0
        for block in blocks:
            if block.block_hash is not None:
                self._drop_hash(block)
                dropped += 1
        return dropped

    def _queue_of(self, block: KVBlock) -> FreeBlockQueue:
        """The queue a free block waits in (by its hot flag)."""
        return self.hot_queue if block.hot else self.free_queue

    def _drop_hash(self, block: KVBlock) -> None:
        if block.hot:       # nothing left to keep: a free one moves to the cold queue
            if block.ref_cnt == 0:
                self.hot_queue.remove(block)
                self.free_queue.append(block)
            block.hot = False
        if block.block_hash is not None and self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
            if self.removals is not None:
                self.removals.removed((block.block_hash,))
        block.block_hash = None
        block.namespace = None
        block.parent_hash = None

    def reset_cache(self, namespace: Optional[str] = None, all_namespaces: bool = True, *,
                    with_children: bool = False, keep_pinned: bool = False) -> int:
        """Forget cached hashes (all, or one namespace's; ``with_children`` also drops the
        namespaces ``namespace + "|..."`` under it; ``keep_pinned`` spares pinned blocks).
        Contents of blocks in use are untouched. Returns how many hashes were dropped."""
        child = f"{namespace}|"
        dropped: list[BlockHash] = []
        removals, self.removals = self.removals, None   # one event for the whole reset
        try:
            for block in list(self.cached.values()):
                if keep_pinned and block.block_id in self.pin_refs:
                    continue
                ns = block.namespace
                if all_namespaces or ns == namespace or (
                        with_children and ns is not None and ns.startswith(child)):
                    if block.block_hash is not None:
                        dropped.append(block.block_hash)
                    self._drop_hash(block)
        finally:
            self.removals = removals
        if removals is not None and dropped:
            if all_namespaces and not self.cached:
                removals.cleared()
            else:
                removals.removed(dropped)
        return len(dropped)

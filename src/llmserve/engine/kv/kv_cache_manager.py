"""Per-request KV block tables on top of the block pool, with prefix caching (no torch).

A running request's block table covers every token whose KV is, or will be after the
current step, in the cache::

    block table:  [ b0 | b1 | b2 | b3 ]          block_size = 4
    tokens:       |hit.|hit.|computed..|new new| |
                  <- prefix-cache hits ->          (shared, ref_cnt > 1 possible)
                             <- computed -> <- scheduled this step ->
    full blocks are registered in the cache (hash -> block) as soon as their tokens are
    scheduled; the forward pass writes a layer's KV before any attention of that layer
    reads it, so a hit in the same step is safe.

Ledger: `blocks_of(request_id)`, pool totals, `high_water`, and `check_invariants()`.
Pins (`pins`, engine/kv/prefix_pins.py) are owners too; `hit_audit` (engine/kv/cache_audit.py)
logs a sample of prefix hits.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Iterable, Optional

from llmserve.engine.kv.block_hash import BlockHash, extend_block_hashes, namespace_hash
from llmserve.engine.kv.block_pool import BlockPool, KVBlock
from llmserve.engine.kv.cache_audit import HitAudit, check_chain_namespaces
from llmserve.engine.kv.kv_events import KVEventLog
from llmserve.engine.kv.prefix_pins import PrefixPins
from llmserve.engine.request import Request


class KVLedgerError(RuntimeError):
    """An invariant of the KV block ledger does not hold."""


class KVCacheManager:
    """Allocates, shares and frees the KV blocks of requests."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        fingerprint: str = "",
        committed_blocks: Optional[int] = None,
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.fingerprint = fingerprint
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching,
                              committed_blocks=committed_blocks)
        self._req_blocks: dict[str, list[KVBlock]] = {}
        self._req_block_ids: dict[str, list[int]] = {}   # the same tables as ids, kept in step
        self._req_num_registered: dict[str, int] = {}
        self._roots: dict[Optional[str], BlockHash] = {}
        self.high_water = 0
        self.pins = PrefixPins(self.pool, block_size)
        self.hit_audit = HitAudit()
        self.events: Optional[KVEventLog] = None   # KV events for indexers (off: None)

    def enable_events(self, log: KVEventLog) -> None:
        """Record BlockStored / BlockRemoved / AllBlocksCleared in ``log`` from now on."""
        self.events = log
        self.pool.removals = log

    # ---- sizes -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def blocks_of(self, request_id: str) -> list[int]:
        """Block ids held by a request (its block table), empty if none. Do not mutate."""
        return self._req_block_ids.get(request_id, [])

    # ---- prefix cache -------------------------------------------------------------------
    def root(self, salt: Optional[str]) -> BlockHash:
        """The hash-chain root of a namespace (engine fingerprint + cache salt)."""
        return self._root(salt)

    def _root(self, salt: Optional[str]) -> BlockHash:
        root = self._roots.get(salt)
        if root is None:
            root = self._roots[salt] = namespace_hash(self.fingerprint, salt)
        return root

    def _hash_upto(self, request: Request, num_tokens: int) -> None:
        if len(request.block_hashes) < num_tokens // self.block_size:
            extend_block_hashes(
                request.block_hashes, request.all_token_ids, self.block_size,
                self._root(request.cache_salt), num_tokens,
            )

    def find_cached_prefix(self, request: Request) -> list[KVBlock]:
        """Longest chain of cached full blocks for a request that holds no blocks yet.

        The last token is never served from cache (its logits are needed), so a prompt
        that ends on a block boundary recomputes its whole last block.
        """
        if not self.enable_prefix_caching or request.num_computed_tokens:
            return []
        if request.sampling_params.prompt_logprobs is not None:
            return []  # every prompt position must be computed to score it
        if request.pooling is not None and request.pooling.needs_every_position:
            return []  # mean / cls pooling read positions a cache hit would skip
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._hash_upto(request, max_blocks * self.block_size)
        hits: list[KVBlock] = []
        for h in request.block_hashes[:max_blocks]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits

    # ---- allocation ----------------------------------------------------------------------
    def can_allocate(self, request: Request, num_new_tokens: int,
                     cached: Iterable[KVBlock] = (), reserve: int = 0,
                     num_lookahead_tokens: int = 0) -> bool:
        cached = list(cached)
        have = len(self._req_blocks.get(request.request_id, ())) + len(cached)
        total = (request.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
                 + num_lookahead_tokens)
        need = self.blocks_needed(total) - have
        # free cached hits sit in the free queue: touching them uses up free blocks too
        evictable = sum(1 for b in cached if b.ref_cnt == 0)
        return need + evictable + reserve <= self.pool.num_free_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       cached: Iterable[KVBlock] = (), reserve: int = 0,
                       num_lookahead_tokens: int = 0) -> bool:
        """Grow the request's block table to hold ``num_new_tokens`` more tokens.

        ``cached`` are prefix-hit blocks (from `find_cached_prefix`) to take first; the
        caller then advances ``num_computed_tokens`` past them. ``num_lookahead_tokens``
        more slots are reserved for speculative draft tokens: their KV is written
        tentatively, so blocks holding them are never registered in the prefix cache
        here (they are once the tokens are committed; see `trim`). Returns False,
        changing nothing, when the pool cannot supply the blocks while keeping
        ``reserve`` free.
        """
        cached = list(cached)
        if not self.can_allocate(request, num_new_tokens, cached, reserve, num_lookahead_tokens):
            return False
        rid = request.request_id
        blocks = self._req_blocks.setdefault(rid, [])
        ids = self._req_block_ids.setdefault(rid, [])
        if cached:
            self.pool.touch(cached)
            blocks.extend(cached)
            ids.extend(b.block_id for b in cached)
        total = request.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        need = self.blocks_needed(total + num_lookahead_tokens) - len(blocks)
        if need > 0:
            new = self.pool.allocate(need)
            blocks.extend(new)
            ids.extend(b.block_id for b in new)
        if self.enable_prefix_caching:
            num_full = total // self.block_size
            start = self._req_num_registered.get(rid, 0)
            if num_full > start:
                self._hash_upto(request, total)
                hashes = request.block_hashes
                stored = []
                for i in range(start, num_full):
                    parent = hashes[i - 1] if i else self._root(request.cache_salt)
                    if self.pool.cache_block(blocks[i], hashes[i], request.cache_salt, parent):
                        stored.append(i)
                self._req_num_registered[rid] = num_full
                if self.events is not None and stored:
                    self.events.stored(request, stored)
        used = self.pool.num_used_blocks
        if used > self.high_water:
            self.high_water = used
        return True

    def trim(self, request: Request, num_tokens: int) -> int:
        """Roll back speculative slots: free the request's blocks past the first
        ``blocks_needed(num_tokens)`` (tail first). Such blocks held only rejected draft
        positions, so none is registered in the prefix cache. Returns how many."""
        blocks = self._req_blocks.get(request.request_id)
        keep = self.blocks_needed(num_tokens)
        if not blocks or len(blocks) <= keep:
            return 0
        extra = blocks[keep:]
        if self._req_num_registered.get(request.request_id, 0) > keep:
            raise KVLedgerError(f"request {request.request_id}: cannot trim registered blocks")
        del blocks[keep:]
        del self._req_block_ids[request.request_id][keep:]
        self.pool.free(reversed(extra))
        return len(extra)

    def free(self, request: Request) -> int:
        """Release every block of a request (tail first). Returns how many it held."""
        blocks = self._req_blocks.pop(request.request_id, None)
        self._req_block_ids.pop(request.request_id, None)
        self._req_num_registered.pop(request.request_id, None)
        if self.events is not None:
            self.events.forget(request.request_id)
        if not blocks:
            return 0
        self.pool.free(reversed(blocks))
        return len(blocks)

    def drop_cached_blocks(self, block_ids: Iterable[int]) -> int:
        """Unregister these blocks from the prefix cache (their KV is not what their hash
        says, e.g. a failed step never wrote it); owners keep them. Returns how many."""
        return self.pool.uncache(self.pool.blocks[i] for i in block_ids)

    def reset_prefix_cache(self, namespace: Optional[str] = None, *, all_namespaces: bool = True,
                           with_children: bool = False, keep_pinned: bool = False) -> int:
        """Forget cached prefixes (all, or one namespace's, ``with_children`` its
        ``namespace|...`` sub-namespaces too; ``keep_pinned`` spares pinned blocks);
        blocks in use keep their contents. Returns how many hashes were dropped."""
        return self.pool.reset_cache(namespace, all_namespaces=all_namespaces,
                                     with_children=with_children, keep_pinned=keep_pinned)

    def record_hit(self, request: Request, blocks: list[KVBlock]) -> None:
        """A request's first prefix lookup found ``blocks`` (for the sampled hit audit)."""
        if blocks:
            self.hit_audit.record(request.request_id, request.cache_salt, blocks)

    # ---- invariants ----------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise KVLedgerError unless every block is either free or owned, exactly once."""
        owners: Counter[int] = Counter()
        if self._req_block_ids.keys() != self._req_blocks.keys():
            raise KVLedgerError("block-id tables disagree with block tables")
        for rid, blocks in self._req_blocks.items():
            ids = [b.block_id for b in blocks]
            if ids != self._req_block_ids[rid]:
                raise KVLedgerError(f"request {rid}: block-id table {self._req_block_ids[rid]} "
                                    f"!= {ids}")
            if len(set(ids)) != len(ids):
                raise KVLedgerError(f"request {rid} holds a block twice: {ids}")
            owners.update(ids)
        pin_refs: Counter[int] = Counter()
        for _pin, ids in self.pins.items():
            pin_refs.update(ids)
        if dict(pin_refs) != self.pool.pin_refs:
            raise KVLedgerError(f"pin table {dict(pin_refs)} != pool pin refs {self.pool.pin_refs}")
        owners.update(pin_refs)
        queued = self.pool.queued_blocks()
        free_ids = [b.block_id for b in queued]
        if len(free_ids) != self.pool.free_queue.num_free + self.pool.hot_queue.num_free:
            raise KVLedgerError("free-queue length counters disagree with their links")
        hot_ids = {b.block_id for b in self.pool.hot_queue}
        if any(b.hot != (b.block_id in hot_ids) for b in queued):
            raise KVLedgerError("a block's hot flag disagrees with its queue")
        if len(set(free_ids)) != len(free_ids):
            raise KVLedgerError("a block is in the free queue twice")
        reserve = range(self.pool.next_reserve, self.pool.num_blocks)
        free_set = set(free_ids)
        if any(i in reserve for i in free_set) or any(i in reserve for i in owners):
            raise KVLedgerError("a reserve block is in the free queue or owned")
        for block in self.pool.blocks:
            refs = owners.get(block.block_id, 0)
            if block.ref_cnt != refs:
                raise KVLedgerError(f"{block}: ref_cnt {block.ref_cnt} but {refs} owner(s)")
            free = block.block_id in free_set or block.block_id in reserve
            if (block.ref_cnt == 0) != free:
                raise KVLedgerError(f"{block}: free iff ref_cnt == 0 violated")
            if block.block_id in reserve and block.block_hash is not None:
                raise KVLedgerError(f"{block}: a reserve block carries a hash")
            if block.hot and block.block_hash is None:
                raise KVLedgerError("a hot block carries no hash")
        if len(free_set) + len(reserve) + len(owners) != self.pool.num_blocks:
            raise KVLedgerError(
                f"lost blocks: {len(free_set)} free + {len(reserve)} reserve + {len(owners)} "
                f"owned != {self.pool.num_blocks}")
        for h, block in self.pool.cached.items():
            if block.block_hash != h:
                raise KVLedgerError(f"cache map entry disagrees with {block}")
        roots = {root: salt for salt, root in self._roots.items()}
        for ns in {b.namespace for b in self.pool.cached.values()}:
            roots[namespace_hash(self.fingerprint, ns)] = ns
        wrong = check_chain_namespaces(self.pool, roots)
        if wrong is not None:
            raise KVLedgerError(wrong)

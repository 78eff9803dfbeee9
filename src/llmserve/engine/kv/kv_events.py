"""KV-cache events for external indexers, in vLLM's event model (no torch, no I/O).

llm-d's precise prefix-cache scorer (and any KV indexer) follows which block hashes each
pod holds. The KV manager reports the three changes of its prefix-cache map here:

    BlockStored       full blocks entered the cache (one event per run of consecutive
                      blocks of one request: their hashes, the hash of the block before
                      the run, their token ids, the block size, the adapter)
    BlockRemoved      cached blocks lost their hash (evicted for reuse, or dropped)
    AllBlocksCleared  a reset emptied the whole map

`KVEventLog` collects them during an engine step; the engine hands `take()` to a
`KVEventPublisher` once per step (llmserve.integrations.kv_events sends them over ZMQ
as vLLM's ``KVEventBatch``, off the engine thread).

Hashes on the wire are unsigned 64-bit integers (vLLM's default ``ExternalBlockHash``):

* ``llmserve`` (default): the last 8 bytes, big-endian, of llmserve's own chained
  sha256 (engine/kv/block_hash.py; its root covers the engine fingerprint and the
  request's cache namespace). An indexer recomputes it from token ids given the root,
  which the server logs at start-up.
* ``vllm``: vLLM's / llm-d's ``sha256_cbor`` 64-bit chain, computed beside llmserve's:
  ``root = u64(sha256(cbor(seed)))``,
  ``hash(block) = u64(sha256(cbor([parent, [token ids], extra])))``, with ``extra`` null,
  or ``[cache namespace]`` on block 0 of a request in a namespace (tenant or adapter).
  CBOR is canonical (shortest integer heads), as ``cbor2.dumps(..., canonical=True)``.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Protocol, Sequence

from llmserve.engine.kv.block_hash import BlockHash
from llmserve.engine.request import Request

BLOCK_HASHINGS = ("llmserve", "vllm")


@dataclass
class BlockStored:
    """Full blocks of one request that entered the prefix cache, in chain order."""

    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int] = None
    medium: Optional[str] = None
    lora_name: Optional[str] = None


@dataclass
class BlockRemoved:
    """Cached blocks that lost their hash."""

    block_hashes: list[int]
    medium: Optional[str] = None


@dataclass
class AllBlocksCleared:
    """The prefix cache was emptied."""


@dataclass(frozen=True)
class ExternalHashing:
    """How block hashes are presented to indexers (module docstring)."""

    mode: str = "llmserve"
    seed: str = "0"            # vLLM's PYTHONHASHSEED (``vllm`` mode)
    medium: str = "GPU"        # vLLM's name for the engine's own KV pool, on any device

    def __post_init__(self) -> None:
        if self.mode not in BLOCK_HASHINGS:
            raise ValueError(f"block hashing must be one of {BLOCK_HASHINGS}, got {self.mode!r}")


class KVEventPublisher(Protocol):
    """Where the engine sends each step's events (must not block the engine thread)."""

    hashing: ExternalHashing

    def publish(self, events: list[Any]) -> None:
        """Queue one step's events for sending."""
        ...


def to_u64(block_hash: BlockHash) -> int:
    """A 32-byte sha256 block hash as the unsigned 64-bit integer sent on the wire."""
    return int.from_bytes(block_hash[-8:], "big")


def _cbor_head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([major << 5 | n])
    for extra, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if n < 1 << (8 * struct.calcsize(fmt)):
            return bytes([major << 5 | extra]) + struct.pack(fmt, n)
    raise ValueError(f"integer {n} does not fit CBOR's 64-bit head")


def cbor(value: Any) -> bytes:
    """Canonical CBOR of None, non-negative ints, str, bytes and lists / tuples of them."""
    if value is None:
        return b"\xf6"
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return _cbor_head(0, value)
    if isinstance(value, bytes):
        return _cbor_head(2, len(value)) + value
    if isinstance(value, str):
        raw = value.encode()
        return _cbor_head(3, len(raw)) + raw
    if isinstance(value, (list, tuple)):
        return _cbor_head(4, len(value)) + b"".join(cbor(v) for v in value)
    raise TypeError(f"cannot CBOR-encode {type(value).__name__} for a block hash")


def vllm_hash(payload: Any) -> int:
    """vLLM's ``sha256_cbor`` truncated to 64 bits (its external block hash)."""
    return int.from_bytes(hashlib.sha256(cbor(payload)).digest()[-8:], "big")


def vllm_block_hashes(token_ids: Sequence[int], block_size: int, seed: str = "0",
                      namespace: Optional[str] = None) -> list[int]:
    """vLLM-compatible hashes of every full block of ``token_ids`` (``vllm`` mode)."""
    parent = vllm_hash(seed)
    out = []
    for i in range(len(token_ids) // block_size):
        extra = [namespace] if namespace is not None and i == 0 else None
        parent = vllm_hash([parent, list(token_ids[i * block_size:(i + 1) * block_size]), extra])
        out.append(parent)
    return out


@dataclass
class KVEventLog:
    """The events of the current step, with the external hash of every cached block."""

    block_size: int
    hashing: ExternalHashing = field(default_factory=ExternalHashing)
    events: list[Any] = field(default_factory=list)
    _external: dict[BlockHash, int] = field(default_factory=dict)   # cached block -> wire hash
    _chains: dict[str, list[int]] = field(default_factory=dict)     # vllm mode, per request

    def stored(self, request: Request, indices: Iterable[int]) -> None:
        """Blocks ``indices`` of ``request`` (ascending) just entered the cache."""
        run: list[int] = []
        for i in indices:
            if run and i != run[-1] + 1:
                self._store_run(request, run)
                run = []
            run.append(i)
        if run:
            self._store_run(request, run)

    def _store_run(self, request: Request, run: list[int]) -> None:
        hashes = request.block_hashes
        if self.hashing.mode == "vllm":
            chain = self._chain(request, run[-1] + 1)
            wire = [chain[i] for i in run]
            parent = chain[run[0] - 1] if run[0] else None
        else:
            wire = [to_u64(hashes[i]) for i in run]
            parent = to_u64(hashes[run[0] - 1]) if run[0] else None
        for i, h in zip(run, wire):
            self._external[hashes[i]] = h
        bs = self.block_size
        lora = request.lora
        self.events.append(BlockStored(
            wire, parent, list(request.all_token_ids[run[0] * bs:(run[-1] + 1) * bs]), bs,
            None, self.hashing.medium, None if lora is None else lora.name))

    def _chain(self, request: Request, num_blocks: int) -> list[int]:
        chain = self._chains.setdefault(request.request_id, [])
        if len(chain) < num_blocks:
            bs = self.block_size
            tokens = request.all_token_ids
            parent = chain[-1] if chain else vllm_hash(self.hashing.seed)
            for i in range(len(chain), num_blocks):
                extra = [request.cache_salt] if request.cache_salt is not None and i == 0 else None
                parent = vllm_hash([parent, list(tokens[i * bs:(i + 1) * bs]), extra])
                chain.append(parent)
        return chain

    def removed(self, block_hashes: Iterable[BlockHash]) -> None:
        """These cached blocks lost their hash."""
        wire = [self._external.pop(h, None) for h in block_hashes]
        wire_hashes = [h for h in wire if h is not None]
        if wire_hashes:
            self.events.append(BlockRemoved(wire_hashes, self.hashing.medium))

    def cleared(self) -> None:
        """The whole prefix-cache map was emptied."""
        self._external.clear()
        self.events.append(AllBlocksCleared())

    def forget(self, request_id: str) -> None:
        """A request released its blocks (drop its vLLM-mode chain)."""
        self._chains.pop(request_id, None)

    def take(self) -> list[Any]:
        """The events so far, oldest first; the log starts empty again."""
        events, self.events = self.events, []
        return events

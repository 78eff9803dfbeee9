"""Chained hashes of full KV blocks, for the prefix cache (no torch).

    namespace_hash = sha256(engine fingerprint | tenant salt)
    hash(block 0)  = sha256(namespace_hash | token ids of block 0)
    hash(block i)  = sha256(hash(block i-1) | token ids of block i)

Because every hash covers its parent, equal hashes mean equal token prefixes in the same
namespace; the namespace carries everything that changes the KV for the same token ids
(model weights, quantization, tokenizer, template, KV dtype, block size, tenant).
sha256 has no practical collisions, so a lookup needs no token comparison.
"""
from __future__ import annotations

import hashlib
from array import array
from typing import Optional, Sequence

BlockHash = bytes


def namespace_hash(fingerprint: str, cache_salt: Optional[str]) -> BlockHash:
    """The root of a hash chain: the engine fingerprint plus the tenant's cache salt."""
    h = hashlib.sha256()
    h.update(b"llmserve-prefix-v1\x00")
    h.update(fingerprint.encode())
    h.update(b"\x00salt\x00")
    if cache_salt is not None:
        h.update(b"\x01")
        h.update(cache_salt.encode())
    return h.digest()


def hash_block_tokens(parent_hash: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Hash of one full block given the hash of the block before it."""
    h = hashlib.sha256(parent_hash)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def extend_block_hashes(
    hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    root: BlockHash,
    num_tokens: Optional[int] = None,
) -> None:
    """Append hashes for every full block of ``token_ids[:num_tokens]`` not yet hashed."""
    limit = len(token_ids) if num_tokens is None else num_tokens
    num_full = limit // block_size
    parent = hashes[-1] if hashes else root
    for i in range(len(hashes), num_full):
        parent = hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)

"""The paged KV pool: one K and one V tensor per layer, sized from the engine config.

Layout per layer: ``(num_slots, kv_heads, head_dim)`` with ``slot = block * block_size +
offset`` (int8/fp8 caches: ``head_dim + 4``, the codes then a float32 scale per token and
head; see llmserve.model.quant.kv). One extra *scratch* block after the usable ones absorbs the writes of padded rows
(compiled steps pad the batch) and pads block tables; the block manager never hands it out::

    blocks: [ 0 | 1 | ... | num_blocks - 1 | scratch ]

On CPU the pool is allocated zeroed but uncommitted (calloc: pages become resident only when
a block is first written), so a pool sized for ``max_num_seqs x max_model_len`` costs memory
only for the tokens actually held.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from llmserve.config import EngineConfig
from llmserve.model.config import ModelConfig
from llmserve.model.executor.huge_pages import advise_huge_pages
from llmserve.model.platform import available_memory_bytes
from llmserve.model.quant.kv import kv_bytes_per_head, kv_row_width

logger = logging.getLogger(__name__)


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V, every layer, one block: 2 * layers * block_size * kv_heads * row bytes, where a
    row is head_dim elements (+ a 4-byte scale in an int8/fp8 cache)."""
    per_head = kv_bytes_per_head(cfg.head_dim, dtype)
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * per_head


def plan_num_blocks(config: EngineConfig, model: ModelConfig, kv_dtype: torch.dtype,
                    device: torch.device, max_model_len: int) -> int:
    """Blocks for the pool: explicit ``num_kv_blocks`` / ``kv_cache_gib``, else enough for
    ``max_num_seqs`` full contexts, capped by ``kv_cache_fraction`` of free memory."""
    if config.cache.num_kv_blocks is not None:
        return config.cache.num_kv_blocks
    per_block = kv_bytes_per_block(model, config.cache.block_size, kv_dtype)
    cap = available_memory_bytes(device) * config.cache.kv_cache_fraction
    if config.cache.kv_cache_gib is not None:
        budget = config.cache.kv_cache_gib * 2**30
    else:
        blocks_per_seq = -(-max_model_len // config.cache.block_size)
        budget = min(cap, config.scheduler.max_num_seqs * blocks_per_seq * per_block)
    n = int(budget // per_block)
    if n < 1:
        raise ValueError(f"KV budget of {budget / 2**30:.3f} GiB is smaller than one block "
                         f"({per_block} bytes)")
    return n


def _zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    raw = torch.from_numpy(np.zeros(nbytes, dtype=np.uint8))   # calloc: lazily committed
    return raw.view(dtype).view(shape)


class KVCachePool:
    """Per-layer K/V tensors for ``num_blocks`` usable blocks plus the scratch block.

    On the CPU the tensors are committed lazily (pages appear as they are first written);
    the first ``commit_blocks`` (at most ``num_blocks``) are written now, so that the first requests' KV writes take no
    page faults (the engine's BlockPool hands those blocks out before any other).
    """

    def __init__(self, model: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, commit_blocks: int = 0) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.scratch_block = num_blocks
        slots = (num_blocks + 1) * block_size
        shape = (slots, model.num_key_value_heads, kv_row_width(model.head_dim, dtype))
        self.caches = [(_zeroed(shape, dtype, device), _zeroed(shape, dtype, device))
                       for _ in range(model.num_hidden_layers)]
        #: bytes of the pool whose page faults map 2 MB at a time (huge_pages.py), asked
        #: before anything is written
        self.huge_page_bytes = advise_huge_pages([t for kv in self.caches for t in kv]) \
            if device.type == "cpu" else 0
        if device.type == "cpu" and commit_blocks > 0:
            t0 = time.perf_counter()
            rows = commit_blocks * block_size
            for k, v in self.caches:
                k[:rows].zero_()
                v[:rows].zero_()
            logger.info("KV pool: %d blocks committed at start in %.2f s", commit_blocks,
                        time.perf_counter() - t0)
        self.bytes_per_token = kv_bytes_per_block(model, 1, dtype)
        self.pool_bytes = num_blocks * kv_bytes_per_block(model, block_size, dtype)

"""The KV of prompt bundles: prefilled, pinned within a per-tenant budget, released.

The *bundle prefix* is the longest common prefix of the bundle's messages templated
alone and the same messages followed by a user turn: the tokens every request that
uses the bundle starts with, whatever the template adds around turns. Its full blocks
are what can be pinned.

``warm`` prefills that prefix with an ordinary one-token request in the bundle's
namespace (``tenant salt|bundle:owner/name@version``, so each tenant and each version
has its own KV) and pins its cached blocks in the engine (``engine.pin_prefix``), at
most the tenant's remaining budget (``bundle_pinned_blocks`` or
``prompt_bundles.pinned_blocks_per_tenant``); the engine also caps all pins so a
full-length request always fits. A bundle registered by its tenant is warmed at once;
a shared bundle, or one loaded from the database after a restart, is pinned after the
first request that uses it (that request computed its KV). ``release`` unpins. Per
bundle it counts the requests that used it and how many of their bundle-prefix tokens
the prefix cache served. No torch.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from llmserve.contract.engine_client import EngineClient, PrefixPinning
from llmserve.gateway.caches.prompt_bundles import PromptBundle
from llmserve.sampling_params import SamplingParams
from llmserve.tokenizer.chat_prompt import ChatTokenizer, chat_prompt_tokens

logger = logging.getLogger(__name__)

_PROBE_TURN = {"role": "user", "content": "?"}


def bundle_prefix_tokens(tokenizer: ChatTokenizer, messages: list[dict[str, Any]],
                         tools: Optional[list[dict[str, Any]]] = None) -> list[int]:
    """The bundle prefix (see the module docstring)."""
    alone = chat_prompt_tokens(tokenizer, list(messages), False, tools)
    followed = chat_prompt_tokens(tokenizer, list(messages) + [_PROBE_TURN], True, tools)
    n = 0
    for a, b in zip(alone, followed):
        if a != b:
            break
        n += 1
    return alone[:n]


@dataclass
class BundlePin:
    """The pinned KV of one bundle version for one tenant on one engine."""

    model: str
    tenant: str
    bundle_id: str
    pin_id: str
    prefix_tokens: int = 0       # tokens of the bundle prefix
    full_blocks: int = 0         # its full blocks (what could be pinned)
    block_size: int = 1
    blocks: int = 0              # blocks pinned
    requests: int = 0            # requests that used the bundle here
    hit_tokens: int = 0          # of their bundle-prefix tokens (full blocks), served from cache


class BundleKV:
    """Pins of every bundle (see the module docstring).

    Args:
        budget_of: tenant name -> pinning budget in blocks.
    """

    def __init__(self, budget_of: Callable[[str], int]) -> None:
        self.budget_of = budget_of
        self._pins: dict[tuple[str, str, str], BundlePin] = {}
        self._lock = threading.Lock()          # guards _pins between threads (metrics)
        self._serial: Optional[asyncio.Lock] = None  # one warm/release at a time

    def _guard(self) -> asyncio.Lock:
        if self._serial is None:
            self._serial = asyncio.Lock()
        return self._serial

    def pinned_blocks(self, tenant: str) -> int:
        with self._lock:
            return sum(p.blocks for p in self._pins.values() if p.tenant == tenant)

    def get(self, model: str, tenant: str, bundle_id: str) -> Optional[BundlePin]:
        with self._lock:
            return self._pins.get((model, tenant, bundle_id))

    async def warm(self, engine: EngineClient, model: str, tenant: str, salt: str, bundle: PromptBundle,
                   *, prefill: bool = True) -> BundlePin:
        """Prefill (unless ``prefill`` is False: a request just computed it) and pin the
        bundle's prefix for ``tenant`` on ``engine``, within the tenant's budget."""
        key = (model, tenant, bundle.bundle_id)
        async with self._guard():
            pin = self.get(*key) or BundlePin(model, tenant, bundle.bundle_id,
                                              f"bundle:{tenant}:{bundle.bundle_id}")
            tokens = await asyncio.to_thread(bundle_prefix_tokens, engine.tokenizer,
                                             list(bundle.messages), list(bundle.tools or []))
            block_size = pin.block_size = int(engine.block_size)
            pin.prefix_tokens, pin.full_blocks = len(tokens), len(tokens) // block_size
            room = self.budget_of(tenant) - self.pinned_blocks(tenant) + pin.blocks
            want = max(0, min(pin.full_blocks, room))
            if want and isinstance(engine, PrefixPinning) and len(tokens) < engine.max_model_len:
                for attempt in range(2):  # the second try re-prefills blocks evicted meanwhile
                    if prefill or attempt:
                        await self._prefill(engine, tokens, salt)
                    pin.blocks = await engine.pin_prefix(pin.pin_id, tokens, salt, want)
                    if pin.blocks >= want:
                        break
            with self._lock:
                self._pins[key] = pin
        if pin.blocks < pin.full_blocks:
            logger.info("prompt bundle %s of tenant %s on %s: %d of %d blocks pinned (budget %d)",
                        bundle.bundle_id, tenant, model, pin.blocks, pin.full_blocks,
                        self.budget_of(tenant))
        return pin

    @staticmethod
    async def _prefill(engine: EngineClient, tokens: list[int], salt: str) -> None:
        params = SamplingParams(max_tokens=1, temperature=0)
        stream = engine.generate(tokens, params, f"bundle-prefill-{uuid.uuid4().hex[:12]}",
                                 cache_salt=salt)
        async for _ in stream:
            pass

    async def release(self, engines: Mapping[str, EngineClient], bundle_ids: set[str]) -> int:
        """Unpin every pin of these bundles (all tenants, all engines); returns blocks freed."""
        freed = 0
        async with self._guard():
            with self._lock:
                gone = [k for k in self._pins if k[2] in bundle_ids]
                pins = [self._pins.pop(k) for k in gone]
            for pin in pins:
                engine = engines.get(pin.model)
                if pin.blocks and isinstance(engine, PrefixPinning):
                    freed += await engine.unpin_prefix(pin.pin_id)
        return freed

    def note_use(self, model: str, tenant: str, bundle_id: str, cached_tokens: int) -> bool:
        """Count a finished request that used a bundle; False when the bundle has no pin
        record on this engine for this tenant yet (the caller warms it)."""
        with self._lock:
            pin = self._pins.get((model, tenant, bundle_id))
            if pin is None:
                return False
            pin.requests += 1
            pin.hit_tokens += min(cached_tokens, pin.full_blocks * pin.block_size)
            return True

    def snapshot(self) -> list[dict[str, Any]]:
        """Every pin with its counters (JSON-ready)."""
        with self._lock:
            pins = list(self._pins.values())
        out = []
        for p in pins:
            queried = p.requests * p.full_blocks * p.block_size
            out.append({"bundle": p.bundle_id, "tenant": p.tenant, "model": p.model,
                        "prefix_tokens": p.prefix_tokens, "full_blocks": p.full_blocks,
                        "pinned_blocks": p.blocks, "requests": p.requests,
                        "hit_tokens": p.hit_tokens,
                        "hit_rate": p.hit_tokens / queried if queried else None})
        return out

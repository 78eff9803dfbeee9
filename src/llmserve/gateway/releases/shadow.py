"""Shadow traffic: mirror a served request to a candidate release and compare answers.

After a request picked for shadowing has been answered (and billed), the gateway
hands it to :class:`ShadowRunner`, which runs the same prompt tokens with the same
sampling parameters on the shadow release's engine -- at ``batch`` priority, in the
background, outside the tenant's queue, rate limits and ledger -- and compares the
two answers: exact match of the texts and token agreement (the share of positions
whose tokens agree, over the longer of the two token sequences). The answer is never
returned to anyone; the comparison goes to the release store's ``shadow_comparisons``
table and into the release's health window. At most ``max_in_flight`` shadow runs
at once: more are skipped (counted), so shadowing never piles up work. Requests
with several prompts or choices are not mirrored. No torch.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from typing import Any, Callable, Optional, Sequence

from llmserve.contract.engine_client import EngineClient
from llmserve.contract.gateway_hook import CapturedResponse, RequestContext
from llmserve.gateway.releases.health import ReleaseHealth
from llmserve.gateway.releases.store import ReleaseStore, ShadowComparison
from llmserve.gateway.releases.table import Release

logger = logging.getLogger(__name__)

#: Shadow runs at once before further mirrors are skipped.
DEFAULT_MAX_IN_FLIGHT = 4


def served_text(response: Optional[CapturedResponse]) -> Optional[str]:
    """The first choice's text of a captured chat or text completion (None if absent)."""
    if response is None or response.status != 200:
        return None
    if response.events is None:
        body = response.body if isinstance(response.body, dict) else {}
        choices = body.get("choices") or [{}]
        message = choices[0].get("message")
        return (message or {}).get("content") if message is not None else choices[0].get("text")
    parts: list[str] = []
    for event in response.events:
        if event == "[DONE]":
            continue
        try:
            chunk = json.loads(event)
        except ValueError:
            continue
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta")
            text = (delta or {}).get("content") if delta is not None else choice.get("text")
            if text:
                parts.append(text)
    return "".join(parts)


def token_agreement(a: Sequence[int], b: Sequence[int]) -> float:
    """Share of positions where ``a`` and ``b`` hold the same token, over the longer one."""
    longest = max(len(a), len(b))
    if longest == 0:
        return 1.0
    return sum(1 for x, y in zip(a, b) if x == y) / longest


class ShadowRunner:
    """Runs and compares shadow requests (see the module docstring)."""

    def __init__(self, engines: Callable[[str], Any], store: ReleaseStore,
                 health: ReleaseHealth, timeout_s: float,
                 max_in_flight: int = DEFAULT_MAX_IN_FLIGHT) -> None:
        self.engines = engines                   # served name -> engine (None: not served)
        self.store = store
        self.health = health
        self.timeout_s = timeout_s
        self.max_in_flight = max_in_flight
        self.counts: Counter[tuple[str, str]] = Counter()   # (shadow release, result)
        self._tasks: set[asyncio.Task] = set()

    @staticmethod
    def eligible(ctx: RequestContext) -> bool:
        """Whether a request can be mirrored (one prompt, one choice)."""
        return ctx.num_choices == 1 and ctx.prompt_token_ids is not None \
            and len(ctx.prompt_token_ids) == 1 and ctx.sampling_params is not None

    def start(self, ctx: RequestContext, tenant: str, served: Release, shadow: Release,
              response: Optional[CapturedResponse]) -> bool:
        """Mirror a finished request in the background; False when it was skipped."""
        text = served_text(response)
        if text is None or not self.eligible(ctx) or len(self._tasks) >= self.max_in_flight:
            self.counts[(shadow.id, "skipped")] += 1
            return False
        prompts = ctx.prompt_token_ids or [[]]   # eligible: exactly one prompt
        task = asyncio.get_running_loop().create_task(
            self._run(ctx.request_id, tenant, ctx.cache_salt, list(prompts[0]),
                      ctx.sampling_params, served, shadow, text))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    async def _run(self, request_id: str, tenant: str, cache_salt: Optional[str],
                   prompt: list[int], params: Any, served: Release, shadow: Release,
                   text: str) -> None:
        engine = self.engines(shadow.target)
        tokens: list[int] = []
        error = None
        try:
            if engine is None:
                raise RuntimeError(f"served model {shadow.target!r} is not served any more")
            async for out in engine.generate(prompt, params, f"shadow-{request_id}",
                                             priority="batch", cache_salt=cache_salt,
                                             deadline=time.time() + self.timeout_s):
                for choice in out.outputs:
                    if choice.index == 0:
                        tokens.extend(choice.token_ids)
        except Exception as exc:  # noqa: BLE001 - a shadow failure is recorded, never raised
            error = repr(exc)[:500]
        try:
            comparison = await asyncio.to_thread(self._compare, request_id, tenant, served,
                                                 shadow, text, tokens, error, engine)
            self.health.record_agreement(shadow.id, comparison.token_agreement)
            self.counts[(shadow.id, "error" if error else "compared")] += 1
            await asyncio.to_thread(self.store.record_shadow, comparison)
        except Exception:  # noqa: BLE001
            logger.exception("shadow comparison of request %s failed", request_id)

    def _compare(self, request_id: str, tenant: str, served: Release, shadow: Release,
                 text: str, tokens: list[int], error: Optional[str],
                 engine: EngineClient) -> ShadowComparison:
        tokenizer = engine.tokenizer if engine is not None else None
        if tokenizer is None:
            return ShadowComparison(request_id, tenant, served.model, served.id, shadow.id,
                                    shadow.fingerprint, False, 0.0, 0, 0, error)
        eos = set(getattr(tokenizer, "eos_token_ids", ()) or ())
        tokens = [t for t in tokens if t not in eos]
        shadow_text = tokenizer.decode(tokens) if tokens else ""
        served_tokens = list(tokenizer.encode(text, add_special_tokens=False)) if text else []
        shadow_tokens = list(tokenizer.encode(shadow_text, add_special_tokens=False)) \
            if shadow_text else []
        agreement = 0.0 if error else token_agreement(served_tokens, shadow_tokens)
        return ShadowComparison(
            request_id=request_id, tenant=tenant, model=served.model,
            served_release=served.id, shadow_release=shadow.id,
            shadow_fingerprint=shadow.fingerprint,
            exact_match=error is None and shadow_text == text, token_agreement=agreement,
            served_tokens=len(served_tokens), shadow_tokens=len(shadow_tokens), error=error)

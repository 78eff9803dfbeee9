"""Draft-model proposer: a second, smaller (or cheaper-precision) model drafts k tokens.

The draft runs in its own :class:`ModelRunner` over its own KV pool (block tables kept
here, in a :class:`BlockPool` with caching off). Each engine step, for every sequence that
speculates, it catches its KV up with the sequence's committed tokens (a prefill chunk of
whatever it has not seen), then decodes ``k`` tokens autoregressively, all sequences
batched together: ``k`` draft forward passes per step.

Draft KV stays valid across steps for the prefix the target accepted: the proposer
remembers which drafts it wrote KV for and, next step, keeps the positions up to the first
draft the target rejected. A sequence that stops speculating loses its draft KV.

Greedy requests take the draft's argmax (a deterministic draft); sampled requests draw
from the draft's distribution ``q`` built with the request's own sampling parameters
(penalties, temperature, top-k/top-p/min-p), and ``q`` travels with the drafts to the
verifier, which accepts with probability ``min(1, p/q)``. A seeded request's draft draws
come from its own generator (seeded from the request's seed), so its output stays
reproducible.

The self-draft: the target's own checkpoint loaded again at a cheaper precision
(``--draft-model`` = the same path, ``--draft-quantization int4``).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Optional, Sequence

import torch

from llmserve.config import EngineConfig
from llmserve.default_model import resolve_model_path
from llmserve.engine.kv.block_pool import BlockPool, KVBlock
from llmserve.engine.request import Request
from llmserve.engine.step_types import SequenceSampling, StepInput
from llmserve.model.executor.capture import LogitsCapture
from llmserve.model.sampling.sampler import Sampler, SamplingBatch, inverse_cdf_draw
from llmserve.sampling_params import SamplingParams
from llmserve.spec_decode.proposers import EMPTY, Proposal
from llmserve.spec_decode.verifier import ExtendedTokens
from llmserve.spec_decode.wiring import TargetModel

logger = logging.getLogger(__name__)

_ARGMAX = SamplingParams(temperature=0.0, max_tokens=None)
_DRAFT_SEED_SALT = 0x5D_EC0DE


class _DraftSeq:
    """The draft's KV of one sequence: blocks, and the tokens whose KV is written."""

    __slots__ = ("blocks", "tokens", "generator")

    def __init__(self) -> None:
        self.blocks: list[KVBlock] = []
        self.tokens: list[int] = []     # the draft's view: committed tokens + drafts it wrote
        self.generator: Optional[torch.Generator] = None


class DraftModelProposer:
    """Proposes with a draft model (see the module docstring)."""

    def __init__(self, runner: Any, num_blocks: int, block_size: int, vocab_size: int,
                 eos_token_ids: Sequence[int] = (), seed: int = 0) -> None:
        self.runner = runner
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        # the blocks the draft runner committed at start first, then its reserve
        self.pool = BlockPool(num_blocks, enable_caching=False,
                              committed_blocks=runner.committed_blocks)
        self.seqs: dict[str, _DraftSeq] = {}
        self.shared_generator = torch.Generator().manual_seed(seed ^ _DRAFT_SEED_SALT)

    @classmethod
    def build(cls, config: EngineConfig, target: TargetModel) -> "DraftModelProposer":
        """Load the draft for ``target``; a draft with another tokenizer, or fewer
        vocabulary rows, is refused with a ValueError."""
        from llmserve.model.executor.runner import ModelRunner
        from llmserve.model.loading.loader import open_checkpoint
        from llmserve.tokenizer.tokenizer import Tokenizer

        path = resolve_model_path(config.speculative.draft_model)
        tokenizer = Tokenizer.from_path(path)
        if tokenizer.fingerprint != target.tokenizer_fingerprint:
            raise ValueError(f"draft model {path!r} has another tokenizer than the target "
                             f"model; speculative decoding needs the same one")
        ckpt = open_checkpoint(path)
        if ckpt.config.vocab_size < target.vocab_size:
            raise ValueError(f"draft model {path!r} has {ckpt.config.vocab_size} vocabulary "
                             f"rows, fewer than the target's {target.vocab_size}")
        target_len = target.max_model_len
        # compiled like the target's (its k decode passes a step are decode-only steps),
        # without the target's LoRA slots (their graphs could not be saved)
        draft_cfg = config.replace(
            model=path, quantization=config.speculative.draft_quantization, kv_cache_gib=None,
            num_kv_blocks=target.num_kv_blocks, speculative_method=None, draft_model=None,
            max_loras=0, lora_modules=())
        runner = ModelRunner(draft_cfg, ckpt, target_len, target.eos_token_ids,
                             sample_vocab_size=target.vocab_size)
        if runner.compiled is not None:
            # before the engine is ready (the request path never compiles): loaded where
            # saved, else compiled here, once per machine and draft
            t0 = time.time()
            runner.warmup()
            logger.info("draft model: compiled decode step ready in %.1fs", time.time() - t0)
        logger.info("draft model %s: %s, %.1f MB of weights, %d KV blocks, %s", path,
                    runner.quantization, runner.weight_bytes / 1e6, runner.num_blocks,
                    "compiled decode step" if runner.compiled is not None else "eager")
        return cls(runner, runner.num_blocks, config.cache.block_size, target.vocab_size,
                   target.eos_token_ids, config.model.seed)

    # ---- bookkeeping ---------------------------------------------------------------------
    def release(self, rid: str) -> None:
        """Free a sequence's draft KV (it ended, or stopped speculating)."""
        seq = self.seqs.pop(rid, None)
        if seq is not None and seq.blocks:
            self.pool.free(reversed(seq.blocks))

    def _reserve(self, seq: _DraftSeq, num_tokens: int) -> bool:
        need = -(-num_tokens // self.block_size) - len(seq.blocks)
        if need > self.pool.num_free_blocks:
            return False
        if need > 0:
            seq.blocks.extend(self.pool.allocate(need))
        return True

    @staticmethod
    def _valid_prefix(seq: _DraftSeq, tokens: Sequence[int]) -> int:
        """How many of the draft's written tokens the sequence still has (O(k))."""
        n = min(len(seq.tokens), len(tokens) - 1)
        i = n
        # the committed part never changes; only the drafts written past it can differ
        lo = max(0, n - 64)
        for j in range(lo, n):
            if seq.tokens[j] != tokens[j]:
                i = j
                break
        return i

    # ---- proposing -----------------------------------------------------------------------
    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> list[Proposal]:
        live = {r.request_id for r, k in zip(requests, num_tokens) if k > 0}
        for rid in [rid for rid in self.seqs if rid not in live]:
            self.release(rid)
        active: list[tuple[int, Request, int, _DraftSeq, int]] = []
        out: list[Proposal] = [EMPTY] * len(requests)
        for i, (req, k) in enumerate(zip(requests, num_tokens)):
            if k <= 0:
                continue
            seq = self.seqs.get(req.request_id)
            if seq is None:
                seq = self.seqs[req.request_id] = _DraftSeq()
            tokens = req.all_token_ids
            valid = self._valid_prefix(seq, tokens)
            if not self._reserve(seq, len(tokens) + k - 1):
                self.release(req.request_id)
                continue
            seq.tokens = list(tokens)
            active.append((i, req, k, seq, valid))
        if not active:
            return out
        drafts: list[list[int]] = [[] for _ in active]
        probs: list[list[torch.Tensor]] = [[] for _ in active]
        for j in range(max(k for _, _, k, _, _ in active)):
            rows = [a for a, (_, _, k, _, _) in enumerate(active) if k > j]
            step = StepInput()
            for a in rows:
                _, req, _, seq, valid = active[a]
                if j == 0:
                    new, start = seq.tokens[valid:], valid
                else:
                    new, start = [drafts[a][-1]], len(seq.tokens) + j - 1
                width = -(-(start + len(new)) // self.block_size)
                step.add(req.request_id, new, start, [b.block_id for b in seq.blocks[:width]],
                         1, SequenceSampling(_ARGMAX, (), ()))
            self.runner.capture = LogitsCapture.SAMPLED
            result = self.runner.execute(step)
            self._choose(active, rows, result, drafts, probs)
        for a, (i, _req, k, seq, _) in enumerate(active):
            seq.tokens.extend(drafts[a][:k - 1])   # the last draft's KV was never written
            q = torch.stack(probs[a]) if probs[a] else None
            out[i] = Proposal(drafts[a], draft_probs=q)
        return out

    def _choose(self, active, rows, result, drafts, probs) -> None:
        """Each row's next draft: the draft model's argmax for greedy requests, else a draw
        from q (the request's sampling applied to the draft's logits), kept for verifying."""
        where = {rid: n for n, rid in enumerate(result.request_ids)}
        at = [where[active[a][1].request_id] for a in rows]   # result order != step order
        sampled = []
        for p, a in enumerate(rows):
            if active[a][1].sampling_params.temperature > 0:
                sampled.append(p)
            else:
                drafts[a].append(result.token_ids[at[p]][0])
        if not sampled:
            return
        logits = result.logits[[at[p] for p in sampled]].to(self.runner.device)
        reqs = [active[rows[p]][1] for p in sampled]
        batch = SamplingBatch.build(
            [r.sampling_params for r in reqs], [r.prompt_token_ids for r in reqs],
            [ExtendedTokens(r.output_token_ids, drafts[rows[p]]) for r, p in zip(reqs, sampled)],
            [None] * len(reqs), logits.shape[-1], logits.device, self.eos_token_ids)
        x = Sampler.filter_logits(Sampler.process_logits(logits, batch), batch)
        q = torch.softmax(x, dim=-1)
        u = torch.empty(len(reqs), dtype=torch.float64)
        for n, r in enumerate(reqs):
            u[n] = torch.rand(1, dtype=torch.float64, generator=self._generator(r))[0]
        picked = inverse_cdf_draw(q, u).tolist()
        for n, p in enumerate(sampled):
            a = rows[p]
            drafts[a].append(picked[n])
            probs[a].append(q[n])

    def _generator(self, req: Request) -> torch.Generator:
        """A seeded request's own draft generator; the shared one for the others."""
        seed = req.sampling_params.seed
        if seed is None:
            return self.shared_generator
        seq = self.seqs[req.request_id]
        if seq.generator is None:
            seq.generator = torch.Generator().manual_seed((seed ^ _DRAFT_SEED_SALT) % 2**63)
        return seq.generator

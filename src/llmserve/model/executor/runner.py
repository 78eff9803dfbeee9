"""The model runner: the only engine component that touches tensors.

It owns the model, the paged KV pool, the attention backend, the compiled decode step and the
sampler. Each step it takes a torch-free :class:`StepInput`, lays the sequences out decodes
first (grouped by context width), fills preallocated index buffers (one host-to-device copy),
runs one forward pass (the compiled graph for decode-only steps, eager otherwise), and
samples the sequences that reached their end. It answers with a :class:`StepOutput`.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import torch

from llmserve.config import EngineConfig
from llmserve.engine.step_types import NonFiniteLogitsError, StepInput, StepOutput
from llmserve.lora.manager import LoraManager
from llmserve.model.attention.backend import make_backend
from llmserve.model.attention.reference import group_key
from llmserve.model.config import ModelConfig
from llmserve.model.executor.background_compile import BackgroundCompile
from llmserve.model.executor.capture import LogitsCapture
from llmserve.model.executor.compile import CompiledDecodeStep
from llmserve.model.executor.compiled_verify import CompiledVerifyStep
from llmserve.model.executor.huge_pages import collapse_module, thp_setting
from llmserve.model.executor.input_buffers import InputBuffers
from llmserve.model.executor.kernel_plan import format_kernel_plan, kernel_plan
from llmserve.model.executor.kv_cache import KVCachePool, plan_num_blocks
from llmserve.model.executor.pooler import Pooler
from llmserve.model.executor.sharding import RankSharding
from llmserve.model.layers.compiled_rows import enable_compiled_rows
from llmserve.model.loading.loader import CheckpointSource
from llmserve.model.models.registry import build_model
from llmserve.model.native.ops import self_test_results
from llmserve.model.platform import env_flag, resolve_device, resolve_dtype, resolve_kv_dtype
from llmserve.model.quant import describe_quantization, select_linear_method
from llmserve.model.sampling.logits_processors import LogitsAdjuster
from llmserve.model.sampling.prompt_logprobs import score_prompt_tokens
from llmserve.model.sampling.sampler import Sampler, SamplingBatch, row_max
from llmserve.spec_decode.verifier import verify_drafts

logger = logging.getLogger(__name__)


class ModelRunner:
    """Runs forward passes over the paged KV cache and samples."""

    def __init__(self, engine_config: EngineConfig, source: CheckpointSource, max_model_len: int,
                 eos_token_ids: frozenset[int] = frozenset(),
                 sample_vocab_size: Optional[int] = None,
                 sharding: Optional[RankSharding] = None) -> None:
        cfg = engine_config
        self.config = cfg
        self.model_config: ModelConfig = source.config
        # tensor parallelism: this rank's share of the model, or None for the whole model
        self.sharding = sharding
        self.device = sharding.device if sharding else resolve_device(cfg.model.device)
        self.dtype = resolve_dtype(cfg.model.dtype, self.device)
        self.kv_dtype = resolve_kv_dtype(cfg.cache.kv_cache_dtype, self.dtype)
        if cfg.model.num_threads:
            torch.set_num_threads(cfg.model.num_threads)
        self.block_size = cfg.cache.block_size
        mc = sharding.local_config(self.model_config) if sharding else self.model_config
        backend_name = "paged" if cfg.model.attention_backend == "auto" else cfg.model.attention_backend
        self.backend = make_backend(backend_name, mc.num_attention_heads, mc.num_key_value_heads,
                                    mc.head_dim, cfg.cache.block_size, self.dtype,
                                    self.kv_dtype, self.device)
        t0 = time.time()
        method = select_linear_method(cfg.model.quantization, cfg.model.quantization_group_size, mc,
                                      self.dtype, self.device, cfg.model.int4_activations)
        self.model = build_model(mc, self.backend, method, self.dtype, self.device,
                                 max_positions=max_model_len + 1)
        if sharding:
            sharding.shard(self.model, self.model_config, method)
        with torch.inference_mode():
            self.model.load_weights(source.iter_weights(   # TP slices float tensors
                raw_gguf=method.wants_raw_gguf and sharding is None))
        self.model.eval()
        self.lora = self._make_lora(cfg)   # None: no adapters, the layers stay unwrapped
        self.weight_bytes = self.model.weight_bytes
        huge_weights = collapse_module(self.model)   # 2 MB pages (huge_pages.py)
        self.quantization = describe_quantization(self.model)
        logger.info("weights: %.1f MB resident (%s, %s) in %.1fs", self.weight_bytes / 1e6,
                    str(self.dtype).replace("torch.", ""), self.quantization, time.time() - t0)
        requantized = getattr(method, "requantized", None)
        if requantized:
            logger.info("GGUF tensors off the packed kernels (dequantized, then int8 per "
                        "channel: a second rounding): %s",
                        ", ".join(f"{k} x{v}" for k, v in sorted(requantized.items())))
        self.num_blocks = plan_num_blocks(cfg, mc, self.kv_dtype, self.device, max_model_len)
        if sharding:   # block tables index every rank's pool: one size for all
            self.num_blocks = sharding.agree_min(self.num_blocks)
        # CPU pools commit memory as written: the first blocks now, the rest on demand
        self.committed_blocks = self.num_blocks if self.device.type != "cpu" else \
            min(self.num_blocks, -(-cfg.cache.kv_cache_commit_tokens // cfg.cache.block_size))
        self.kv = KVCachePool(mc, self.num_blocks, cfg.cache.block_size, self.kv_dtype, self.device,
                              commit_blocks=self.committed_blocks)
        self.kv_caches = self.kv.caches
        max_blocks = -(-max_model_len // cfg.cache.block_size)
        self.buffers = InputBuffers(max_tokens=max(cfg.scheduler.max_num_batched_tokens, cfg.scheduler.max_num_seqs),
                                    max_seqs=cfg.scheduler.max_num_seqs, max_blocks_per_seq=max_blocks,
                                    scratch_block=self.kv.scratch_block, device=self.device)
        self.sampler = Sampler(seed=cfg.model.seed)
        # logits past the tokenizer's vocabulary (checkpoint padding) are cut off before sampling
        self.sample_vocab_size = sample_vocab_size or self.model_config.vocab_size
        self.eos_token_ids = set(eos_token_ids)
        self.generators: dict[str, torch.Generator] = {}
        self.adjuster = LogitsAdjuster(self.device)   # logit_bias and grammar masks
        self.pooler = Pooler()   # embedding requests: hidden states -> vectors (pooler.py)
        #: which logits a step hands back beside its tokens (capture.py): the draft model
        #: reads its sampled rows, the quality eval every position's, parity tests both
        self.capture = LogitsCapture.NONE
        eager = cfg.model.enforce_eager if cfg.model.enforce_eager is not None else env_flag(
            "LLMSERVE_ENFORCE_EAGER")
        self.compiled: Optional[CompiledDecodeStep] = None
        #: False while compiled steps wait for their graphs (a background compile polled
        #: between steps: background_compile.py)
        self.graphs_ready = True
        self.pending_graphs: Optional[BackgroundCompile] = None
        self.compiled_verify: Optional[CompiledVerifyStep] = None   # drafts' verify steps
        if not eager and self.model.compile_unsupported:
            logger.warning("decode step runs eagerly: %s", self.model.compile_unsupported)
        elif not eager and self.lora is not None:
            logger.info("LoRA: decode steps with an adapter run eagerly (base-only steps use "
                        "the compiled graph)")
        if not eager and not self.model.compile_unsupported and sharding is None:  # no TP
            self.compiled = CompiledDecodeStep(self.model, self.backend, self.kv_caches,
                                               self.buffers, cfg.scheduler.max_num_seqs,
                                               static_model=self.lora is None)
            if cfg.speculative.method and self.backend.name == "paged":
                self.compiled_verify = CompiledVerifyStep(
                    self.model, self.backend, self.kv_caches, self.buffers,
                    min(cfg.scheduler.max_num_seqs, cfg.speculative.max_batch), cfg.speculative.num_speculative_tokens,
                    static_model=self.lora is None)
        logger.info("KV pool: %d blocks x %d tokens (%.2f GiB reserved, %s, %d B/token) on %s; "
                    "attention %s; %s", self.num_blocks, self.block_size,
                    self.kv.pool_bytes / 2**30, str(self.kv_dtype).replace("torch.", ""),
                    self.kv.bytes_per_token, self.device, self.backend.name,
                    "compiled decode step" if self.compiled else "eager")
        #: which implementation runs each operation (kernel_plan.py): logged, in /v1/status
        self.kernel_plan = kernel_plan(self.model, self.backend, str(self.dtype).replace(
            "torch.", ""), str(self.kv_dtype).replace("torch.", ""))
        self.kernel_plan["cpu"]["huge_pages"] = {   # not in the fingerprint
            "thp": thp_setting(), "weights_bytes": huge_weights,
            "kv_pool_bytes": self.kv.huge_page_bytes}
        logger.info("%s", format_kernel_plan(
            self.kernel_plan, "compiled decode step" if self.compiled else "eager"))

    def _make_lora(self, cfg: EngineConfig) -> Optional[LoraManager]:
        if cfg.lora.max_loras <= 0:
            return None
        if self.sharding is not None:
            raise ValueError("LoRA adapters are not supported with --tensor-parallel-size > 1")
        return LoraManager(self.model, cfg.lora.max_loras, cfg.lora.max_lora_rank, self.dtype, self.device)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv.bytes_per_token

    def warmup(self, load_only: bool = False) -> bool:
        """Make the compiled graphs ready now (the request path never compiles): the decode
        and verify steps and the element-wise work of eager many-row steps
        (layers/compiled_rows.py), loaded where they were saved, else compiled. With
        ``load_only`` nothing is compiled: False if a graph is missing, and the compiled
        steps stay off until a later call returns True (background_compile.py)."""
        ready = True
        if self.compiled is not None:
            missing = enable_compiled_rows(self.model, self.dtype, self.device, load_only)[1]
            ready = not missing and self.compiled.warmup(load_only)
        if ready and self.compiled_verify is not None:
            ready = self.compiled_verify.warmup(load_only)
        self.graphs_ready = ready
        # kernels checked while warming up (the many-row rotary) join the plan's list
        self.kernel_plan["native_kernels"] = self_test_results()
        return ready

    def grammar_stats(self) -> dict[str, float | int]:
        """The EngineStats fields of the grammar masks this runner applied."""
        return self.adjuster.matchers.as_engine_stats()

    def release(self, request_id: str) -> None:
        """Forget per-request state (its seeded generator, grammar, pooling sums)."""
        self.generators.pop(request_id, None)
        self.adjuster.release(request_id)
        self.pooler.release(request_id)

    # ---- one step -------------------------------------------------------------------------
    def poll_background_compile(self) -> None:
        """Load the graphs of a background compile that has finished (between steps, and
        while the engine is idle: an idle server runs its next request compiled)."""
        if self.pending_graphs is not None:
            self.pending_graphs.poll(self)

    def execute(self, step: StepInput) -> StepOutput:
        if step.num_seqs == 0:
            return StepOutput()
        self.poll_background_compile()
        for rid in step.finished_request_ids:
            self.release(rid)
        order = self._order(step)
        # LoRA steps and steps that pool hidden states (embeddings) run eagerly
        plain = (LogitsCapture.ALL not in self.capture and not step.prompt_logprob_targets
                 and not step.pooling and (self.lora is None or not any(step.loras)))
        plain = plain and self.graphs_ready
        compiled = (plain and self.compiled is not None and step.is_decode_only
                    and self.compiled.accepts(step.num_seqs))
        verify = None   # (sequences, rows) of a compiled verify step
        if plain and not compiled and self.compiled_verify is not None and all(
                n == s for n, s in zip(step.num_new_tokens, step.num_samples)):
            verify = self.compiled_verify.shape_for(step.num_seqs, max(step.num_new_tokens),
                                                    step.num_tokens)
        if verify is not None:
            staged = self.buffers.stage_uniform(step, order, self.block_size, rows=verify[1],
                                                 seqs=verify[0])
        else:
            staged = self.buffers.stage(step, order, self.block_size)
        if self.lora is not None:
            self.lora.prepare([step.loras[i] for i in order], staged.query_lens[:len(order)])
        logits_all = None
        with torch.inference_mode():
            hidden = logits = None
            if compiled:
                logits = self._rows_of_sampled(self.compiled(staged), step, order, 1)
            elif verify is not None:
                logits = self._rows_of_sampled(self.compiled_verify(staged, verify[1]), step,
                                               order, verify[1])
            else:
                meta = self.backend.build_metadata(staged.batch())
                hidden = self.model(staged.input_ids, staged.positions, self.kv_caches, meta)
                if LogitsCapture.ALL in self.capture:
                    logits_all = self.model.compute_logits(hidden)
            out = self._sample(step, order, staged, hidden, logits, logits_all)
            if step.pooling and (self.sharding is None or self.sharding.samples):
                out.pooled = self.pooler.pool(hidden, step, order, staged.row_starts,
                                              self.model.norm)
            if step.prompt_logprob_targets:
                out.prompt_logprobs = score_prompt_tokens(self.model, hidden, staged.row_starts,
                                                          order, step)
            return out

    def _order(self, step: StepInput) -> list[int]:
        """Sequence indices decodes first, then by (chunk length, table width) buckets."""
        keys = [(group_key(n, -(-(s + n) // self.block_size)), i) for i, (n, s) in
                enumerate(zip(step.num_new_tokens, step.start_positions))]
        keys.sort()
        return [i for _, i in keys]

    def _sample(self, step: StepInput, order: list[int], staged, hidden: Optional[torch.Tensor],
                logits: Optional[torch.Tensor], logits_all: Optional[torch.Tensor]) -> StepOutput:
        """Tokens for the sequences that sample this step.

        The logits of every sampled row (one per sequence, or ``k + 1`` for a sequence
        with ``k`` drafts) are computed once, on every rank (the vocab-parallel head is a
        collective); rank 0 then samples. Rows with drafts are verified; rows with
        logit_bias or a grammar never carry drafts (the engine does not propose for them)
        and take the sampler's path, which applies both.
        """
        out = StepOutput()
        sampled = [i for i in order if step.num_samples[i]]
        if logits_all is not None:
            out.all_logits = {}
            for pos, i in enumerate(order):
                r0 = staged.row_starts[pos]
                out.all_logits[step.request_ids[i]] = \
                    logits_all[r0:r0 + step.num_new_tokens[i]].float().cpu()
        if not sampled:
            return out
        if logits is None:
            logits = self._sampled_logits(step, order, staged, hidden, logits_all)
        if self.sharding is not None and not self.sharding.samples:
            return out   # workers only join the collectives; rank 0 samples
        if self.sample_vocab_size < logits.shape[-1]:
            logits = logits[:, :self.sample_vocab_size]
        if all(step.num_samples[i] == 1 for i in sampled):
            return self._sample_rows(step, sampled, logits, out)
        adjusted = {i for i in sampled if step.sampling[i].params.adjusts_logits}
        if not adjusted:
            return self._verify(step, sampled, logits, out)
        first_row, rows = {}, 0
        for i in sampled:
            first_row[i] = rows
            rows += step.num_samples[i]
        rest = [i for i in sampled if i not in adjusted]
        plain = [i for i in sampled if i in adjusted]
        verify_rows = [first_row[i] + j for i in rest for j in range(step.num_samples[i])]
        pick = torch.tensor(verify_rows + [first_row[i] for i in plain], device=logits.device)
        logits = logits.index_select(0, pick)
        # both halves run, so one error names every culprit; the plain half's seeded
        # generators are rewound if the step fails, as the sampler rewinds its own
        bad: list[str] = []
        gens = [self._generator(step.request_ids[i], step.sampling[i].params) for i in plain]
        saved = [(g, g.get_state()) for g in gens if g is not None]
        verified = sampled_rows = StepOutput()
        try:
            verified = self._verify(step, rest, logits[:len(verify_rows)], StepOutput())
        except NonFiniteLogitsError as exc:
            bad += exc.request_ids
        try:
            sampled_rows = self._sample_rows(step, plain, logits[len(verify_rows):], out)
        except NonFiniteLogitsError as exc:
            bad += exc.request_ids
        if bad:
            for gen, state in saved:
                gen.set_state(state)
            raise NonFiniteLogitsError(f"no finite logits to sample for {bad}", request_ids=bad)
        return _concat(verified, sampled_rows)

    @staticmethod
    def _rows_of_sampled(logits: torch.Tensor, step: StepInput, order: list[int],
                         rows: int) -> torch.Tensor:
        """From a compiled step's logits (``rows`` per sequence, in ``order``), those of
        the sampled rows: the last ``num_samples`` of each sequence, in order."""
        if rows == 1 and all(step.num_samples[i] for i in order):
            return logits[:len(order)]
        index = _sampled_row_index(step, order, [p * rows for p in range(len(order))])
        return logits.index_select(0, torch.tensor(index, device=logits.device))

    def _sampled_logits(self, step: StepInput, order: list[int], staged, hidden,
                        logits_all) -> torch.Tensor:
        """Logits of the last ``num_samples`` rows of each sampled sequence, in order."""
        index = torch.tensor(_sampled_row_index(step, order, staged.row_starts),
                             device=self.device)
        return (logits_all[index] if logits_all is not None
                else self.model.compute_logits(hidden.index_select(0, index)))

    def _sample_rows(self, step: StepInput, sampled: list[int], logits: torch.Tensor,
                     out: StepOutput) -> StepOutput:
        """Sample one token for each of the ``sampled`` sequences (one logits row each)."""
        if LogitsCapture.SAMPLED in self.capture:
            out.logits = logits.cpu()
        samp = [step.sampling[i] for i in sampled]
        out.request_ids = [step.request_ids[i] for i in sampled]
        try:
            if all(_plain_greedy(s) for s in samp):
                out.token_ids = [[t] for t in _argmax_tokens(logits)]
                return out
            gens = [self._generator(step.request_ids[i], s.params)
                    for i, s in zip(sampled, samp)]
            batch = SamplingBatch.build([s.params for s in samp],
                                        [s.prompt_token_ids for s in samp],
                                        [s.output_token_ids for s in samp], gens,
                                        logits.shape[-1], self.device, self.eos_token_ids)
            self.adjuster.attach(batch, samp, out.request_ids)
            result = self.sampler(logits, batch)
        except NonFiniteLogitsError as exc:
            raise _named(exc, step, sampled) from exc
        out.token_ids = [[t] for t in result.token_ids]
        if result.logprobs is not None:
            out.logprobs = [[lp] for lp in result.logprobs]
        if result.top_logprobs is not None:
            out.top_logprobs = [[t] for t in result.top_logprobs]
        return out

    def _verify(self, step: StepInput, sampled: list[int], logits: torch.Tensor,
                out: StepOutput) -> StepOutput:
        """Score every draft position of the sampled sequences (spec_decode/verifier.py)."""
        if LogitsCapture.SAMPLED in self.capture:
            out.logits = logits.cpu()
        out.request_ids = [step.request_ids[i] for i in sampled]
        gens = [self._generator(step.request_ids[i], step.sampling[i].params) for i in sampled]
        try:
            verified = verify_drafts(logits, step, sampled, gens, self.sampler, self.eos_token_ids)
        except NonFiniteLogitsError as exc:
            raise _named(exc, step, sampled) from exc
        out.token_ids, out.logprobs, out.top_logprobs = verified
        return out

    def _generator(self, request_id: str, params) -> Optional[torch.Generator]:
        seed = params.seed
        if seed is None or params.is_greedy:
            return None
        gen = self.generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(seed)
            self.generators[request_id] = gen
        return gen


def _sampled_row_index(step: StepInput, order: list[int], row_starts: list[int]) -> list[int]:
    """Rows of the sampled positions (the last ``num_samples`` of each sequence), for the
    sequences in ``order`` whose first rows are ``row_starts``."""
    rows: list[int] = []
    for start, i in zip(row_starts, order):
        end = start + step.num_new_tokens[i]
        rows.extend(range(end - step.num_samples[i], end))
    return rows


def _concat(a: StepOutput, b: StepOutput) -> StepOutput:
    """``b`` (which keeps its captures) with the sequences of ``a`` put first; logprobs
    are None for the sequences of a part that has none."""
    def lists(o: StepOutput, field: str, n: int) -> list:
        v = getattr(o, field)
        return v if v is not None else [None] * n
    na, nb = len(a.request_ids), len(b.request_ids)
    out = b
    for field in ("logprobs", "top_logprobs"):
        if getattr(a, field) is not None or getattr(b, field) is not None:
            setattr(out, field, lists(a, field, na) + lists(b, field, nb))
    out.request_ids = a.request_ids + b.request_ids
    out.token_ids = a.token_ids + b.token_ids
    if a.logits is not None and b.logits is not None:
        out.logits = torch.cat([a.logits, b.logits])
    return out


def _named(exc: NonFiniteLogitsError, step: StepInput, sampled: list[int]) -> NonFiniteLogitsError:
    """The sampler's error with its rows (indices into ``sampled``) named by request id."""
    ids = [step.request_ids[sampled[r]] for r in exc.rows]
    return NonFiniteLogitsError(f"no finite logits to sample for {ids}", request_ids=ids)


def _plain_greedy(s) -> bool:
    """Greedy on the raw logits: nothing changes or reports them this step."""
    p = s.params
    return (p.plain_greedy and not p.adjusts_logits
            and not (p.min_tokens and len(s.output_token_ids) < p.min_tokens))


def _argmax_tokens(logits: torch.Tensor) -> list[int]:
    """One pass: each row's argmax; a row with no finite maximum fails like the sampler."""
    values, index = row_max(logits)
    bad = ~torch.isfinite(values)
    tokens, bad_rows = torch.stack([index, bad.to(index.dtype)]).tolist()
    if any(bad_rows):
        rows = [i for i, b in enumerate(bad_rows) if b]
        raise NonFiniteLogitsError(f"cannot sample rows {rows}: their logits are NaN or all -inf",
                                   rows=rows)
    return tokens

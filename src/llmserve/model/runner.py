"""The model runner: the only engine component that touches tensors.

It owns the model weights, the paged KV pool and the sampler; each step it turns the
scheduler's decision (plain Python) into index tensors, runs one forward pass over all
scheduled tokens and samples one token for each sequence that reached its end.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

import torch

from llmserve.config import EngineConfig
from llmserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from llmserve.model.attention import AttentionMetadata, GroupMetadata
from llmserve.model.config import ModelConfig
from llmserve.model.decoder import DecoderModel
from llmserve.model.sampler import Sampler, SamplingBatch

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}
_DEFAULT_CPU_KV_GIB = 2.0


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return dev


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of float32, bfloat16, float16")
    return _DTYPES[name]


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V, every layer, one block: 2 * layers * block_size * kv_heads * head_dim * bytes."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * elem


def _available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(8 * 2**30)


@dataclass
class RunnerOutput:
    """Sampled tokens, in the order of the scheduled requests that sample."""

    request_ids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: Optional[list[float]] = None
    top_logprobs: Optional[list[list[tuple[int, float]]]] = None
    logits: Optional[torch.Tensor] = None          # (num_sampled, vocab) when capture is on
    all_logits: Optional[dict[str, torch.Tensor]] = None  # request id -> (num_new, vocab)


class ModelRunner:
    """Runs forward passes over the paged KV cache and samples."""

    def __init__(self, engine_config: EngineConfig, model_config: ModelConfig,
                 weights: dict[str, torch.Tensor], max_model_len: int,
                 eos_token_ids: frozenset[int] = frozenset(),
                 sample_vocab_size: Optional[int] = None) -> None:
        self.config = engine_config
        self.model_config = model_config
        self.device = resolve_device(engine_config.device)
        self.dtype = resolve_dtype(engine_config.dtype, self.device)
        if engine_config.num_threads:
            torch.set_num_threads(engine_config.num_threads)
        self.block_size = engine_config.block_size
        self.model = DecoderModel(model_config, weights, self.dtype, self.device,
                                  max_positions=max_model_len + 1)
        self.num_blocks = self._num_blocks()
        slots = self.num_blocks * self.block_size
        shape = (slots, model_config.num_key_value_heads, model_config.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device),
             torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(model_config.num_hidden_layers)
        ]
        self.sampler = Sampler(seed=engine_config.seed)
        # logits past the tokenizer's vocabulary (checkpoint padding) are cut off before sampling
        self.sample_vocab_size = sample_vocab_size or model_config.vocab_size
        self.eos_token_ids = set(eos_token_ids)
        self.generators: dict[str, torch.Generator] = {}
        self.capture_logits = False       # tests: keep the sampled rows' logits
        self.capture_all_logits = False   # tests: logits of every scheduled token
        logger.info("KV pool: %d blocks x %d tokens (%.2f GiB, %s on %s)", self.num_blocks,
                    self.block_size, self.kv_pool_bytes / 2**30, self.dtype, self.device)

    @property
    def kv_pool_bytes(self) -> int:
        return self.num_blocks * kv_bytes_per_block(self.model_config, self.block_size, self.dtype)

    def _num_blocks(self) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        per_block = kv_bytes_per_block(self.model_config, self.block_size, self.dtype)
        if cfg.kv_cache_gib is not None:
            budget = cfg.kv_cache_gib * 2**30
        else:
            budget = _available_memory_bytes(self.device) * cfg.kv_cache_fraction
            if self.device.type == "cpu":
                budget = min(budget, _DEFAULT_CPU_KV_GIB * 2**30)
        n = int(budget // per_block)
        if n < 1:
            raise ValueError(f"KV budget of {budget / 2**30:.3f} GiB is smaller than one block "
                             f"({per_block} bytes)")
        return n

    def release(self, request_id: str) -> None:
        """Forget per-request sampling state (its seeded generator)."""
        self.generators.pop(request_id, None)

    # ---- one step -------------------------------------------------------------------------
    def execute(self, sched: SchedulerOutput, block_tables: dict[str, list[int]]) -> RunnerOutput:
        keyed = sorted(((_group_key(s, block_tables[s.request.request_id]), s)
                        for s in sched.scheduled), key=lambda ks: ks[0])
        keys = [k for k, _ in keyed]
        ordered = [s for _, s in keyed]
        input_ids, positions, rows = [], [], []
        sample_rows: list[int] = []
        sampled: list[ScheduledRequest] = []
        for i, s in enumerate(ordered):
            toks = s.request.all_token_ids
            end = s.start + s.num_new_tokens
            input_ids.extend(toks[s.start:end])
            positions.extend(range(s.start, end))
            rows.extend([i] * s.num_new_tokens)
            if s.samples:
                sample_rows.append(len(input_ids) - 1)
                sampled.append(s)
        dev = self.device
        meta = self._attention_metadata(ordered, keys, positions, rows, block_tables)
        ids_t = torch.tensor(input_ids, dtype=torch.long, device=dev)
        pos_t = torch.tensor(positions, dtype=torch.long, device=dev)
        hidden = self.model.forward(ids_t, pos_t, meta, self.kv_caches)
        out = RunnerOutput()
        if self.capture_all_logits:
            logits_all = self.model.compute_logits(hidden)
            out.all_logits = {}
            for s, r0 in zip(ordered, _row_starts(ordered)):
                out.all_logits[s.request.request_id] = logits_all[r0:r0 + s.num_new_tokens].cpu()
        if not sampled:
            return out
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=dev)])
        if self.sample_vocab_size < logits.shape[-1]:
            logits = logits[:, :self.sample_vocab_size]
        if self.capture_logits:
            out.logits = logits.cpu()
        params = [s.request.sampling_params for s in sampled]
        gens = [self._generator(s.request) for s in sampled]
        batch = SamplingBatch.build(
            params,
            [s.request.prompt_token_ids for s in sampled],
            [s.request.output_token_ids for s in sampled],
            gens, logits.shape[-1], dev, self.eos_token_ids,
        )
        result = self.sampler(logits, batch)
        out.request_ids = [s.request.request_id for s in sampled]
        out.token_ids = result.token_ids
        out.logprobs = result.logprobs
        out.top_logprobs = result.top_logprobs
        return out

    def _generator(self, request) -> Optional[torch.Generator]:
        seed = request.sampling_params.seed
        if seed is None or request.sampling_params.is_greedy:
            return None
        gen = self.generators.get(request.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(seed)
            self.generators[request.request_id] = gen
        return gen

    def _attention_metadata(self, ordered: list[ScheduledRequest], keys: list[tuple[int, int]],
                            positions: list[int], rows: list[int],
                            block_tables: dict[str, list[int]]) -> AttentionMetadata:
        dev, bs = self.device, self.block_size
        tables = [block_tables[s.request.request_id] for s in ordered]
        width = max(len(t) for t in tables)
        bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=dev)
        pos_t = torch.tensor(positions, dtype=torch.long, device=dev)
        row_t = torch.tensor(rows, dtype=torch.long, device=dev)
        slot_mapping = bt[row_t, pos_t // bs] * bs + pos_t % bs
        groups = []
        i = token = 0
        while i < len(ordered):
            key = keys[i]
            j = i + 1
            while j < len(ordered) and keys[j] == key:
                j += 1
            members = ordered[i:j]
            n_tok = sum(s.num_new_tokens for s in members)
            w = max(len(t) for t in tables[i:j])
            if key[0] == 0:
                groups.append(self._decode_group(members, bt[i:j, :w], token))
            else:
                groups.append(self._prefill_group(members, bt[i:j, :w], token, n_tok))
            token += n_tok
            i = j
        return AttentionMetadata(slot_mapping=slot_mapping, block_size=bs, groups=groups)

    def _decode_group(self, members: list[ScheduledRequest], block_ids: torch.Tensor,
                      token_start: int) -> GroupMetadata:
        dev = self.device
        ctx = torch.tensor([s.start + 1 for s in members], device=dev)
        keys = torch.arange(block_ids.shape[1] * self.block_size, device=dev)
        mask = (keys.unsqueeze(0) < ctx.unsqueeze(1)).view(len(members), 1, 1, -1)
        return GroupMetadata(token_start=token_start, num_tokens=len(members),
                             block_ids=block_ids, mask=mask)

    def _prefill_group(self, members: list[ScheduledRequest], block_ids: torch.Tensor,
                       token_start: int, num_tokens: int) -> GroupMetadata:
        dev = self.device
        n = torch.tensor([s.num_new_tokens for s in members], device=dev)
        start = torch.tensor([s.start for s in members], device=dev)
        qmax = int(n.max())
        qi = torch.arange(qmax, device=dev).unsqueeze(0)           # (1, Qmax)
        valid = qi < n.unsqueeze(1)                                # (B, Qmax)
        offsets = torch.cumsum(n, 0) - n
        query_index = torch.where(valid, offsets.unsqueeze(1) + qi, 0).flatten()
        b = torch.arange(len(members), device=dev).unsqueeze(1)
        output_index = (b * qmax + qi)[valid]
        qpos = torch.where(valid, start.unsqueeze(1) + qi, 0)      # padded queries see key 0
        keys = torch.arange(block_ids.shape[1] * self.block_size, device=dev)
        mask = (keys.view(1, 1, -1) <= qpos.unsqueeze(-1)).unsqueeze(1)
        return GroupMetadata(token_start=token_start, num_tokens=num_tokens, block_ids=block_ids,
                             mask=mask, query_index=query_index, output_index=output_index,
                             max_query=qmax)


def _group_key(s: ScheduledRequest, table: list[int]) -> tuple[int, int]:
    """(0 for decode or log2 of the chunk length, log2 of the block-table width)."""
    n = s.num_new_tokens
    kind = 0 if n == 1 else max(1, (n - 1).bit_length())
    return kind, (max(1, len(table)) - 1).bit_length()


def _row_starts(ordered: list[ScheduledRequest]) -> list[int]:
    starts, acc = [], 0
    for s in ordered:
        starts.append(acc)
        acc += s.num_new_tokens
    return starts


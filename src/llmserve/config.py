"""Engine configuration: one frozen :class:`EngineConfig` composed of the settings of each
part it configures (no torch).

=================  ======================  =============================================
``config.model``   :class:`ModelOptions`    the checkpoint and how it runs (dtype, quantization,
                                            device, threads, compile, attention backend)
``config.cache``   :class:`CacheConfig`     the paged KV pool and the prefix cache
``config.scheduler`` :class:`SchedulerConfig`  the token budget and priorities
``config.parallel`` :class:`ParallelConfig` tensor-parallel ranks
``config.speculative`` :class:`~llmserve.spec_decode.config.SpecDecodeConfig`
``config.lora``    :class:`LoraConfig`      adapters and their slots
=================  ======================  =============================================

Each part receives its own section (the scheduler its ``SchedulerConfig``, the speculative
decoder its ``SpecDecodeConfig``); nothing copies fields from one to another. The CLI and
``LLM(...)`` speak flat flag names (``--max-num-seqs`` -> ``max_num_seqs``):
:meth:`EngineConfig.from_kwargs` places each in its section (:data:`FLAGS`) and
:meth:`EngineConfig.replace` changes some.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from llmserve.pooling_params import POOLING_METHODS
from llmserve.spec_decode.config import SpecDecodeConfig
from llmserve.structured_output.spec import JSON_WHITESPACE

INT4_ACTIVATIONS = ("auto", "int8", "bf16")
DTYPES = ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16")


@dataclass(frozen=True)
class ModelOptions:
    """The checkpoint and how its forward pass runs."""

    path: Optional[str] = None             # HF folder or .gguf file; None: the default model (--model)
    dtype: str = "auto"                    # auto (bf16 on CUDA / CPUs with native bf16, else fp32) | float32 | bfloat16 | float16
    quantization: str = "auto"             # auto (GGUF stays packed with bf16 on CPU) | none | int8 | int4
    quantization_group_size: int = 32      # int4 group size along the input dim: 32 | 64 | 128 | 256
    int4_activations: str = "auto"         # auto (int8 where the CPU has AVX512-VNNI; q/k/v of int4 groups bf16 with AVX512-BF16) | int8 | bf16
    device: str = "auto"                   # auto | cpu | cuda | cuda:N
    max_model_len: Optional[int] = None    # context length; None: the model's
    seed: int = 0                          # default generator seed for unseeded requests
    num_threads: Optional[int] = None      # torch CPU threads; None: torch's default
    enforce_eager: Optional[bool] = None   # True: never compile; None: env LLMSERVE_ENFORCE_EAGER, else compile
    compile_in_background: bool = False   # graphs not saved yet: compiled by a child process while steps run eagerly (serve's default)
    attention_backend: str = "auto"        # auto (paged) | paged | reference
    json_whitespace: str = "flexible"      # JSON answers (response_format...): flexible (whitespace between tokens, as vLLM) | compact
    pooling: str = "last"                  # embeddings (/v1/embeddings, LLM.embed): last | mean | cls position's final hidden state

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16; got {self.dtype!r}")
        if self.quantization not in ("auto", "none", "int8", "int4"):
            raise ValueError(f"quantization must be one of auto, none, int8, int4; "
                             f"got {self.quantization!r}")
        if self.quantization_group_size not in (32, 64, 128, 256):
            raise ValueError(f"quantization_group_size must be one of 32, 64, 128, 256; "
                             f"got {self.quantization_group_size}")
        if self.int4_activations not in INT4_ACTIVATIONS:
            raise ValueError(f"int4_activations must be one of {', '.join(INT4_ACTIVATIONS)}; "
                             f"got {self.int4_activations!r}")
        if self.json_whitespace not in JSON_WHITESPACE:
            raise ValueError(f"json_whitespace must be one of {', '.join(JSON_WHITESPACE)}; "
                             f"got {self.json_whitespace!r}")
        if self.pooling not in POOLING_METHODS:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_METHODS)}; "
                             f"got {self.pooling!r}")
        if self.attention_backend not in ("auto", "paged", "reference"):
            raise ValueError(f"attention_backend must be one of auto, paged, reference; "
                             f"got {self.attention_backend!r}")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool and the prefix cache."""

    block_size: int = 16                   # tokens per KV block
    kv_cache_dtype: str = "auto"           # auto (= dtype) | float32 | bfloat16 | float16 | int8 | fp8_e4m3
    kv_cache_gib: Optional[float] = None   # KV pool size; None: max_num_seqs x max_model_len tokens
    kv_cache_fraction: float = 0.5         # cap: this share of free memory when kv_cache_gib is None
    num_kv_blocks: Optional[int] = None    # overrides the memory budget (tests use tiny pools)
    kv_cache_commit_tokens: int = 5120     # CPU: KV tokens written at start; never-hit cached blocks are recycled before the pool commits more
    kv_cache_prefault_tokens: Optional[int] = None   # CPU: KV tokens committed in the background while idle (None: max_num_seqs x 256, at most 1 GiB; 0: off)
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        if self.kv_cache_gib is not None and self.kv_cache_gib <= 0:
            raise ValueError(f"kv_cache_gib must be > 0, got {self.kv_cache_gib}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_commit_tokens < 0:
            raise ValueError(f"kv_cache_commit_tokens must be >= 0, got "
                             f"{self.kv_cache_commit_tokens}")
        if self.kv_cache_prefault_tokens is not None and self.kv_cache_prefault_tokens < 0:
            raise ValueError(f"kv_cache_prefault_tokens must be >= 0, got "
                             f"{self.kv_cache_prefault_tokens}")
        if not 0 < self.kv_cache_fraction <= 1:
            raise ValueError(f"kv_cache_fraction must be in (0, 1], got {self.kv_cache_fraction}")
        if self.kv_cache_dtype not in DTYPES + ("int8", "fp8_e4m3"):
            raise ValueError(f"kv_cache_dtype must be one of auto, float32, bfloat16, float16, "
                             f"int8, fp8_e4m3; got {self.kv_cache_dtype!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's token budget, batch size and priority rules (engine/scheduler.py)."""

    max_num_seqs: int = 64                 # sequences per step
    max_num_batched_tokens: int = 2048     # token budget per step (prefill chunks + decodes)
    # prompt tokens per step (chunks of prefills); None or 0: no cap but the budget. 512
    # measured best for TTFT under load with throughput kept (docs/BENCHMARKS.md, "A prefill
    # cap per step")
    max_prefill_tokens_per_step: Optional[int] = 512
    aging_rate: float = 0.1                # priority classes gained per second of waiting
    preemption_cooldown_steps: int = 4     # a preempted request is not preempted again this soon

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_prefill_tokens_per_step is not None and self.max_prefill_tokens_per_step < 0:
            raise ValueError("max_prefill_tokens_per_step must be >= 0 (0: no cap), got "
                             f"{self.max_prefill_tokens_per_step}")
        if self.aging_rate < 0:
            raise ValueError(f"aging_rate must be >= 0, got {self.aging_rate}")


@dataclass(frozen=True)
class ParallelConfig:
    """How many ranks share each layer (docs/SCALING.md)."""

    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters served at start-up and the slots a step may use (docs/LORA.md)."""

    lora_modules: tuple = ()               # ((name, PEFT folder), ...) served at start-up
    max_loras: int = 0                     # LoRA slots (distinct adapters per step); 0: off
    max_lora_rank: int = 16                # largest adapter rank accepted

    def __post_init__(self) -> None:
        if self.max_loras < 0 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras must be >= 0 and max_lora_rank >= 1; got "
                             f"{self.max_loras} and {self.max_lora_rank}")
        if self.lora_modules and self.max_loras == 0:
            raise ValueError("lora_modules need max_loras >= 1 (LoRA slots)")


#: flag name (the CLI's, in snake case) -> (section of EngineConfig, field of that section)
FLAGS: dict[str, tuple[str, str]] = {
    **{f.name: ("model", f.name) for f in dataclasses.fields(ModelOptions) if f.name != "path"},
    "model": ("model", "path"),
    **{f.name: ("cache", f.name) for f in dataclasses.fields(CacheConfig)},
    **{f.name: ("scheduler", f.name) for f in dataclasses.fields(SchedulerConfig)},
    "tensor_parallel_size": ("parallel", "tensor_parallel_size"),
    **{f.name: ("lora", f.name) for f in dataclasses.fields(LoraConfig)},
    "speculative_method": ("speculative", "method"),
    "draft_model": ("speculative", "draft_model"),
    "draft_quantization": ("speculative", "draft_quantization"),
    "num_speculative_tokens": ("speculative", "num_speculative_tokens"),
    "ngram_min": ("speculative", "ngram_min"),
    "ngram_max": ("speculative", "ngram_max"),
    "suffix_max_depth": ("speculative", "suffix_max_depth"),
    "suffix_min_confidence": ("speculative", "suffix_min_confidence"),
    "suffix_cache_max_nodes": ("speculative", "suffix_cache_max_nodes"),
    "speculative_max_batch": ("speculative", "max_batch"),
    "speculative_adaptive": ("speculative", "adaptive"),
}


@dataclass(frozen=True)
class EngineConfig:
    """Everything that shapes an engine instance, one section per part (module docstring)."""

    model: ModelOptions = field(default_factory=ModelOptions)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpecDecodeConfig = field(default_factory=SpecDecodeConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        if self.lora.max_loras and self.parallel.tensor_parallel_size > 1:
            raise ValueError("LoRA adapters are not supported with --tensor-parallel-size > 1")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        """Build from flat flag names (``max_num_seqs=8``), rejecting unknown names with a
        clear message; a flag left out keeps its default."""
        return cls().replace(**kwargs)

    def replace(self, **kwargs: Any) -> "EngineConfig":
        """A copy with some flags (flat names, as :meth:`from_kwargs`) changed."""
        unknown = sorted(set(kwargs) - set(FLAGS))
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}; "
                            f"valid: {sorted(FLAGS)}")
        sections: dict[str, dict[str, Any]] = {}
        for name, value in kwargs.items():
            section, key = FLAGS[name]
            sections.setdefault(section, {})[key] = value
        return dataclasses.replace(self, **{
            section: dataclasses.replace(getattr(self, section), **values)
            for section, values in sections.items()})

    def flags(self) -> dict[str, Any]:
        """Every flag by its flat name (the inverse of :meth:`from_kwargs`)."""
        return {name: getattr(getattr(self, section), key)
                for name, (section, key) in FLAGS.items()}

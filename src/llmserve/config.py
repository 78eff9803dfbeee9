"""Engine configuration: one frozen dataclass whose fields are the CLI's engine flags."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

INT4_ACTIVATIONS = ("auto", "int8", "bf16")


@dataclass(frozen=True)
class EngineConfig:
    """Everything that shapes an engine instance.

    Field names are the CLI flags in snake case (``--kv-cache-gib`` -> ``kv_cache_gib``).
    """

    model: Optional[str] = None            # HF folder or .gguf file; None: the default model
    dtype: str = "auto"                    # auto (bf16 on CUDA / CPUs with native bf16, else fp32) | float32 | bfloat16 | float16
    kv_cache_dtype: str = "auto"           # auto (= dtype) | float32 | bfloat16 | float16 | int8 | fp8_e4m3
    quantization: str = "auto"             # auto (GGUF stays packed with bf16 on CPU) | none | int8 | int4
    quantization_group_size: int = 32      # int4 group size along the input dim: 32 | 64 | 128 | 256
    int4_activations: str = "auto"         # auto (int8 where the CPU has AVX512-VNNI) | int8 | bf16
    device: str = "auto"                   # auto | cpu | cuda | cuda:N
    block_size: int = 16                   # tokens per KV block
    kv_cache_gib: Optional[float] = None   # KV pool size; None: max_num_seqs x max_model_len tokens
    kv_cache_fraction: float = 0.5         # cap: this share of free memory when kv_cache_gib is None
    num_kv_blocks: Optional[int] = None    # overrides the memory budget (tests use tiny pools)
    kv_cache_commit_tokens: int = 5120     # CPU: KV tokens written at start; never-hit cached blocks are recycled before the pool commits more
    max_num_seqs: int = 64                 # sequences per step
    max_num_batched_tokens: int = 2048     # token budget per step (prefill chunks + decodes)
    max_prefill_tokens_per_step: Optional[int] = None  # cap on prefill tokens per step
    max_model_len: Optional[int] = None    # context length; None: the model's
    enable_prefix_caching: bool = True
    aging_rate: float = 0.1                # priority classes gained per second of waiting
    preemption_cooldown_steps: int = 4     # a preempted request is not preempted again this soon
    seed: int = 0                          # default generator seed for unseeded requests
    num_threads: Optional[int] = None      # torch CPU threads; None: torch's default
    enforce_eager: Optional[bool] = None   # True: never compile; None: env LLMSERVE_ENFORCE_EAGER, else compile
    attention_backend: str = "auto"        # auto (paged) | paged | reference
    # speculative decoding (docs/SPECULATIVE.md)
    speculative_method: Optional[str] = None  # None | ngram | draft
    num_speculative_tokens: int = 4        # most draft tokens per sequence and step (k)
    ngram_min: int = 1                     # n-gram proposer: shortest suffix matched
    ngram_max: int = 4                     # n-gram proposer: longest suffix matched
    draft_model: Optional[str] = None      # draft: HF folder or .gguf (same tokenizer)
    draft_quantization: str = "auto"       # draft weights: auto | none | int8 | int4
    speculative_max_batch: int = 16        # no speculation while more sequences run
    speculative_adaptive: bool = True      # per-request k from its acceptance rate
    tensor_parallel_size: int = 1          # ranks sharing each layer (model/parallel/)
    lora_modules: tuple = ()               # ((name, PEFT folder), ...) served at start-up
    max_loras: int = 0                     # LoRA slots (distinct adapters per step); 0: off
    max_lora_rank: int = 16                # largest adapter rank accepted

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.kv_cache_gib is not None and self.kv_cache_gib <= 0:
            raise ValueError(f"kv_cache_gib must be > 0, got {self.kv_cache_gib}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_commit_tokens < 0:
            raise ValueError(f"kv_cache_commit_tokens must be >= 0, got "
                             f"{self.kv_cache_commit_tokens}")
        if not 0 < self.kv_cache_fraction <= 1:
            raise ValueError(f"kv_cache_fraction must be in (0, 1], got {self.kv_cache_fraction}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16"):
            raise ValueError(
                f"dtype must be one of auto, float32, bfloat16, float16; got {self.dtype!r}"
            )
        if self.kv_cache_dtype not in ("auto", "float32", "bfloat16", "float16", "fp32", "bf16",
                                       "fp16", "int8", "fp8_e4m3"):
            raise ValueError(f"kv_cache_dtype must be one of auto, float32, bfloat16, float16, "
                             f"int8, fp8_e4m3; got {self.kv_cache_dtype!r}")
        if self.quantization not in ("auto", "none", "int8", "int4"):
            raise ValueError(f"quantization must be one of auto, none, int8, int4; "
                             f"got {self.quantization!r}")
        if self.quantization_group_size not in (32, 64, 128, 256):
            raise ValueError(f"quantization_group_size must be one of 32, 64, 128, 256; "
                             f"got {self.quantization_group_size}")
        if self.int4_activations not in INT4_ACTIVATIONS:
            raise ValueError(f"int4_activations must be one of {', '.join(INT4_ACTIVATIONS)}; "
                             f"got {self.int4_activations!r}")
        if self.attention_backend not in ("auto", "paged", "reference"):
            raise ValueError(f"attention_backend must be one of auto, paged, reference; "
                             f"got {self.attention_backend!r}")
        if self.speculative_method not in (None, "ngram", "draft"):
            raise ValueError(f"speculative_method must be ngram or draft (or None); "
                             f"got {self.speculative_method!r}")
        if (self.speculative_method == "draft") != (self.draft_model is not None):
            raise ValueError("draft_model is required by speculative_method 'draft' and used "
                             "by nothing else")
        if self.draft_quantization not in ("auto", "none", "int8", "int4"):
            raise ValueError(f"draft_quantization must be one of auto, none, int8, int4; "
                             f"got {self.draft_quantization!r}")
        self.spec_decode_config()  # validates k, the n-gram range and max_batch
        if self.max_loras < 0 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras must be >= 0 and max_lora_rank >= 1; got "
                             f"{self.max_loras} and {self.max_lora_rank}")
        if self.lora_modules and self.max_loras == 0:
            raise ValueError("lora_modules need max_loras >= 1 (LoRA slots)")
        if self.max_loras and self.tensor_parallel_size > 1:
            raise ValueError("LoRA adapters are not supported with --tensor-parallel-size > 1")
        if self.aging_rate < 0:
            raise ValueError(f"aging_rate must be >= 0, got {self.aging_rate}")

    def spec_decode_config(self):
        """The speculative-decoding settings as the engine's SpecDecodeConfig."""
        from llmserve.spec_decode.config import SpecDecodeConfig

        return SpecDecodeConfig(num_speculative_tokens=self.num_speculative_tokens,
                                ngram_min=self.ngram_min, ngram_max=self.ngram_max,
                                max_batch=self.speculative_max_batch,
                                adaptive=self.speculative_adaptive)

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> "EngineConfig":
        """Build from keyword args, rejecting unknown names with a clear message."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}; valid: {sorted(names)}")
        return cls(**kwargs)  # type: ignore[arg-type]

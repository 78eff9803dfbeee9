"""Architecture description of a decoder-only model, independent of where it was loaded from."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

#: Architectures we can run, by HF `architectures[0]` / GGUF `general.architecture`.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class ModelConfig:
    """The numbers the model code needs. One class covers Llama/Mistral/Qwen2/Qwen3.

    Family differences are flags: `attention_bias` (Qwen2 q/k/v bias), `qk_norm`
    (Qwen3 per-head RMSNorm on q and k).
    """

    architecture: str                 # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None   # HF rope_scaling dict (e.g. rope_type "llama3"), or None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    torch_dtype: Optional[str] = None     # the checkpoint's dtype, informative
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    source_format: str = "hf"             # "hf" | "gguf"
    quantization: Optional[str] = None    # e.g. "gguf:Q4_1" for dequantized GGUF weights

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

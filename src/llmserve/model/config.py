"""Architecture description of a decoder-only model, independent of where it was loaded from."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

#: Architectures we can run: HF ``architectures[0]`` -> ``ModelConfig.architecture``. The model
#: class of each is chosen by ``llmserve.model.models.registry``.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}

#: ``layer_types`` entries: every layer attends either to its whole context or to a window.
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"


def interleaved_layer_types(layers: int, period: int) -> tuple[str, ...]:
    """``layer_types`` where every ``period``-th layer attends to its whole context and the
    others slide (Gemma 2: period 2, Gemma 3: 6); all full attention when ``period`` < 1."""
    return tuple(SLIDING_ATTENTION if period > 0 and (i + 1) % period else FULL_ATTENTION
                 for i in range(layers))


@dataclass(frozen=True)
class ModelConfig:
    """The numbers the model code needs, for every supported family.

    Family differences are fields with neutral defaults: ``attention_bias`` (Qwen2 q/k/v
    bias), ``qk_norm`` (Qwen3/Gemma3 per-head RMSNorm on q and k), ``sliding_window`` with
    ``layer_types`` (Mistral: every layer; Gemma: alternating local/global), soft-capping
    (Gemma 2), the mixture-of-experts sizes (Mixtral, Qwen-MoE).
    """

    architecture: str                 # a key of models.registry.MODEL_FAMILIES
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
    # --- attention variants -----------------------------------------------------------------
    sliding_window: Optional[int] = None  # keys a sliding layer sees: (pos - window, pos]
    layer_types: tuple[str, ...] = ()     # per layer FULL_ATTENTION | SLIDING_ATTENTION; empty:
    #                                       every layer slides when sliding_window is set
    attn_logit_softcapping: Optional[float] = None    # scores -> cap * tanh(scores / cap)
    final_logit_softcapping: Optional[float] = None   # logits -> cap * tanh(logits / cap)
    query_pre_attn_scalar: Optional[float] = None     # attention scale 1/sqrt(this) (Gemma)
    local_rope_theta: Optional[float] = None          # rope base of sliding layers (Gemma 3)
    # --- mixture of experts -----------------------------------------------------------------
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0        # each routed expert's hidden size (Qwen-MoE)
    shared_expert_intermediate_size: int = 0   # Qwen2-MoE's always-on expert (0: none)
    norm_topk_prob: bool = True           # renormalise the top-k routing weights to sum 1
    decoder_sparse_step: int = 1          # every n-th layer is sparse (Qwen-MoE)
    mlp_only_layers: tuple[int, ...] = () # dense-MLP layers of a MoE model (Qwen-MoE)

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for "
                             f"{self.num_hidden_layers} layers")
        bad = set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}
        if bad:
            raise ValueError(f"unsupported layer types {sorted(bad)}; supported: "
                             f"{FULL_ATTENTION}, {SLIDING_ATTENTION}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in "
                             f"1..num_experts ({self.num_experts})")

    def layer_window(self, layer: int) -> Optional[int]:
        """The sliding window of ``layer``, or None when it attends to its whole context."""
        if self.sliding_window is None:
            return None
        if not self.layer_types or self.layer_types[layer] == SLIDING_ATTENTION:
            return self.sliding_window
        return None

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is a mixture of experts."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

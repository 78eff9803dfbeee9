"""The Phi-3 family (Phi-3, Phi-3.5, Phi-4 with full rotary): a Llama-shaped decoder whose
checkpoint stores the projections already fused.

``self_attn.qkv_proj`` (q rows, then k, then v) and ``mlp.gate_up_proj`` (gate rows, then
up) load whole into the fused :class:`Linear` layers (``shard`` None), so every
``LinearMethod`` packs them as one matrix. LongRoPE (``rope_type`` longrope / su) is handled
by the rotary table (layers/rotary.py: the short or long factor set, fixed per engine by its
context length, and the attention factor on cos/sin). ``sliding_window`` (Phi-3-mini: 2047)
applies to every layer, as in transformers.
"""
from __future__ import annotations

from llmserve.model.config import ModelConfig
from llmserve.model.models.base import Shapes
from llmserve.model.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3: pre-norm, SwiGLU, rotary (LongRoPE), fused qkv and gate_up in the checkpoint.

    Its layers are Llama's (``make_layer``, no o_proj bias); only the checkpoint names differ.
    """

    renames: dict = {}   # checkpoint names are the module names: no per-shard tensors

    @classmethod
    def layer_weight_shapes(cls, cfg: ModelConfig, layer: int, prefix: str) -> Shapes:
        h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        q_rows, kv_rows = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
        return {prefix + "input_layernorm.weight": (h,),
                prefix + "post_attention_layernorm.weight": (h,),
                prefix + "self_attn.qkv_proj.weight": (q_rows + 2 * kv_rows, h),
                prefix + "self_attn.o_proj.weight": (h, q_rows),
                prefix + "mlp.gate_up_proj.weight": (2 * i, h),
                prefix + "mlp.down_proj.weight": (h, i)}

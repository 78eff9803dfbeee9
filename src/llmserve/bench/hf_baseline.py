"""Build a Hugging Face transformers model holding exactly the weights llmserve loads.

For a GGUF file this is the dequantized, un-permuted tensors (transformers' own GGUF path
needs `accelerate`); for an HF folder it is `from_pretrained`. Used by the offline benchmark
baseline and by parity tests.
"""
from __future__ import annotations

import os


def transformers_config(mc):
    """The transformers config equal to an llmserve ModelConfig."""
    import transformers

    common = dict(
        vocab_size=mc.vocab_size, hidden_size=mc.hidden_size,
        intermediate_size=mc.intermediate_size, num_hidden_layers=mc.num_hidden_layers,
        num_attention_heads=mc.num_attention_heads, num_key_value_heads=mc.num_key_value_heads,
        head_dim=mc.head_dim, rms_norm_eps=mc.rms_norm_eps, rope_theta=mc.rope_theta,
        max_position_embeddings=mc.max_position_embeddings,
        tie_word_embeddings=mc.tie_word_embeddings, rope_scaling=mc.rope_scaling,
    )
    if mc.architecture == "qwen2":
        return transformers.Qwen2Config(**common)
    if mc.architecture == "qwen3":
        return transformers.Qwen3Config(**common)
    return transformers.LlamaConfig(attention_bias=mc.attention_bias, **common)


def load_transformers_model(model_path: str, dtype: str = "float32"):
    """An eval-mode transformers causal LM with llmserve's weights for ``model_path``."""
    import torch
    import transformers

    from llmserve.model.loading.loader import load_checkpoint

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                   "float16": torch.float16}[dtype]
    if os.path.isdir(model_path):
        model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype)
        return model.eval()
    ckpt = load_checkpoint(model_path)
    cls = {"qwen2": transformers.Qwen2ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM}.get(
        ckpt.config.architecture, transformers.LlamaForCausalLM)
    model = cls(transformers_config(ckpt.config))
    missing, unexpected = model.load_state_dict(ckpt.weights, strict=False)
    if unexpected or not set(missing) <= {"lm_head.weight"}:
        raise RuntimeError(f"weights do not fit: missing {missing}, unexpected {unexpected}")
    if ckpt.config.tie_word_embeddings:
        model.tie_weights()
    return model.to(torch_dtype).eval()

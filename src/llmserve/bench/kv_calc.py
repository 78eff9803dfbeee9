"""KV-cache and weight-memory calculator (``llmserve kv-calc``).

Theoretical KV bytes for ``batch`` sequences of ``seq_len`` tokens::

    2 (K and V) x layers x batch x kv_heads x seq_len x head_dim x bytes_per_element

shown for the model as it is and for its attention variants with the same query heads:

* MHA: kv_heads = attention heads;
* GQA: the model's own kv_heads when 1 < kv_heads < heads, otherwise the largest divisor
  of the head count that is > 1 and <= heads / 4 (or the smallest divisor > 1 when none is),
  absent when the head count has no divisor strictly between 1 and itself;
* MQA: kv_heads = 1.

Next to it, the engine's paged pool: each sequence holds whole blocks, so it occupies
ceil(seq_len / block_size) * block_size token slots. The pool's bytes per token come from
the engine's own ``llmserve.model.kv_cache.kv_bytes_per_block`` when ``measure_pool=True``
(this imports torch, lazily; only float32/bfloat16/float16 pools exist in the engine),
otherwise from the formula above.

Weights: parameter count from the config (embeddings, attention, MLP, norms, LM head unless
tied) x bytes of ``weights_dtype``; for a GGUF file also its size on disk and the bytes of
its (quantized) tensors.

Everything here except :func:`load_config` and :func:`engine_pool_bytes_per_token` is pure.
"""
from __future__ import annotations

import math
import os
from typing import Optional

from llmserve.model.config import ModelConfig

#: Bytes per element of each supported KV / weight dtype name.
DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2,
               "int8": 1, "fp8": 1}
_ENGINE_DTYPES = {"float32", "fp32", "bfloat16", "bf16", "float16", "fp16"}


def dtype_bytes(name: str) -> int:
    """Bytes per element of a dtype name (see :data:`DTYPE_BYTES`)."""
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


def kv_cache_bytes(num_layers: int, batch: int, num_kv_heads: int, seq_len: int, head_dim: int,
                   bytes_per_element: int) -> int:
    """2 x layers x batch x kv_heads x seq_len x head_dim x bytes."""
    for name, v in (("num_layers", num_layers), ("batch", batch), ("num_kv_heads", num_kv_heads),
                    ("seq_len", seq_len), ("head_dim", head_dim),
                    ("bytes_per_element", bytes_per_element)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    return 2 * num_layers * batch * num_kv_heads * seq_len * head_dim * bytes_per_element


def gqa_kv_heads(num_heads: int, model_kv_heads: int) -> Optional[int]:
    """KV heads of the GQA variant (see the module docstring); None when there is none."""
    if 1 < model_kv_heads < num_heads:
        return model_kv_heads
    divisors = [d for d in range(2, num_heads) if num_heads % d == 0]
    if not divisors:
        return None
    small = [d for d in divisors if d <= num_heads / 4]
    return max(small) if small else min(divisors)


def attention_variants(config: ModelConfig) -> list[tuple[str, int]]:
    """(name, kv_heads) for the model as it is, MHA, GQA (when one exists) and MQA."""
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    kind = "MHA" if kv == heads else ("MQA" if kv == 1 else "GQA")
    out = [(f"as-is ({kind})", kv), ("MHA", heads)]
    gqa = gqa_kv_heads(heads, kv)
    if gqa is not None:
        out.append(("GQA", gqa))
    out.append(("MQA", 1))
    return out


def weight_param_counts(config: ModelConfig) -> dict[str, int]:
    """Parameter count by part, and ``total``."""
    h, d = config.hidden_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    attn = h * q + 2 * h * kv + q * h
    if config.attention_bias:
        attn += q + 2 * kv + (h if config.architecture == "llama" else 0)
    if config.qk_norm:
        attn += 2 * d
    layers = config.num_hidden_layers
    counts = {
        "embeddings": config.vocab_size * h,
        "attention": layers * attn,
        "mlp": layers * 3 * h * config.intermediate_size,
        "norms": layers * 2 * h + h,
        "lm_head": 0 if config.tie_word_embeddings else config.vocab_size * h,
    }
    counts["total"] = sum(counts.values())
    return counts


def kv_report(config: ModelConfig, *, seq_len: Optional[int] = None, batch: int = 1,
              kv_dtype: str = "bfloat16", block_size: int = 16, weights_dtype: str = "bfloat16",
              pool_bytes_per_token: Optional[int] = None, kv_budget_gib: Optional[float] = None,
              model_path: Optional[str] = None, gguf_tensor_bytes: Optional[int] = None) -> dict:
    """All kv-calc figures as a JSON-ready dict.

    ``seq_len`` None means the model's context length. ``pool_bytes_per_token`` is the
    engine's measured figure (see :func:`engine_pool_bytes_per_token`); None uses the formula.
    """
    seq_len = config.max_position_embeddings if seq_len is None else seq_len
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    nbytes = dtype_bytes(kv_dtype)
    layers, hd = config.num_hidden_layers, config.head_dim
    mha_total = kv_cache_bytes(layers, batch, config.num_attention_heads, seq_len, hd, nbytes)
    variants = []
    for name, kv_heads in attention_variants(config):
        total = kv_cache_bytes(layers, batch, kv_heads, seq_len, hd, nbytes)
        variants.append({
            "name": name, "num_kv_heads": kv_heads,
            "group_size": config.num_attention_heads // kv_heads,
            "bytes_per_token": kv_cache_bytes(layers, 1, kv_heads, 1, hd, nbytes),
            "total_bytes": total, "ratio_vs_mha": total / mha_total,
        })
    formula_per_token = variants[0]["bytes_per_token"]
    per_token = formula_per_token if pool_bytes_per_token is None else pool_bytes_per_token
    slots = math.ceil(seq_len / block_size) * block_size
    pool = {
        "source": "formula" if pool_bytes_per_token is None else "engine",
        "block_size": block_size, "bytes_per_token": per_token,
        "bytes_per_block": per_token * block_size,
        "blocks_per_sequence": slots // block_size, "token_slots_per_sequence": slots,
        "bytes_per_sequence": slots * per_token, "total_bytes": batch * slots * per_token,
        "rounding_overhead_fraction": (slots - seq_len) / seq_len,
    }
    if kv_budget_gib is not None:
        blocks = int(kv_budget_gib * 2**30 // pool["bytes_per_block"])
        pool.update({"budget_gib": kv_budget_gib, "budget_blocks": blocks,
                     "budget_max_sequences": blocks // pool["blocks_per_sequence"]})
    params = weight_param_counts(config)
    weights: dict = {"dtype": weights_dtype, "params": params,
                     "bytes": params["total"] * dtype_bytes(weights_dtype)}
    if model_path and model_path.endswith(".gguf") and os.path.isfile(model_path):
        weights["gguf_file_bytes"] = os.path.getsize(model_path)
        weights["gguf_quantization"] = config.quantization
    if gguf_tensor_bytes is not None:
        weights["gguf_tensor_bytes"] = gguf_tensor_bytes
    return {
        "model": model_path, "architecture": config.architecture,
        "config": {"num_hidden_layers": layers, "num_attention_heads": config.num_attention_heads,
                   "num_key_value_heads": config.num_key_value_heads, "head_dim": hd,
                   "hidden_size": config.hidden_size, "vocab_size": config.vocab_size,
                   "max_position_embeddings": config.max_position_embeddings},
        "seq_len": seq_len, "batch": batch, "kv_dtype": kv_dtype, "kv_dtype_bytes": nbytes,
        "kv_bytes": variants[0]["total_bytes"], "variants": variants, "pool": pool,
        "weights": weights,
    }


def load_config(model: Optional[str]) -> tuple[ModelConfig, str, Optional[int]]:
    """(config, resolved path, GGUF tensor bytes or None) for a path or ``default``.

    GGUF headers are read without torch; an HF folder goes through
    ``llmserve.model.loader.load_model_config`` (which imports torch).
    """
    from llmserve.default_model import resolve_model_path

    path = resolve_model_path(model)
    if path.endswith(".gguf"):
        from llmserve.model.gguf_loader import gguf_model_config, read_gguf

        gguf_file = read_gguf(path)
        tensor_bytes = sum(t.nbytes for t in gguf_file.tensors.values())
        return gguf_model_config(gguf_file), path, tensor_bytes
    from llmserve.model.loader import load_model_config

    return load_model_config(path), path, None


def engine_pool_bytes_per_token(config: ModelConfig, block_size: int, kv_dtype: str
                                ) -> Optional[int]:
    """The engine's own pool figure (imports torch); None for dtypes it has no pool for."""
    if kv_dtype not in _ENGINE_DTYPES:
        return None
    import torch

    from llmserve.model.kv_cache import kv_bytes_per_block

    torch_dtype = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                   "bf16": torch.bfloat16, "float16": torch.float16,
                   "fp16": torch.float16}[kv_dtype]
    per_block = kv_bytes_per_block(config, block_size, torch_dtype)
    if per_block % block_size:
        raise ValueError(f"engine block of {per_block} bytes is not a whole number of tokens")
    return per_block // block_size


def format_bytes(n: float) -> str:
    """Human-readable binary size (B, KiB, MiB, GiB, TiB)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def render_text(rep: dict) -> str:
    """The human-readable kv-calc report."""
    c, pool, w = rep["config"], rep["pool"], rep["weights"]
    lines = [
        f"model: {rep['model']} ({rep['architecture']}: {c['num_hidden_layers']} layers, "
        f"{c['num_attention_heads']} heads, {c['num_key_value_heads']} kv heads, "
        f"head_dim {c['head_dim']})",
        f"seq_len {rep['seq_len']}, batch {rep['batch']}, kv dtype {rep['kv_dtype']} "
        f"({rep['kv_dtype_bytes']} B)", "",
        f"{'variant':<14}{'kv heads':>9}{'bytes/token':>14}{'total':>14}{'vs MHA':>9}",
    ]
    for v in rep["variants"]:
        lines.append(f"{v['name']:<14}{v['num_kv_heads']:>9}{v['bytes_per_token']:>14,}"
                     f"{format_bytes(v['total_bytes']):>14}{v['ratio_vs_mha']:>9.3f}")
    lines += ["", f"engine pool ({pool['source']}): block_size {pool['block_size']}, "
              f"{pool['bytes_per_token']:,} B/token, {pool['blocks_per_sequence']} blocks = "
              f"{pool['token_slots_per_sequence']} slots/sequence, "
              f"{format_bytes(pool['total_bytes'])} for the batch "
              f"(+{100 * pool['rounding_overhead_fraction']:.2f}% rounding)"]
    if "budget_gib" in pool:
        lines.append(f"  a {pool['budget_gib']} GiB pool holds {pool['budget_blocks']} blocks: "
                     f"{pool['budget_max_sequences']} sequences of this length")
    lines.append(f"weights: {w['params']['total']:,} params = {format_bytes(w['bytes'])} "
                 f"in {w['dtype']}")
    if "gguf_file_bytes" in w:
        lines.append(f"  GGUF file ({w.get('gguf_quantization')}): "
                     f"{format_bytes(w['gguf_file_bytes'])}"
                     + (f", tensors {format_bytes(w['gguf_tensor_bytes'])}"
                        if "gguf_tensor_bytes" in w else ""))
    return "\n".join(lines)

"""KV-cache and weight-memory calculator (``llmserve kv-calc``).

Theoretical KV bytes for ``batch`` sequences of ``seq_len`` tokens::

    2 (K and V) x layers x batch x kv_heads x seq_len x (head_dim x bytes_per_element + scale)

(``scale``: 4 bytes per token and head in the engine's int8 / fp8_e4m3 caches, 0 otherwise;
the theoretical ``fp8`` has none.)

shown for the model as it is and for its attention variants with the same query heads:

* MHA: kv_heads = attention heads;
* GQA: the model's own kv_heads when 1 < kv_heads < heads, otherwise the largest divisor
  of the head count that is > 1 and <= heads / 4 (or the smallest divisor > 1 when none is),
  absent when the head count has no divisor strictly between 1 and itself;
* MQA: kv_heads = 1.

Next to it, the engine's paged pool: each sequence holds whole blocks, so it occupies
ceil(seq_len / block_size) * block_size token slots. The pool's bytes per token come from
the engine's own ``llmserve.model.executor.kv_cache.kv_bytes_per_block`` when ``measure_pool=True``
(this imports torch, lazily; float32/bfloat16/float16/int8/fp8_e4m3 pools exist in the
engine), otherwise from the formula above.

Weights: parameter count from the config (embeddings, attention, MLP, norms, LM head unless
tied) x bytes of ``weights_dtype``; estimates with the linears quantized (int8 per channel,
int4 in groups); for a GGUF file also its size on disk and the bytes of its (quantized)
tensors.

Everything here except :func:`load_config` and :func:`engine_pool_bytes_per_token` is pure.
"""
from __future__ import annotations

import math
import os
from typing import Optional

from llmserve.model.config import ModelConfig

#: Bytes per element of each supported KV / weight dtype name.
DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2,
               "int8": 1, "fp8": 1, "fp8_e4m3": 1}
#: Scale bytes per token, head and K/V of the engine's quantized caches (a float32 each).
KV_SCALE_BYTES = {"int8": 4, "fp8_e4m3": 4}
_ENGINE_DTYPES = {"float32", "fp32", "bfloat16", "bf16", "float16", "fp16", "int8", "fp8_e4m3"}
#: Resident bytes per weight of the engine's quantized linears, and per-row / per-group extras.
_INT8_ROW_SCALE_BYTES = 2            # bf16 scale per output row
_INT4_GROUP_BYTES = 4                # bf16 scale + bf16 zero per group


def dtype_bytes(name: str) -> int:
    """Bytes per element of a dtype name (see :data:`DTYPE_BYTES`)."""
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


def kv_cache_bytes(num_layers: int, batch: int, num_kv_heads: int, seq_len: int, head_dim: int,
                   bytes_per_element: int, scale_bytes: int = 0) -> int:
    """2 x layers x batch x kv_heads x seq_len x (head_dim x bytes + scale_bytes).

    ``scale_bytes``: per token and head, what a quantized cache stores beside the codes
    (:data:`KV_SCALE_BYTES`)."""
    for name, v in (("num_layers", num_layers), ("batch", batch), ("num_kv_heads", num_kv_heads),
                    ("seq_len", seq_len), ("head_dim", head_dim),
                    ("bytes_per_element", bytes_per_element)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    return 2 * num_layers * batch * num_kv_heads * seq_len * (head_dim * bytes_per_element
                                                                + scale_bytes)


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


def quantized_weight_bytes(config: ModelConfig, fmt: str, weights_dtype: str = "bfloat16",
                           quantized_table: bool = False) -> int:
    """Resident bytes with every linear in ``fmt`` (``int8`` or ``int4-g<G>``), estimated.

    Linears (attention, MLP, an untied LM head): int8 = 1 B/weight + a bf16 scale per output
    row; int4 = 0.5 B/weight + 4 B (bf16 scale and zero) per group of G along the input.
    The embedding and norms stay in ``weights_dtype``, except a GGUF file's quantized table
    (``quantized_table``), which the engine keeps as int8 rows (1 B/weight + 2 B per row).
    """
    h, d = config.hidden_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    shapes = [(q + 2 * kv, h), (h, q), (2 * config.intermediate_size, h),
              (h, config.intermediate_size)]                  # (out, in) per layer
    layers = [(n, k) for n, k in shapes for _ in range(config.num_hidden_layers)]
    if not config.tie_word_embeddings:
        layers.append((config.vocab_size, h))
    if fmt == "int8":
        linear = sum(n * k + n * _INT8_ROW_SCALE_BYTES for n, k in layers)
    elif fmt.startswith("int4-g") and fmt[6:].isdigit():
        g = int(fmt[6:])
        linear = sum(n * k // 2 + n * -(-k // g) * _INT4_GROUP_BYTES for n, k in layers)
    else:
        raise ValueError(f"unknown quantized format {fmt!r}; use int8 or int4-g<group>")
    counts = weight_param_counts(config)
    rest = counts["norms"] * dtype_bytes(weights_dtype)
    if quantized_table:
        rest += counts["embeddings"] + config.vocab_size * _INT8_ROW_SCALE_BYTES
    else:
        rest += counts["embeddings"] * dtype_bytes(weights_dtype)
    return linear + rest


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
    scale = KV_SCALE_BYTES.get(kv_dtype, 0)
    layers, hd = config.num_hidden_layers, config.head_dim
    mha_total = kv_cache_bytes(layers, batch, config.num_attention_heads, seq_len, hd, nbytes,
                               scale)
    variants = []
    for name, kv_heads in attention_variants(config):
        total = kv_cache_bytes(layers, batch, kv_heads, seq_len, hd, nbytes, scale)
        variants.append({
            "name": name, "num_kv_heads": kv_heads,
            "group_size": config.num_attention_heads // kv_heads,
            "bytes_per_token": kv_cache_bytes(layers, 1, kv_heads, 1, hd, nbytes, scale),
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
    quantized_table = bool(config.quantization) and config.quantization not in (
        "gguf:F32", "gguf:F16", "gguf:BF16")
    weights: dict = {"dtype": weights_dtype, "params": params,
                     "bytes": params["total"] * dtype_bytes(weights_dtype),
                     "quantized_bytes": {fmt: quantized_weight_bytes(
                         config, fmt, weights_dtype, quantized_table)
                         for fmt in ("int8", "int4-g32", "int4-g128")}}
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
        "kv_scale_bytes": scale,
        "kv_bytes": variants[0]["total_bytes"], "variants": variants, "pool": pool,
        "weights": weights,
    }


def load_config(model: Optional[str]) -> tuple[ModelConfig, str, Optional[int]]:
    """(config, resolved path, GGUF tensor bytes or None) for a path or ``default``.

    GGUF headers are read without torch; an HF folder goes through
    ``llmserve.model.loading.loader.load_model_config`` (which imports torch).
    """
    from llmserve.default_model import resolve_model_path

    path = resolve_model_path(model)
    if path.endswith(".gguf"):
        from llmserve.model.loading.gguf import read_gguf
        from llmserve.model.loading.gguf_config import gguf_model_config

        gguf_file = read_gguf(path)
        tensor_bytes = sum(t.nbytes for t in gguf_file.tensors.values())
        return gguf_model_config(gguf_file), path, tensor_bytes
    from llmserve.model.loading.loader import load_model_config

    return load_model_config(path), path, None


def engine_pool_bytes_per_token(config: ModelConfig, block_size: int, kv_dtype: str
                                ) -> Optional[int]:
    """The engine's own pool figure (imports torch); None for dtypes it has no pool for."""
    if kv_dtype not in _ENGINE_DTYPES:
        return None
    import torch

    from llmserve.model.executor.kv_cache import kv_bytes_per_block
    from llmserve.model.platform import resolve_kv_dtype

    torch_dtype = resolve_kv_dtype(kv_dtype, torch.float32)
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
        f"({rep['kv_dtype_bytes']} B" + (f" + a {rep['kv_scale_bytes']} B scale per token and head"
                                         if rep.get("kv_scale_bytes") else "") + ")", "",
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
    if w.get("quantized_bytes"):
        lines.append("  quantized linears (estimate): " + ", ".join(
            f"{fmt} {format_bytes(n)}" for fmt, n in w["quantized_bytes"].items()))
    if "gguf_file_bytes" in w:
        lines.append(f"  GGUF file ({w.get('gguf_quantization')}): "
                     f"{format_bytes(w['gguf_file_bytes'])}"
                     + (f", tensors {format_bytes(w['gguf_tensor_bytes'])}"
                        if "gguf_tensor_bytes" in w else ""))
    return "\n".join(lines)

"""Load a checkpoint (HF folder with safetensors, or a GGUF file) into HF-named tensors.

Whatever the source, the result uses Hugging Face parameter names::

    model.embed_tokens.weight
    model.layers.{i}.input_layernorm.weight / post_attention_layernorm.weight
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight   (+ {q,k,v}_proj.bias when attention_bias)
    model.layers.{i}.self_attn.{q,k}_norm.weight       (qk_norm, Qwen3)
    model.layers.{i}.mlp.{gate,up,down}_proj.weight
    model.norm.weight
    lm_head.weight                                      (absent when tie_word_embeddings)

GGUF tensors are dequantized to float32 and their Q/K rows un-permuted to HF's rotary layout,
so model code never needs to know where the weights came from. A quantized linear method may
instead ask ``CheckpointSource.iter_weights(raw_gguf=True)`` for the block-quantized matrices
as :class:`RawGGUFTensor` (bytes, rows un-permuted) and repack them without dequantizing.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Union

import torch
from safetensors import safe_open

from llmserve.model.config import SUPPORTED_ARCHITECTURES, ModelConfig
from llmserve.model.gguf_loader import (
    RawGGUFTensor, gguf_model_config, iter_gguf_weights, read_gguf,
)

logger = logging.getLogger(__name__)

_LOAD_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}
#: safetensors dtypes we can convert to a floating load dtype.
_SAFETENSORS_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
#: Checkpoint entries that are derived buffers, not parameters.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_HASH_CHUNK = 1 << 20


@dataclass
class LoadedCheckpoint:
    """A checkpoint in memory: its config, HF-named tensors, and where it came from."""

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    weights_fingerprint: str          # sha256 over the checkpoint files (and the quantization)
    generation_config: dict = field(default_factory=dict)
    path: str = ""


def _is_gguf(path: str) -> bool:
    if path.lower().endswith(".gguf"):
        return True
    if os.path.isfile(path):
        with open(path, "rb") as handle:
            return handle.read(4) == b"GGUF"
    return False


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"missing {os.path.basename(path)}: {path!r} does not exist")
    with open(path, encoding="utf-8") as handle:
        try:
            return json.load(handle)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path!r} is not valid JSON: {exc}") from exc


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _rope_settings(cfg: dict) -> tuple[float, dict | None]:
    """``(rope_theta, rope_scaling)`` from transformers 5 ``rope_parameters`` or the 4.x keys."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and params:
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(cfg.get("rope_theta", 10000.0))
        scaling = dict(cfg.get("rope_scaling") or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    scaling.pop("type", None)
    if scaling.get("rope_type", "default") == "default":
        return theta, None
    return theta, scaling


def _check_sliding_window(cfg: dict, arch_name: str, max_len: int) -> None:
    window = cfg.get("sliding_window")
    if arch_name.lower().startswith("qwen") and not cfg.get("use_sliding_window", False):
        return
    if window is None:
        return
    if int(window) < max_len:
        raise ValueError(
            f"{arch_name} uses sliding-window attention (sliding_window={window} < "
            f"max_position_embeddings={max_len}), which this engine does not implement"
        )
    logger.warning("sliding_window=%s covers the whole context; using full attention", window)


def _hf_architecture(cfg: dict, config_path: str) -> tuple[str, str]:
    archs = cfg.get("architectures") or []
    if archs:
        name = archs[0]
        if name not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"{config_path!r}: architecture {name!r} is not supported; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        return name, SUPPORTED_ARCHITECTURES[name]
    model_type = cfg.get("model_type")
    if model_type in _MODEL_TYPES:
        return str(model_type), _MODEL_TYPES[model_type]
    raise ValueError(
        f"{config_path!r} names no architecture (architectures / model_type = {model_type!r}); "
        f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
    )


def hf_model_config(folder: str) -> ModelConfig:
    """Read an HF folder's config.json (and generation_config.json for extra EOS ids)."""
    config_path = os.path.join(folder, "config.json")
    cfg = _read_json(config_path)
    arch_name, arch = _hf_architecture(cfg, config_path)
    if cfg.get("quantization_config"):
        method = cfg["quantization_config"].get("quant_method", "unknown")
        raise ValueError(
            f"{config_path!r}: pre-quantized HF checkpoints ({method}) are not supported; "
            "load the float checkpoint and quantize at load with --quantization int8|int4 "
            "(int8 per channel, int4 groups of 32/64/128/256), or use a GGUF file (Q4_0, "
            "Q4_1, Q4_K kept as int4; Q5_*, Q6_K, Q8_0 as int8; F16/BF16/F32 dense)")
    if cfg.get("mlp_bias"):
        raise ValueError(f"{config_path!r}: mlp_bias=true is not supported")
    try:
        hidden, num_heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        max_len = int(cfg["max_position_embeddings"])
        intermediate, layers = int(cfg["intermediate_size"]), int(cfg["num_hidden_layers"])
        vocab_size = int(cfg["vocab_size"])
    except KeyError as exc:
        raise ValueError(f"{config_path!r} lacks required key {exc.args[0]!r}") from None
    _check_sliding_window(cfg, arch_name, max_len)
    theta, scaling = _rope_settings(cfg)
    gen_path = os.path.join(folder, "generation_config.json")
    gen = _read_json(gen_path) if os.path.isfile(gen_path) else {}
    eos = _as_id_list(cfg.get("eos_token_id")) + _as_id_list(gen.get("eos_token_id"))
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=num_heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg.get("head_dim") or hidden // num_heads),
        max_position_embeddings=max_len,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=True if arch == "qwen2" else bool(cfg.get("attention_bias", False)),
        qk_norm=arch == "qwen3",
        hidden_act=str(cfg.get("hidden_act", "silu")),
        torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(eos)),
        source_format="hf",
        quantization=None,
    )


def load_model_config(path: str) -> ModelConfig:
    """The :class:`ModelConfig` of an HF folder or a GGUF file, without reading any tensors."""
    if _is_gguf(path):
        return gguf_model_config(read_gguf(path))
    if os.path.isdir(path):
        return hf_model_config(path)
    raise FileNotFoundError(f"model path {path!r} is neither an HF model folder nor a .gguf file")


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint for ``config`` must provide, with its shape (HF names)."""
    h, d = config.hidden_size, config.head_dim
    q_rows, kv_rows = config.num_attention_heads * d, config.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q_rows, h),
            p + "self_attn.k_proj.weight": (kv_rows, h),
            p + "self_attn.v_proj.weight": (kv_rows, h),
            p + "self_attn.o_proj.weight": (h, q_rows),
            p + "mlp.gate_proj.weight": (config.intermediate_size, h),
            p + "mlp.up_proj.weight": (config.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, config.intermediate_size),
        })
        if config.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q_rows,), p + "self_attn.k_proj.bias": (kv_rows,),
                           p + "self_attn.v_proj.bias": (kv_rows,)})
            if config.architecture == "llama":   # Llama's attention_bias covers o_proj too
                shapes[p + "self_attn.o_proj.bias"] = (h,)
        if config.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
    return shapes


def _resolve_dtype(dtype: Union[torch.dtype, str]) -> torch.dtype:
    if isinstance(dtype, str) and dtype in _LOAD_DTYPES:
        return _LOAD_DTYPES[dtype]
    if isinstance(dtype, torch.dtype) and dtype in _LOAD_DTYPES.values():
        return dtype
    raise ValueError(f"unsupported load dtype {dtype!r}; use one of float32, bfloat16, float16")


def _safetensors_files(folder: str) -> list[str]:
    index_path = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        weight_map = _read_json(index_path).get("weight_map") or {}
        if not weight_map:
            raise ValueError(f"{index_path!r} has an empty weight_map")
        names = sorted(set(weight_map.values()))
    elif os.path.isfile(os.path.join(folder, "model.safetensors")):
        names = ["model.safetensors"]
    else:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
        if not names:
            raise FileNotFoundError(
                f"no *.safetensors weights in {folder!r} (model.safetensors or an index file); "
                "pytorch_model.bin checkpoints are not supported"
            )
    paths = [os.path.join(folder, n) for n in names]
    for p in paths:
        if not os.path.isfile(p):
            raise FileNotFoundError(f"missing weights file {os.path.basename(p)!r}: {p!r} does not exist")
    return paths


def _iter_safetensors(paths: Iterable[str]) -> Iterable[tuple[str, torch.Tensor]]:
    for path in paths:
        with safe_open(path, framework="pt") as handle:
            for name in handle.keys():
                st_dtype = handle.get_slice(name).get_dtype()
                if st_dtype not in _SAFETENSORS_FLOAT_DTYPES:
                    raise ValueError(
                        f"tensor {name!r} in {os.path.basename(path)!r} has unsupported dtype {st_dtype}; "
                        f"supported: {sorted(_SAFETENSORS_FLOAT_DTYPES)}"
                    )
                yield name, handle.get_tensor(name)


def _collect(tensors: Iterable[tuple[str, Any]], config: ModelConfig, dtype: torch.dtype,
             source: str) -> dict[str, torch.Tensor]:
    """Convert, validate names and shapes, and drop derived or tied entries."""
    expected = expected_weight_shapes(config)
    weights: dict[str, torch.Tensor] = {}
    unexpected = []
    for name, value in tensors:
        if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and config.tie_word_embeddings):
            continue
        if name not in expected:
            unexpected.append(name)
            continue
        tensor = value if isinstance(value, torch.Tensor) else torch.from_numpy(value)
        if tuple(tensor.shape) != expected[name]:
            raise ValueError(
                f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {expected[name]} from the config"
            )
        weights[name] = tensor.to(dtype).contiguous()
    if unexpected:
        raise ValueError(f"{source}: unexpected tensors {unexpected[:5]} (total {len(unexpected)}) for {config.architecture}")
    missing = [n for n in expected if n not in weights]
    if missing:
        raise ValueError(f"{source}: missing tensors {missing[:5]} (total {len(missing)})")
    return weights


def fingerprint_files(paths: Iterable[str], extra: str = "") -> str:
    """sha256 over ``extra``, then each file's base name and bytes (streamed), in the given order."""
    digest = hashlib.sha256(extra.encode("utf-8"))
    for path in paths:
        digest.update(b"\0file\0" + os.path.basename(path).encode("utf-8") + b"\0")
        with open(path, "rb") as handle:
            while chunk := handle.read(_HASH_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


@dataclass
class CheckpointSource:
    """An opened checkpoint whose tensors are read one at a time (no full copy in memory)."""

    config: ModelConfig
    weights_fingerprint: str
    generation_config: dict
    path: str
    _tensors: Callable[[bool], Iterable[tuple[str, Any]]]   # raw_gguf -> (name, value)

    def iter_weights(self, raw_gguf: bool = False
                     ) -> Iterator[tuple[str, "torch.Tensor | RawGGUFTensor"]]:
        """Yield ``(hf_name, tensor)`` in the checkpoint's dtype (GGUF: dequantized float32),
        checking names and shapes; raises ValueError for a missing or unexpected tensor.

        ``raw_gguf``: a GGUF file's block-quantized matrices come as :class:`RawGGUFTensor`
        (their bytes, rows in HF order) for a quantized linear method; no effect on HF folders.
        """
        expected = expected_weight_shapes(self.config)
        seen: set[str] = set()
        unexpected = []
        for name, value in self._tensors(raw_gguf):
            if name.endswith(_IGNORED_SUFFIXES) or (
                    name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue
            if name not in expected:
                unexpected.append(name)
                continue
            tensor = value if isinstance(value, (torch.Tensor, RawGGUFTensor)) else \
                torch.from_numpy(value)
            if tuple(tensor.shape) != expected[name]:
                raise ValueError(f"{self.path}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {expected[name]} from the config")
            seen.add(name)
            yield name, tensor
        if unexpected:
            raise ValueError(f"{self.path}: unexpected tensors {unexpected[:5]} (total "
                             f"{len(unexpected)}) for {self.config.architecture}")
        missing = [n for n in expected if n not in seen]
        if missing:
            raise ValueError(f"{self.path}: missing tensors {missing[:5]} (total {len(missing)})")


def open_checkpoint(path: str) -> CheckpointSource:
    """Read an HF folder's or GGUF file's config and fingerprint; tensors stream on demand."""
    if _is_gguf(path):
        gguf_file = read_gguf(path)
        config = gguf_model_config(gguf_file)
        generation = {"bos_token_id": config.bos_token_id, "eos_token_id": list(config.eos_token_ids)}
        files = [gguf_file.path]
        tensors = lambda raw: iter_gguf_weights(gguf_file, config, raw=raw)  # noqa: E731
    elif os.path.isdir(path):
        config = hf_model_config(path)
        st_files = _safetensors_files(path)
        gen_path = os.path.join(path, "generation_config.json")
        generation = _read_json(gen_path) if os.path.isfile(gen_path) else {}
        files = [os.path.join(path, "config.json")] + st_files
        tensors = lambda raw: _iter_safetensors(st_files)  # noqa: E731
    else:
        raise FileNotFoundError(f"model path {path!r} is neither an HF model folder nor a .gguf file")
    fingerprint = fingerprint_files(files, extra=f"quantization={config.quantization}\n")
    return CheckpointSource(config, fingerprint, generation, os.path.abspath(path), tensors)


def load_checkpoint(path: str, dtype: Union[torch.dtype, str] = torch.float32) -> LoadedCheckpoint:
    """Load an HF folder or a GGUF file into HF-named tensors of ``dtype`` on the CPU.

    Raises:
        FileNotFoundError: the path, config.json, or a weights file is missing (named in the message).
        ValueError: unsupported architecture, tensor dtype, load dtype, or a tensor that does not
            match the config.
    """
    load_dtype = _resolve_dtype(dtype)
    if _is_gguf(path):
        gguf_file = read_gguf(path)
        config = gguf_model_config(gguf_file)
        weights = _collect(iter_gguf_weights(gguf_file, config), config, load_dtype, path)
        generation = {"bos_token_id": config.bos_token_id, "eos_token_id": list(config.eos_token_ids)}
        files = [gguf_file.path]
    elif os.path.isdir(path):
        config = hf_model_config(path)
        files = _safetensors_files(path)
        weights = _collect(_iter_safetensors(files), config, load_dtype, path)
        gen_path = os.path.join(path, "generation_config.json")
        generation = _read_json(gen_path) if os.path.isfile(gen_path) else {}
        files = [os.path.join(path, "config.json")] + files
    else:
        raise FileNotFoundError(f"model path {path!r} is neither an HF model folder nor a .gguf file")
    fingerprint = fingerprint_files(files, extra=f"quantization={config.quantization}\n")
    logger.info("loaded %s (%s, %d tensors, %s)", path, config.architecture, len(weights), config.quantization or "unquantized")
    return LoadedCheckpoint(config=config, weights=weights, weights_fingerprint=fingerprint,
                            generation_config=generation, path=os.path.abspath(path))

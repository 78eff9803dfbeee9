"""Load a checkpoint (HF folder with safetensors, or a GGUF file) into HF-named tensors.

Whatever the source, the result uses Hugging Face parameter names (the Llama layout below;
each family's model class lists its own in ``expected_weight_shapes``)::

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
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Union

import torch
from safetensors import safe_open

from llmserve.model.config import ModelConfig
from llmserve.model.loading.gguf import RawGGUFTensor, iter_gguf_weights, read_gguf
from llmserve.model.loading.gguf_config import gguf_model_config
from llmserve.model.loading.hf_config import hf_model_config, int4_scheme_of
from llmserve.model.loading.hf_config import read_json as _read_json
from llmserve.model.loading.int4_checkpoint import (
    PackedInt4Tensor,
    group_packed_tensors,
    is_packed_part,
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


def load_model_config(path: str) -> ModelConfig:
    """The :class:`ModelConfig` of an HF folder or a GGUF file, without reading any tensors."""
    if _is_gguf(path):
        return gguf_model_config(read_gguf(path))
    if os.path.isdir(path):
        return hf_model_config(path)
    raise FileNotFoundError(f"model path {path!r} is neither an HF model folder nor a .gguf file")


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint for ``config`` must provide, with its shape (HF names);
    the family's model class says which (``models.registry``)."""
    from llmserve.model.models.registry import expected_weight_shapes as family_shapes

    return family_shapes(config)


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


def _iter_safetensors(paths: Iterable[str], packed_int4: bool = False
                      ) -> Iterable[tuple[str, torch.Tensor]]:
    """Each tensor of the files, in order; ``packed_int4``: a GPTQ/AWQ folder, whose
    qweight/qzeros/g_idx parts are int32."""
    for path in paths:
        with safe_open(path, framework="pt") as handle:
            for name in handle.keys():
                st_dtype = handle.get_slice(name).get_dtype()
                if st_dtype not in _SAFETENSORS_FLOAT_DTYPES and not (
                        packed_int4 and st_dtype == "I32" and is_packed_part(name)):
                    raise ValueError(
                        f"tensor {name!r} in {os.path.basename(path)!r} has unsupported dtype {st_dtype}; "
                        f"supported: {sorted(_SAFETENSORS_FLOAT_DTYPES)}"
                    )
                yield name, handle.get_tensor(name)


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
                     ) -> Iterator[tuple[str, "torch.Tensor | RawGGUFTensor | PackedInt4Tensor"]]:
        """Yield ``(hf_name, tensor)`` in the checkpoint's dtype (GGUF, GPTQ, AWQ: dequantized
        float32), checking names and shapes; raises ValueError for a missing or unexpected
        tensor.

        ``raw_gguf``: a GGUF file's block-quantized matrices come as :class:`RawGGUFTensor`
        (their bytes, rows in HF order), a GPTQ/AWQ folder's linears as
        :class:`PackedInt4Tensor`, for a quantized linear method; no effect on float folders.
        GPTQ exports write a zero bias for every linear: one the model has no place for is
        skipped when it is all zeros.
        """
        expected = expected_weight_shapes(self.config)
        seen: set[str] = set()
        unexpected = []
        for name, value in self._tensors(raw_gguf):
            if name.endswith(_IGNORED_SUFFIXES) or (
                    name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue
            if name not in expected:
                if not (self.config.quantization and name.endswith(".bias")
                        and isinstance(value, torch.Tensor) and not bool(value.any())):
                    unexpected.append(name)
                continue
            tensor = value if isinstance(value, (torch.Tensor, RawGGUFTensor,
                                                 PackedInt4Tensor)) else \
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
        scheme = int4_scheme_of(_read_json(files[0]), files[0])
        if scheme is None:
            tensors = lambda raw: _iter_safetensors(st_files)  # noqa: E731
        else:
            tensors = lambda raw: group_packed_tensors(  # noqa: E731
                _iter_safetensors(st_files, packed_int4=True), scheme, raw)
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
    source = open_checkpoint(path)
    weights = {name: tensor.to(load_dtype).contiguous() for name, tensor in source.iter_weights()}
    config = source.config
    logger.info("loaded %s (%s, %d tensors, %s)", path, config.architecture, len(weights), config.quantization or "unquantized")
    return LoadedCheckpoint(config=config, weights=weights, weights_fingerprint=source.weights_fingerprint,
                            generation_config=source.generation_config, path=source.path)

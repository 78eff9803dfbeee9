"""GGUF files: metadata and dequantized weights under Hugging Face names (the model config
is built in gguf_config.py, family-specific names and keys live in gguf_families.py).

This module imports numpy and the ``gguf`` package but not torch, so the tokenizer can read
GGUF metadata without pulling torch in. :mod:`llmserve.model.loading.loader` turns the arrays into tensors.

The header is parsed here rather than with ``gguf.GGUFReader``: that reader builds one object
per vocabulary string, which is slow for large vocabularies (docs/BENCHMARKS.md).
Dequantization uses ``gguf.quants.dequantize``, which is vectorised over whole tensors.
"""
from __future__ import annotations

import logging
import mmap
import os
import struct
import threading
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize

from llmserve.model.config import ModelConfig
from llmserve.model.loading.gguf_families import hf_names, model_architecture, norm_offset

logger = logging.getLogger(__name__)

_GGUF_MAGIC = b"GGUF"
_U64 = struct.Struct("<Q")
_DEFAULT_ALIGNMENT = 32

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}

@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor's bytes are. ``shape`` is in numpy (row-major) order."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    offset: int       # absolute byte offset in the file
    nbytes: int


@dataclass(frozen=True)
class GGUFFile:
    """A parsed GGUF header: all metadata key/values and the tensor index (no tensor data)."""

    path: str
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))


class _HeaderParser:
    """Sequential little-endian reader over the mapped file."""

    def __init__(self, buf: mmap.mmap, path: str) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def _unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ValueError(f"{self.path}: truncated GGUF header at byte {self.pos}")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        return self.strings(1)[0]

    def strings(self, count: int) -> list[str]:
        """``count`` length-prefixed strings (one key, a vocabulary, a merge list) in one
        tight loop."""
        buf, pos, size = self.buf, self.pos, len(self.buf)
        length_at = _U64.unpack_from
        out = []
        for _ in range(count):
            if pos + 8 > size:
                raise ValueError(f"{self.path}: truncated GGUF string at byte {pos}")
            (length,) = length_at(buf, pos)
            end = pos + 8 + length
            if end > size:
                raise ValueError(f"{self.path}: truncated GGUF string at byte {pos}")
            out.append(buf[pos + 8:end].decode("utf-8", errors="replace"))
            pos = end
        self.pos = pos
        return out

    def value(self, vtype: int) -> Any:
        vtype = GGUFValueType(vtype)
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            item_type = GGUFValueType(self._unpack("<I"))
            count = self._unpack("<Q")
            if item_type == GGUFValueType.STRING:
                return self.strings(count)
            if item_type in _SCALAR_FORMATS:
                dtype = np.dtype(_SCALAR_FORMATS[item_type])
                end = self.pos + count * dtype.itemsize
                if end > len(self.buf):
                    raise ValueError(f"{self.path}: truncated GGUF array at byte {self.pos}")
                items = np.frombuffer(self.buf[self.pos:end], dtype=dtype).tolist()
                self.pos = end
                return items
            return [self.value(item_type) for _ in range(count)]
        return self._unpack(_SCALAR_FORMATS[vtype])


_parsed: dict[tuple[str, int, int, int], GGUFFile] = {}
_parsed_lock = threading.Lock()
_PARSED_KEPT = 4


def read_gguf(path: str) -> GGUFFile:
    """Parse a GGUF file's metadata and tensor index; tensor data is not read.

    A start reads one file's header three times (model config, weights, tokenizer): the
    last few parsed headers are kept, keyed by the file's identity (inode, size and
    modification time), so an unchanged file is parsed once. Treat the result as read-only.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a (little-endian, version 2/3) GGUF file, or a corrupt header.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file {path!r} does not exist")
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_ino, st.st_size, st.st_mtime_ns)
    with _parsed_lock:
        if key in _parsed:
            return _parsed[key]
    parsed = _parse_gguf(path)
    with _parsed_lock:
        while len(_parsed) >= _PARSED_KEPT:
            _parsed.pop(next(iter(_parsed)))
        _parsed[key] = parsed
    return parsed


def _parse_gguf(path: str) -> GGUFFile:
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != _GGUF_MAGIC:
            raise ValueError(f"{path!r} is not a GGUF file (magic {buf[:4]!r})")
        parser = _HeaderParser(buf, path)
        parser.pos = 4
        version = parser._unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"{path!r}: unsupported GGUF version {version} (big-endian files are not supported)")
        tensor_count, kv_count = parser._unpack("<Q"), parser._unpack("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = parser.string()
            metadata[key] = parser.value(parser._unpack("<I"))
        raw_infos = []
        for _ in range(tensor_count):
            name = parser.string()
            n_dims = parser._unpack("<I")
            dims = [parser._unpack("<Q") for _ in range(n_dims)]
            qtype = GGMLQuantizationType(parser._unpack("<I"))
            raw_infos.append((name, dims, qtype, parser._unpack("<Q")))
        alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_start = (parser.pos + alignment - 1) // alignment * alignment
        file_size = len(buf)
    tensors = {}
    for name, dims, qtype, rel_offset in raw_infos:
        shape = tuple(int(d) for d in reversed(dims))
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        n_elems = int(np.prod(shape)) if shape else 1
        if shape and shape[-1] % block_size:
            raise ValueError(f"{path!r}: tensor {name} row of {shape[-1]} is not a multiple of {block_size}")
        nbytes = n_elems // block_size * type_size
        offset = data_start + rel_offset
        if offset + nbytes > file_size:
            raise ValueError(f"{path!r}: tensor {name} runs past the end of the file (truncated download?)")
        tensors[name] = GGUFTensorInfo(name, shape, qtype, offset, nbytes)
    return GGUFFile(path=os.path.abspath(path), version=version, metadata=metadata, tensors=tensors)


def _architecture(gguf_file: GGUFFile) -> str:
    """The file's ``general.architecture`` (checked supported)."""
    try:
        model_architecture(gguf_file.architecture, gguf_file.metadata)
    except ValueError as exc:
        raise ValueError(f"{gguf_file.path!r}: {exc}") from None
    return gguf_file.architecture


def unpermute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary permutation of Q/K rows (its converter's ``permute``).

    llama.cpp interleaves each head's two rotary halves; HF keeps them as two halves. The
    converter did ``reshape(n_head, 2, rows // n_head // 2, ...).swapaxes(1, 2)``; this inverts it.
    """
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"cannot un-permute {rows} rows into {num_heads} heads with two rotary halves")
    rest = weight.shape[1:]
    return np.ascontiguousarray(
        weight.reshape(num_heads, rows // num_heads // 2, 2, *rest).swapaxes(1, 2).reshape(weight.shape)
    )


def dequantize_tensor(data: np.ndarray, info: GGUFTensorInfo) -> np.ndarray:
    """Dequantize one tensor's raw bytes (a uint8 view of the file) to float32 in numpy shape."""
    raw = data[info.offset:info.offset + info.nbytes]
    if info.qtype == GGMLQuantizationType.F32:
        return raw.view(np.float32).reshape(info.shape).copy()
    block_size, type_size = GGML_QUANT_SIZES[info.qtype]
    rows = raw.reshape(*info.shape[:-1], info.shape[-1] // block_size * type_size)
    try:
        values = dequantize(rows, info.qtype)
    except NotImplementedError as exc:
        raise ValueError(f"GGUF tensor {info.name}: quantization {info.qtype.name} is not supported") from exc
    return np.asarray(values, dtype=np.float32).reshape(info.shape)


#: Types yielded dense even in raw mode: already floating point.
_FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


@dataclass(frozen=True)
class RawGGUFTensor:
    """A block-quantized 2-D GGUF tensor kept as its bytes, rows already in HF order.

    ``data`` is uint8 ``(rows, bytes_per_row)``: each row is a run of ``qtype`` blocks along
    the input dimension, so reordering whole rows (the Q/K rotary un-permutation) reorders
    the quantized weights exactly. ``shape`` is the logical ``(rows, cols)``.
    """

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, int]
    data: np.ndarray

    def dequantize(self, row_start: int = 0, row_end: "int | None" = None) -> np.ndarray:
        """Float32 values of rows ``[row_start, row_end)``, as ``gguf.quants.dequantize`` gives."""
        rows = self.data[row_start:row_end]
        try:
            values = dequantize(rows, self.qtype)
        except NotImplementedError as exc:
            raise ValueError(f"GGUF tensor {self.name}: quantization {self.qtype.name} is not "
                             "supported") from exc
        return np.asarray(values, dtype=np.float32).reshape(rows.shape[0], self.shape[1])


def _rotary_heads(arch: str, name: str, config: ModelConfig) -> "int | None":
    if arch != "llama":
        return None
    if ".self_attn.q_proj." in name:
        return config.num_attention_heads
    if ".self_attn.k_proj." in name:
        return config.num_key_value_heads
    return None


def _split_experts(info: GGUFTensorInfo, names: list[str]) -> list[GGUFTensorInfo]:
    """A 3-D expert tensor ``(E, rows, cols)`` as E contiguous 2-D tensors, one per expert."""
    if len(info.shape) != 3 or info.shape[0] != len(names):
        raise ValueError(f"GGUF tensor {info.name} has shape {info.shape}; expected "
                         f"({len(names)}, rows, cols) experts")
    each = info.nbytes // len(names)
    return [GGUFTensorInfo(name, info.shape[1:], info.qtype, info.offset + e * each, each)
            for e, name in enumerate(names)]


def _hf_tensors(gguf_file: GGUFFile, config: ModelConfig
                ) -> Iterator[tuple[str, GGUFTensorInfo]]:
    """``(hf_name, info)`` per HF tensor; expert tensors split, 1-D gates made ``(1, H)``."""
    for info in gguf_file.tensors.values():
        names = hf_names(config.architecture, info.name, config.num_experts)
        if not names:
            continue
        if "_exps." in info.name:
            yield from ((part.name, part) for part in _split_experts(info, names))
        elif names[0].endswith("shared_expert_gate.weight") and len(info.shape) == 1:
            yield names[0], GGUFTensorInfo(info.name, (1, info.shape[0]), info.qtype,
                                           info.offset, info.nbytes)
        else:
            yield names[0], info


def iter_gguf_weights(gguf_file: GGUFFile, config: ModelConfig,
                      raw: bool = False) -> Iterator[tuple[str, "np.ndarray | RawGGUFTensor"]]:
    """Yield ``(hf_name, float32 array)`` for every tensor, dequantized and in HF layout.

    Q and K projections of Llama-architecture files are un-permuted back to HF's rotary layout
    (Q with ``num_attention_heads``, K with ``num_key_value_heads``); Qwen files are not permuted.
    A 3-D expert tensor comes as one 2-D tensor per expert (gguf_families). With ``raw``,
    block-quantized matrices come as :class:`RawGGUFTensor` (bytes, rows un-permuted) for a
    quantized linear method to repack; float tensors stay dense.
    """
    arch = _architecture(gguf_file)
    data = np.memmap(gguf_file.path, dtype=np.uint8, mode="r")
    try:
        for name, info in _hf_tensors(gguf_file, config):
            heads = _rotary_heads(arch, name, config)
            if raw and len(info.shape) == 2 and info.qtype not in _FLOAT_TYPES:
                rows = np.array(data[info.offset:info.offset + info.nbytes]).reshape(
                    info.shape[0], -1)
                if heads is not None:
                    rows = unpermute_rotary(rows, heads)
                yield name, RawGGUFTensor(name, info.qtype, (info.shape[0], info.shape[1]), rows)
                continue
            values = dequantize_tensor(data, info)
            if heads is not None:
                values = unpermute_rotary(values, heads)
            offset = norm_offset(config.architecture, name)
            yield name, (values - offset if offset else values)
    finally:
        del data

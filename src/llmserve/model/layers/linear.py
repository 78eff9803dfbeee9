"""Linear layers whose weights are created, loaded and applied by a pluggable LinearMethod.

A model file builds ``Linear(input_size, output_sizes, method=...)`` and never branches on the
weight format: dense, quantized (GGUF-packed, int8, int4) and tensor-parallel shards are
sibling ``LinearMethod`` classes with three duties::

    create_weights(layer, ...)      make the layer's parameters (any dtype, packing or shard)
    load_weight(layer, param, tensor, shard)  copy one checkpoint tensor into its slot
    apply(layer, x)                 y = x @ W^T (+ bias)
    process_weights_after_loading(layer)   optional repacking once everything is loaded

A fused layer has several ``output_sizes`` (q/k/v, gate/up); the checkpoint's separate tensors
land in their row ranges through ``shard`` (an index into ``output_sizes``)::

    qkv weight rows:  [ q: 0 .. Hq*D | k: .. + Hkv*D | v: .. + Hkv*D ]
"""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Optional, Sequence

import torch
from torch import nn

from llmserve.model.layers import cpu_kernels
from llmserve.model.layers.gemm_row_granule import dtype_kind, row_granule
from llmserve.model.layers.native_dense import can_pack_native, native_mm, pack_native

logger = logging.getLogger(__name__)


class LinearMethod(ABC):
    """How one family of weight formats is stored and multiplied."""

    #: True: the loader hands this method a GGUF file's quantized matrices as raw blocks
    #: (``RawGGUFTensor``) instead of dequantized float32.
    wants_raw_gguf = False
    #: True: a GGUF token table of a K-quant or 5-bit type stays in its own blocks
    #: (``QBlockTable``, the block kernel's head) rather than becoming int8 rows.
    gguf_block_tables = False

    @abstractmethod
    def create_weights(self, layer: "Linear", dtype: torch.dtype, device: torch.device) -> None:
        """Register the layer's parameters for ``layer.input_size`` x ``sum(layer.output_sizes)``."""

    @abstractmethod
    def load_weight(self, layer: "Linear", name: str, tensor: torch.Tensor,
                    shard: Optional[int]) -> None:
        """Copy one checkpoint tensor (``name`` is ``weight`` or ``bias``) into the layer."""

    @abstractmethod
    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        """``x (..., input_size) -> (..., sum(output_sizes))``."""

    def process_weights_after_loading(self, layer: "Linear") -> None:  # noqa: B027 - optional hook
        """Repack once every shard is loaded (default: nothing)."""

    def weight_bytes(self, layer: "Linear") -> int:
        """Bytes of this layer's weights as resident in memory."""
        return sum(p.numel() * p.element_size() for p in layer.parameters(recurse=False))


def _shard_rows(layer: "Linear", shard: Optional[int]) -> tuple[int, int]:
    if shard is None:
        return 0, layer.output_size
    if not 0 <= shard < len(layer.output_sizes):
        raise ValueError(f"shard {shard} out of range for output sizes {layer.output_sizes}")
    start = sum(layer.output_sizes[:shard])
    return start, layer.output_sizes[shard]


class DenseLinearMethod(LinearMethod):
    """Unquantized weights in the model dtype.

    On CPU the weight is repacked after loading for llmserve's native products
    (``native_dense``) where they are available: bf16 for the bf16 kernel, float32 for the
    tier library's ``f32_mm`` (one summation order at every row count, which PyTorch's
    float32 GEMM does not keep); else a bf16 or float32 weight goes into oneDNN's blocked
    layout (``cpu_kernels``). Each multiplies at a higher share of the memory bandwidth than
    ``F.linear`` on the plain layout, and the plain copy is then dropped. oneDNN's products,
    and ``F.linear`` where a CPU weight is left to it, pad their rows to their GEMM's row
    granule (``gemm_row_granule``), so a row sums the same way at every row count.
    """

    def __init__(self, prepack: bool = True) -> None:
        self.prepack = prepack

    def create_weights(self, layer: "Linear", dtype: torch.dtype, device: torch.device) -> None:
        layer.weight = nn.Parameter(
            torch.empty(layer.output_size, layer.input_size, dtype=dtype, device=device),
            requires_grad=False)
        layer.bias = None
        if layer.has_bias:
            layer.bias = nn.Parameter(torch.zeros(layer.output_size, dtype=dtype, device=device),
                                      requires_grad=False)
        layer.packed_id = None
        layer.native_weight = None
        layer.row_granule = 0   # 0: not on PyTorch's GEMM (packed, native or off the CPU)

    def load_weight(self, layer: "Linear", name: str, tensor: torch.Tensor,
                    shard: Optional[int]) -> None:
        param = getattr(layer, name, None)
        if param is None:
            raise ValueError(f"layer has no {name!r} parameter")
        start, rows = _shard_rows(layer, shard)
        target = param.data.narrow(0, start, rows)
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} does not fit "
                             f"{tuple(target.shape)} (shard {shard})")
        target.copy_(tensor)

    def process_weights_after_loading(self, layer: "Linear") -> None:
        w = layer.weight
        if w is None:   # already packed
            return
        if self.prepack and can_pack_native(w.data):
            layer.native_weight = pack_native(w.data)
            layer.weight = None  # the native layout replaces it
        elif self.prepack and cpu_kernels.can_prepack(w):
            layer.packed_id = cpu_kernels.prepack_linear(w.data)
            layer.weight = None  # the packed copy replaces it (no duplicate weights in memory)
        elif w.device.type == "cpu":   # PyTorch's GEMM: rows padded to its granule
            layer.row_granule = row_granule(dtype_kind(w.dtype))

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        if layer.native_weight is not None:
            y = native_mm(x, layer.native_weight, layer.output_size).to(x.dtype)
        elif layer.packed_id is not None:
            y = cpu_kernels.packed_linear(x, layer.packed_id, layer.output_size)
        else:
            return cpu_kernels.linear_rows(x, layer.weight, layer.bias, layer.row_granule)
        return y if layer.bias is None else y + layer.bias

    def weight_bytes(self, layer: "Linear") -> int:
        if layer.native_weight is not None:
            packed = layer.native_weight.numel() * layer.native_weight.element_size()
        elif layer.packed_id is not None:
            packed = cpu_kernels.packed_bytes(layer.packed_id)
        else:
            return super().weight_bytes(layer)
        return packed + (0 if layer.bias is None else layer.bias.numel() * layer.bias.element_size())


#: ``Linear.role`` of the projection whose outputs become attention queries, keys and values
ATTENTION_INPUT = "qkv"


class Linear(nn.Module):
    """``y = x W^T + b`` with ``W`` of ``sum(output_sizes)`` rows, held by a LinearMethod.

    ``role`` names what the layer is in its block (:data:`ATTENTION_INPUT` for the fused
    q/k/v projection, empty otherwise), for methods that treat one kind of layer differently.
    """

    def __init__(self, input_size: int, output_sizes: "int | Sequence[int]", *, bias: bool,
                 method: LinearMethod, dtype: torch.dtype, device: torch.device,
                 role: str = "") -> None:
        super().__init__()
        self.role = role
        sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        if input_size < 1 or not sizes or min(sizes) < 1:
            raise ValueError(f"bad linear shape: input {input_size}, outputs {sizes}")
        self.input_size = input_size
        self.output_sizes = sizes
        self.output_size = sum(sizes)
        self.has_bias = bias
        self.method = method
        method.create_weights(self, dtype, device)

    def load(self, name: str, tensor: torch.Tensor, shard: Optional[int] = None) -> None:
        """Load checkpoint tensor ``name`` (``weight``/``bias``) into shard ``shard``."""
        self.method.load_weight(self, name, tensor, shard)

    def finish_loading(self) -> None:
        self.method.process_weights_after_loading(self)

    @property
    def weight_bytes(self) -> int:
        return self.method.weight_bytes(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def __del__(self) -> None:
        pid = self.__dict__.get("packed_id")
        if pid is not None:
            cpu_kernels.release(pid)

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_sizes}, bias={self.has_bias}, "
                f"method={type(self.method).__name__}")

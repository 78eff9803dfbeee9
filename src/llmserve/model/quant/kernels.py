"""Weight-only quantized matrix products on PyTorch's own CPU kernels, and their packers.

Two formats, both multiplied with bf16 activations (the kernels' fast path; a float32 model
converts ``x`` to bf16 around the op and the result back)::

    int4, group g (32/64/128/256)   w[n, k] = (q[n, k] - 8) * scale[n, k // g] + zero[n, k // g]
        q in 0..15, packed by ``aten._convert_weight_to_int4pack_for_cpu`` into its blocked
        layout (0.5 byte per weight); ``scales_zeros`` is (K // g, N, 2) bf16.
        Product: ``aten._weight_int4pack_mm_for_cpu(x, packed, g, scales_zeros)``.
    int8, per output channel        w[n, k] = q[n, k] * scale[n]
        q in -127..127 (int8, row-major), scale (N,) bf16.
        Product: ``aten._weight_int8pack_mm(x, q, scale)`` (:class:`Int8Weight`).

Each product runs one kernel at every row count: PyTorch's kernels sum a row the same way
whatever the rows beside it, so a row's result does not depend on its batch, its prefill
chunk or the step's path (tests/model/test_batch_invariance.py).

The int4 kernel works on 64-column tiles of at most 4 rows of ``x`` and dequantizes each
weight tile once per 4 rows, so it is bandwidth-bound (fast) for small batches and
compute-bound for large ones (docs/QUANTIZATION.md has the figures). It needs N to be a
multiple of 16: other widths are padded with zero rows and the output is cut back.

``quantize_int4`` / ``quantize_int8`` are round-to-nearest quantizers of float weights; the
scales are rounded to bf16 first and the codes computed against the rounded scales, so the
kernel reconstructs exactly the values the codes were chosen for.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from llmserve.model.quant.native_int4 import (
    int4_a8_mm,
    native_int4_a8_available,
    native_int4_available,
    pack_int4,
    pack_int4_a8,
)
from llmserve.model.quant.native_int4 import int4_mm as native_int4_mm
from llmserve.model.quant.native_int8 import (
    A8_BLOCK,
    int8_a8_mm,
    native_int8_a8_available,
    native_int8_available,
    pack_int8,
    pack_int8_a8,
    packed_rows,
)
from llmserve.model.quant.native_int8 import int8_mm as native_int8_mm

logger = logging.getLogger(__name__)

#: Activation and scale dtype of both kernels.
KERNEL_DTYPE = torch.bfloat16
INT4_GROUP_SIZES = (32, 64, 128, 256)
_N_ALIGN = 16
#: K of PyTorch's ``_weight_int8pack_mm`` (other widths crashed it: Int8Weight pads)
_K_ALIGN_ATEN = 16


@dataclass
class Int4Groups:
    """Affine 4-bit codes by groups of ``group_size`` along K: ``w = (q - 8) * scale + zero``.

    ``q`` is uint8 (rows, K) holding 0..15; ``scale`` and ``zero`` are float32 (rows, K // g).
    ``perm`` (int64 (K,), optional): column ``j`` of ``q`` belongs to input ``perm[j]`` (a
    GPTQ act-order checkpoint, its columns sorted by group); the product gathers ``x[:, perm]``.
    """

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    group_size: int
    perm: Optional[torch.Tensor] = None

    def dequantize(self) -> torch.Tensor:
        """Float32 weights (rows, K) as the codes and float32 scales define them, in input
        order."""
        rows, k = self.q.shape
        g = self.group_size
        q = self.q.view(rows, k // g, g).float() - 8.0
        w = (q * self.scale.unsqueeze(-1) + self.zero.unsqueeze(-1)).view(rows, k)
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out

    @staticmethod
    def fusable(parts: "list[Int4Groups]") -> bool:
        """The shards can share one product: one group size and one input order."""
        first = parts[0]
        return all(p.group_size == first.group_size and (
            p.perm is None and first.perm is None
            or p.perm is not None and first.perm is not None and torch.equal(p.perm, first.perm))
            for p in parts)

    @staticmethod
    def cat(parts: "list[Int4Groups]") -> "Int4Groups":
        """Stack shards along the output rows (all must share the group size and the input
        order: :meth:`fusable`)."""
        if not Int4Groups.fusable(parts):
            raise ValueError("cannot fuse int4 shards with group sizes "
                             f"{sorted({p.group_size for p in parts})} or different input orders")
        return Int4Groups(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                          torch.cat([p.zero for p in parts]), parts[0].group_size, parts[0].perm)


def quantize_int4(w: torch.Tensor, group_size: int) -> Int4Groups:
    """Asymmetric round-to-nearest int4 of float weights (rows, K) by groups along K.

    Per group: scale = (max - min) / 15, zero = min + 8 * scale (bf16-rounded), then
    q = clamp(round((w - zero) / scale) + 8, 0, 15). Error <= scale / 2 + the bf16 rounding of
    the group's scale and zero.
    """
    rows, k = w.shape
    if group_size not in INT4_GROUP_SIZES or k % group_size:
        raise ValueError(f"int4 needs K ({k}) divisible by a group size in {INT4_GROUP_SIZES}, "
                         f"got {group_size}")
    groups = w.float().reshape(rows, k // group_size, group_size)
    lo, hi = groups.amin(-1), groups.amax(-1)
    scale = ((hi - lo) / 15.0).clamp_min(1e-12).to(KERNEL_DTYPE).float()
    zero = (lo + 8.0 * scale).to(KERNEL_DTYPE).float()
    q = torch.round((groups - zero.unsqueeze(-1)) / scale.unsqueeze(-1)) + 8.0
    q = q.clamp_(0, 15).to(torch.uint8).reshape(rows, k)
    return Int4Groups(q, scale, zero, group_size)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric round-to-nearest int8 per row: ``(q int8 (rows, K), scale bf16 (rows,))``.

    scale = max|w_row| / 127 (bf16-rounded); error <= scale / 2 per weight.
    """
    w = w.float()
    scale = (w.abs().amax(-1) / 127.0).clamp_min(1e-12).to(KERNEL_DTYPE)
    q = torch.round(w / scale.float().unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q, scale


def as_kernel_input(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the kernels take it: 2-D, contiguous, bf16."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.dtype != KERNEL_DTYPE:
        x2 = x2.to(KERNEL_DTYPE)
    return x2.contiguous()


class Int4Weight(nn.Module):
    """A packed int4 weight (N, K) and its product ``x (..., K) -> (..., N)``.

    ``native`` picks the kernel: llmserve's (:mod:`~llmserve.model.quant.native_int4`) or
    PyTorch's ``_weight_int4pack_mm_for_cpu``; by default the native one where it is available.
    ``int8_activations``: quantize ``x`` by rows in blocks of 32 and multiply in int8
    (``int4_a8_mm``, AVX512-VNNI; :attr:`int8_activations` says whether it took effect);
    otherwise the codes meet bf16 activations.
    """

    def __init__(self, groups: Int4Groups, native: "bool | None" = None,
                 int8_activations: bool = False) -> None:
        super().__init__()
        n, k = groups.q.shape
        self.out_features, self.in_features = n, k
        self.group_size = groups.group_size
        q, scale, zero = groups.q, groups.scale, groups.zero
        #: act-order input order (GPTQ desc_act): x's columns are gathered by it first
        self.register_buffer("perm", groups.perm, persistent=False)
        pad = -n % _N_ALIGN
        if pad:   # zero rows: q = 8, scale = 0, zero = 0 -> w = 0
            q = torch.cat([q, q.new_full((pad, k), 8)])
            scale = torch.cat([scale, scale.new_zeros(pad, scale.shape[1])])
            zero = torch.cat([zero, zero.new_zeros(pad, zero.shape[1])])
        self.padded = bool(pad)
        self.int8_activations = False
        if int8_activations:
            if not native_int4_a8_available():
                raise ValueError("int8 activations need llmserve's int4 x int8 kernel "
                                 "(AVX512-VNNI); it is not available on this machine")
            packed_a8 = pack_int4_a8(q, scale, zero, self.group_size)
            if packed_a8 is not None:
                self.register_buffer("qweight", packed_a8[0], persistent=False)
                self.register_buffer("scales_zeros", packed_a8[1], persistent=False)
                self.native, self.int8_activations = True, True
                return
            logger.warning("int4 weight %dx%d: scales outside fp16's range; this layer keeps "
                           "bf16 activations", n, k)
        self.native = native_int4_available() if native is None else native
        if self.native and not native_int4_available():
            raise ValueError("the native int4 kernel is not available on this machine")
        if self.native:   # llmserve's kernel and layout (native_int4.py)
            packed, sz = pack_int4(q, scale, zero, self.group_size)
            self.register_buffer("qweight", packed, persistent=False)
            self.register_buffer("scales_zeros", sz, persistent=False)
            return
        self.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            q.to(torch.int32).contiguous(), 1), persistent=False)
        self.register_buffer("scales_zeros", torch.stack([scale.t(), zero.t()], -1).to(
            KERNEL_DTYPE).contiguous(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = as_kernel_input(x)
        if self.perm is not None:
            x2 = x2.index_select(1, self.perm)
        if self.int8_activations:
            y = int4_a8_mm(x2, self.qweight, self.scales_zeros, self.group_size)
        elif self.native:
            y = native_int4_mm(x2, self.qweight, self.scales_zeros, self.group_size)
        else:   # PyTorch's kernel at every row count: it sums each row alike at any M
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.qweight, self.group_size,
                                                           self.scales_zeros)
        if self.padded:
            y = y[:, :self.out_features]
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    @property
    def format_name(self) -> str:
        """``int4-g32`` / ``int4-g32-a8`` (int8 activations: another arithmetic, another
        fingerprint), as ``describe_quantization`` counts it."""
        return f"int4-g{self.group_size}" + ("-a8" if self.int8_activations else "")

    def extra_repr(self) -> str:
        a8 = ", int8 activations" if self.int8_activations else ""
        order = ", act-order" if self.perm is not None else ""
        return f"int4 g{self.group_size}{a8}{order}, {self.out_features}x{self.in_features}"


class Int8Weight(nn.Module):
    """An int8 per-channel weight (N, K) and its product ``x (..., K) -> (..., N)``.

    With llmserve's native kernel (:mod:`~llmserve.model.quant.native_int8`, the default
    where it is available) every row count uses it; otherwise PyTorch's
    ``_weight_int8pack_mm`` does, in eager and compiled steps alike. Each sums a row the same
    way at any row count, so neither a row's batch nor the step's path changes its product
    (a dequantized bf16 GEMM for many rows and a fused reduction for one compiled row were
    faster, about 2x on prefill chunks, but each summed in an order of its own).

    ``int8_activations`` packs for ``int8_a8_mm`` (rows quantized in blocks of 32, faster
    than the bf16 kernel: docs/BENCHMARKS.md) where it runs: K % 32 == 0 and the CPU tier's
    int8 x int8 kernel (AVX512-VNNI, or the avx2 library; ``self.int8_activations``).
    """

    def __init__(self, q: torch.Tensor, scale: torch.Tensor,
                 native: "bool | None" = None, int8_activations: bool = False) -> None:
        super().__init__()
        if q.dtype != torch.int8 or q.dim() != 2 or scale.shape != (q.shape[0],):
            raise ValueError(f"int8 weight needs q int8 (N, K) and scale (N,), got "
                             f"{q.dtype} {tuple(q.shape)} and {tuple(scale.shape)}")
        self.out_features, self.in_features = q.shape
        cpu = q.device.type == "cpu"
        # int8 activations run wherever the tier has the int8 x int8 kernel (AVX512-VNNI or
        # the avx2 library), also where the bf16-activation kernel does not (the avx2 tier)
        self.int8_activations = (int8_activations and cpu and native is not False
                                 and self.in_features % A8_BLOCK == 0
                                 and native_int8_a8_available())
        self.native = self.int8_activations or (
            (native_int8_available() if native is None else native)
            and cpu and self.in_features % 2 == 0)
        if native and not self.native:
            raise ValueError("the native int8 kernel is not available for this weight/machine")
        scale = scale.to(KERNEL_DTYPE)
        #: zero columns PyTorch's kernel needs (it reads K in steps of 16 and crashed on
        #: other widths); ``x`` gets as many zeros in each call
        self.k_pad = 0
        if self.native:   # packing pads N to 16 with zero rows: give them a zero scale
            q = pack_int8_a8(q) if self.int8_activations else pack_int8(q)
            scale = torch.cat([scale, scale.new_zeros(q.shape[0] * 16 - self.out_features)])
        elif self.in_features % _K_ALIGN_ATEN:
            self.k_pad = -self.in_features % _K_ALIGN_ATEN
            q = torch.cat([q, q.new_zeros(self.out_features, self.k_pad)], 1)
        self.register_buffer("qweight", q.contiguous(), persistent=False)
        self.register_buffer("scale", scale.contiguous(), persistent=False)

    def _native_product(self, x2: torch.Tensor, float_out: bool) -> torch.Tensor:
        product = int8_a8_mm if self.int8_activations else native_int8_mm
        return product(x2, self.qweight, self.scale, float_out, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = as_kernel_input(x)
        if self.native:
            y = self._native_product(x2, False)
        else:
            if self.k_pad:
                x2 = torch.nn.functional.pad(x2, (0, self.k_pad))
            y = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scale)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The product in float32 (an LM head): the native kernel stores its float32 sums, so
        near-tied logits are not rounded to bf16's 1/8 step at magnitude ~20 first."""
        if not self.native:
            return self(x).float()
        y = self._native_product(as_kernel_input(x), True)
        return y.view(*x.shape[:-1], self.out_features)

    def with_int8_activations(self) -> "Int8Weight":
        """This weight repacked for int8 activations (itself when it has them already or
        the kernel cannot take it: see ``int8_activations``)."""
        if self.int8_activations:
            return self
        if self.native:
            q = packed_rows(self.qweight, torch.arange(self.out_features,
                                                       device=self.qweight.device))
        else:
            q = self.qweight[:, :self.in_features]
        other = Int8Weight(q, self.scale[:self.out_features], int8_activations=True)
        return other if other.int8_activations else self

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Dequantized rows ``ids`` (an embedding lookup in the same table)."""
        flat = ids.reshape(-1)
        q = packed_rows(self.qweight, flat) if self.native else \
            self.qweight[:, :self.in_features].index_select(0, flat)
        s = self.scale.index_select(0, flat)
        out = q.to(dtype) * s.to(dtype).unsqueeze(-1)
        return out.view(*ids.shape, self.in_features)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    @property
    def format_name(self) -> str:
        """``int8`` / ``int8-a8`` (int8 activations), as ``describe_quantization`` counts it."""
        return "int8-a8" if self.int8_activations else "int8"

    def extra_repr(self) -> str:
        a8 = ", int8 activations" if self.int8_activations else ""
        return f"int8 per-channel{a8}, {self.out_features}x{self.in_features}"


def kernels_available(device: torch.device) -> bool:
    """The weight-only int4/int8 CPU kernels exist for ``device`` (CPU only for now)."""
    return device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")

"""GPTQ and AWQ checkpoints: Hugging Face folders whose linears are stored as packed 4-bit codes.

A folder's ``config.json`` names its scheme in ``quantization_config``, for example::

    {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": true, "sym": true,
     "checkpoint_format": "gptq"}
    {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": true, "version": "gemm"}

Each quantized linear ``P`` (N outputs, K inputs) is stored as ``P.qweight``, ``P.qzeros``,
``P.scales`` (and GPTQ's ``P.g_idx``) instead of ``P.weight``; ``G`` is the number of groups::

    GPTQ  qweight int32 (K/8, N)   input k = 8r + j in bits 4j..4j+3 of row r
          qzeros  int32 (G, N/8)   output n = 8c + j in bits 4j of column c; the original
                                   format ("gptq") stores z - 1, "gptq_v2" stores z
          scales  fp16  (G, N)     g_idx int32 (K,): the group of input k (act-order, i.e.
                                   ``desc_act``, permutes it; without it k // group_size)
    AWQ   qweight int32 (K, N/8)   output 8c + AWQ_ORDER[j] in bits 4j of column c
          qzeros  int32 (G, N/8)   the same nibble order; scales fp16 (G, N); group k // g

    w[n, k] = scales[g(k), n] * (q[k, n] - z[g(k), n])

:func:`group_packed_tensors` turns a checkpoint's tensor stream into one
:class:`PackedInt4Tensor` per linear, named ``P.weight`` with shape ``(N, K)`` like the float
weight it replaces, so the model code and the loader's shape checks see no difference. A
quantized linear method repacks it for the int4 kernels without a detour through floats
(:mod:`llmserve.model.quant.gptq_awq`); anything else takes :meth:`PackedInt4Tensor.dequantize`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, Optional, Union

import torch

#: The column each of the 8 nibbles of an AWQ int32 holds (AutoAWQ's GEMM packing order).
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_PARTS = ("qweight", "qzeros", "scales", "g_idx")
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


@dataclass(frozen=True)
class Int4CheckpointScheme:
    """How a GPTQ or AWQ folder stores its 4-bit linears (from ``quantization_config``)."""

    method: str                 # "gptq" | "awq"
    group_size: int             # inputs per group; -1: one group per output channel
    desc_act: bool = False      # GPTQ act-order: groups follow g_idx, not k // group_size
    zero_offset: int = 0        # added to the stored zeros (1 for GPTQ's original format)

    @property
    def name(self) -> str:
        """``gptq:int4-g128`` / ``awq:int4-g128`` (``-act`` with act-order): the
        checkpoint's quantization as :class:`ModelConfig.quantization` records it."""
        group = "channel" if self.group_size < 0 else f"g{self.group_size}"
        return f"{self.method}:int4-{group}" + ("-act" if self.desc_act else "")


def parse_int4_scheme(qc: dict, where: str) -> Int4CheckpointScheme:
    """The scheme of a ``quantization_config`` block.

    Raises:
        ValueError: a method other than 4-bit GPTQ/AWQ, or a packing llmserve does not read
            (AWQ GEMV/Marlin layouts, GPTQ Marlin, a quantized LM head), named with ``where``.
    """
    method = str(qc.get("quant_method", "unknown")).lower()
    if method not in ("gptq", "awq"):
        raise ValueError(
            f"{where}: pre-quantized checkpoints of method {method!r} are not supported (GPTQ "
            "and AWQ 4-bit are); load the float checkpoint and quantize at load with "
            "--quantization int8|int4, or use a GGUF file")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ValueError(f"{where}: {method} with {bits} bits is not supported (4 bits only)")
    group = int(qc.get("group_size", qc.get("q_group_size", -1)))
    if group == 0 or group < -1 or (group > 0 and group % 8):
        raise ValueError(f"{where}: {method} group_size {group} is not a positive multiple "
                         "of 8 (or -1)")
    if qc.get("lm_head"):
        raise ValueError(f"{where}: a quantized lm_head is not supported")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"{where}: AWQ version {version!r} is not supported (gemm only)")
        if qc.get("zero_point", True) is not True:
            raise ValueError(f"{where}: AWQ without zero points is not supported")
        return Int4CheckpointScheme("awq", group)
    fmt = str(qc.get("checkpoint_format") or "gptq").lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"{where}: GPTQ checkpoint_format {fmt!r} is not supported "
                         "(gptq or gptq_v2)")
    return Int4CheckpointScheme("gptq", group, bool(qc.get("desc_act", False)),
                                zero_offset=1 if fmt == "gptq" else 0)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """``(..., C)`` int32 -> ``(..., C, 8)`` uint8: nibble j of each word at index j."""
    return ((packed.to(torch.int32).unsqueeze(-1) >> _SHIFTS) & 15).to(torch.uint8)


def _awq_columns(packed: torch.Tensor) -> torch.Tensor:
    """``(R, C)`` AWQ-packed int32 -> ``(R, 8C)`` codes in column order."""
    nib = _nibbles(packed)
    cols = torch.empty_like(nib)
    cols[..., list(AWQ_ORDER)] = nib
    return cols.reshape(packed.shape[0], -1)


@dataclass
class PackedInt4Tensor:
    """One GPTQ/AWQ linear as stored, standing in for its float ``(N, K)`` weight."""

    scheme: Int4CheckpointScheme
    name: str                           # the linear's prefix, for messages
    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    g_idx: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        gptq = self.scheme.method == "gptq"
        rows, cols = self.qweight.shape
        k, n = (rows * 8, cols) if gptq else (rows, cols * 8)
        groups = self.scales.shape[0]
        bad = [f"{part} {tuple(t.shape)} (expected {want})" for part, t, want in (
            ("scales", self.scales, (groups, n)),
            ("qzeros", self.qzeros, (groups, n // 8)),
            ("g_idx", self.g_idx, (k,))) if t is not None and tuple(t.shape) != want]
        if self.qweight.dim() != 2 or n % 8 or bad:
            raise ValueError(f"{self.name}: inconsistent {self.scheme.method} tensors: "
                             f"qweight {tuple(self.qweight.shape)}, " + "; ".join(bad))
        self.shape = (n, k)
        if self.g_idx is not None:
            idx = self.g_idx.long()
            if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= groups):
                raise ValueError(f"{self.name}: g_idx holds groups outside 0..{groups - 1}")
        elif self.scheme.group_size > 0 and -(-k // self.scheme.group_size) != groups:
            raise ValueError(f"{self.name}: {groups} groups of scales for {k} inputs in "
                             f"groups of {self.scheme.group_size}")

    def group_of_input(self) -> torch.Tensor:
        """``(K,)`` int64: the group each input column belongs to."""
        if self.g_idx is not None:
            return self.g_idx.long()
        k = self.shape[1]
        groups = self.scales.shape[0]
        return torch.arange(k) * groups // k if self.scheme.group_size < 0 else \
            torch.arange(k) // self.scheme.group_size

    def codes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q uint8 (N, K) in 0..15, z int16 (N, G), scales float32 (N, G))``."""
        if self.scheme.method == "gptq":
            q = _nibbles(self.qweight.t()).reshape(self.shape)            # (N, K/8, 8)
            z = _nibbles(self.qzeros).reshape(self.qzeros.shape[0], -1)   # (G, N)
        else:
            q = _awq_columns(self.qweight).t()
            z = _awq_columns(self.qzeros)
        z = z.to(torch.int16) + self.scheme.zero_offset
        return q.contiguous(), z.t().contiguous(), self.scales.float().t().contiguous()

    def dequantize(self) -> torch.Tensor:
        """Float32 ``(N, K)``: ``scale * (q - z)`` of each input's group."""
        q, z, s = self.codes()
        g = self.group_of_input()
        return (q.float() - z.float()[:, g]) * s[:, g]


def is_packed_part(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in _PARTS


def group_packed_tensors(tensors: Iterable[tuple[str, torch.Tensor]],
                         scheme: Int4CheckpointScheme, raw: bool
                         ) -> Iterator[tuple[str, Union[torch.Tensor, PackedInt4Tensor]]]:
    """``tensors`` with each linear's packed parts joined into ``P.weight``: a
    :class:`PackedInt4Tensor` when ``raw``, its float32 dequantization otherwise. Other
    tensors pass through unchanged.

    Raises:
        ValueError: a linear whose qweight, qzeros or scales never arrived.
    """
    pending: dict[str, dict[str, torch.Tensor]] = {}
    needed = {"qweight", "qzeros", "scales"} | ({"g_idx"} if scheme.method == "gptq" else set())

    def joined(prefix: str) -> tuple[str, Union[torch.Tensor, PackedInt4Tensor]]:
        parts = pending.pop(prefix)
        packed = PackedInt4Tensor(scheme, prefix, parts["qweight"], parts["qzeros"],
                                  parts["scales"], parts.get("g_idx"))
        return f"{prefix}.weight", packed if raw else packed.dequantize()

    for name, tensor in tensors:
        if not is_packed_part(name):
            yield name, tensor
            continue
        prefix, part = name.rsplit(".", 1)
        pending.setdefault(prefix, {})[part] = tensor
        if needed <= pending[prefix].keys():
            yield joined(prefix)
    for prefix in list(pending):   # a GPTQ export without g_idx: groups are k // group_size
        missing = {"qweight", "qzeros", "scales"} - pending[prefix].keys()
        if missing:
            raise ValueError(f"{prefix}: {scheme.method} tensors {sorted(missing)} are missing")
        yield joined(prefix)

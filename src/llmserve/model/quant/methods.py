"""Quantized linear methods: int4 (group-wise), int8 (per channel), GGUF- and GPTQ/AWQ-as-stored.

They are siblings of :class:`~llmserve.model.layers.linear.DenseLinearMethod`; a model file
builds the same ``Linear`` whatever the method. Loading is staged per layer: each checkpoint
tensor (a float tensor, a :class:`RawGGUFTensor` of a GGUF file, or a GPTQ/AWQ linear's
:class:`PackedInt4Tensor`) is decoded into a
*shard* (exact int4 groups, or float32 values), and as soon as every shard of a fused layer
(q/k/v, gate/up) is in, the layer is packed once and the staging freed::

    checkpoint tensor --decode--> shard --(all shards in)--> choose format --> pack
       Q4_0/Q4_1/Q4_K, GPTQ/AWQ     Int4Groups (exact)            int4 | int8 | dense
       Q4_K (block kernels), Q5_*,  BlockCodes (the file's own)   qblock | split
         Q6_K, Q8_0
       other GGUF types, HF floats  float32 values

Which format a layer gets:

    Int4LinearMethod(g)   int4 group g; exact int4 shards of group g are kept, the rest RTN
    Int8LinearMethod      int8 per channel (RTN of the float values)
    GGUFLinearMethod      what the file holds: int4 when every shard is Q4_0/Q4_1 (or
                          Q4_K without the block kernel), dense when any shard is a float
                          type (F32/F16/BF16); with int8 activations (AVX512-VNNI)
                          Q8_0/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K keep their own codes and scales
                          (``gguf-q5_k-a8``: native_qblock.py) and a fused mix (Q4_K q/k +
                          Q6_K v) is split into one product per format;
                          otherwise (bf16 activations, no VNNI, Q2_K/Q3_K/IQ*) int8 per
                          channel, a second rounding (the load log counts such layers)
    Int4CheckpointLinearMethod  what a GPTQ/AWQ folder holds: int4 in the checkpoint's own
                          groups and act-order (gptq_awq.py), float linears dense

The packed weight is a submodule ``layer.qweight`` (:class:`Int4Weight` / :class:`Int8Weight`
/ :class:`QBlockWeight` / :class:`SplitWeight`); dense layers fall back to
:class:`DenseLinearMethod`. The layer's bias stays dense.
"""
from __future__ import annotations

import logging
from abc import abstractmethod
from collections import Counter
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import nn

from llmserve.model.layers.linear import ATTENTION_INPUT, DenseLinearMethod, Linear, LinearMethod
from llmserve.model.loading.gguf import RawGGUFTensor
from llmserve.model.loading.int4_checkpoint import PackedInt4Tensor
from llmserve.model.quant.block_codes import BlockCodes, to_block_codes
from llmserve.model.quant.gguf_blocks import dequantize_raw, to_int4_groups
from llmserve.model.quant.gptq_awq import checkpoint_int4_groups
from llmserve.model.quant.kernels import (
    INT4_GROUP_SIZES,
    Int4Groups,
    Int4Weight,
    Int8Weight,
    quantize_int4,
    quantize_int8,
)
from llmserve.model.quant.native_qblock import QBlockWeight, SplitWeight, native_qblock_available

logger = logging.getLogger(__name__)

#: Where a shard's values came from (the GGUF policy keys on it).
EXACT_INT4, BLOCKS, OTHER_QUANT, FLOAT = "int4", "blocks", "quant", "float"


@dataclass
class Shard:
    """One checkpoint tensor of a layer, decoded: exact int4 groups, a GGUF block type's own
    codes and scales (Q4_K where the block kernel runs, Q5_*, Q6_K, Q8_0), or float32
    values."""

    origin: str                       # EXACT_INT4 | BLOCKS | OTHER_QUANT | FLOAT
    values: Union[Int4Groups, BlockCodes, torch.Tensor]
    qtype: str = ""                   # the GGUF type name of an OTHER_QUANT shard

    def as_float(self) -> torch.Tensor:
        if isinstance(self.values, (Int4Groups, BlockCodes)):
            return self.values.dequantize()
        return self.values

    @property
    def kind(self) -> str:
        """What can share one packed product with this shard: ``int4-g32``, ``Q6_K``, ...
        (the GGUF type name for other quantized shards)."""
        if isinstance(self.values, Int4Groups):
            return f"int4-g{self.values.group_size}"
        if isinstance(self.values, BlockCodes):
            return self.values.qtype
        return self.qtype or self.origin


CheckpointTensor = Union[torch.Tensor, RawGGUFTensor, PackedInt4Tensor]


def decode_shard(tensor: CheckpointTensor, q4_k_blocks: bool = False) -> Shard:
    """Turn a checkpoint tensor into a :class:`Shard` without a dense detour where possible
    (a Q4_K tensor as block codes with ``q4_k_blocks``, else as int4 groups)."""
    if isinstance(tensor, PackedInt4Tensor):
        groups = checkpoint_int4_groups(tensor)
        if groups is not None:
            return Shard(EXACT_INT4, groups)
        return Shard(OTHER_QUANT, tensor.dequantize(), tensor.scheme.method)
    if isinstance(tensor, RawGGUFTensor):
        codes = to_block_codes(tensor, q4_k=q4_k_blocks)
        if codes is not None:
            return Shard(BLOCKS, codes)
        groups = to_int4_groups(tensor)
        if groups is not None:
            return Shard(EXACT_INT4, groups)
        return Shard(OTHER_QUANT, dequantize_raw(tensor), tensor.qtype.name)
    return Shard(FLOAT, tensor.float())


class QuantizedLinearMethod(LinearMethod):
    """Shared staging and dispatch; subclasses choose the packed format of a full layer."""

    #: The loader should hand this method GGUF matrices as raw blocks (and GPTQ/AWQ
    #: linears as :class:`PackedInt4Tensor`).
    wants_raw_gguf = True
    #: exact int4 shards keep their own group size (a checkpoint's), not int4_group_size()
    keeps_stored_groups = False
    #: Q4_K tensors are decoded as block codes (the block kernel's 4-bit mode), not int4 groups
    q4_k_blocks = False

    def __init__(self, int8_activations: bool = False,
                 bf16_attention_input: bool = False) -> None:
        self.dense = DenseLinearMethod()
        #: int4 layers quantize their activations to int8 (``--int4-activations``)
        self.int8_activations = int8_activations
        #: ... except an attention input projection held as int4 groups, which keeps bf16
        #: activations (``--int4-activations auto``; see :meth:`layer_int8_activations`)
        self.bf16_attention_input = bf16_attention_input

    def layer_int8_activations(self, layer: Linear, fmt: str) -> bool:
        """Whether ``layer``, packed as ``fmt``, quantizes its activations to int8.

        With ``bf16_attention_input`` the q/k/v projection of int4 groups meets bf16
        activations: its rounding errors reach the attention scores inside an exponential,
        and measured per kind of layer it is where int8 activations cost the most quality
        for the time they save (docs/QUANTIZATION.md, "Which products take int8 activations").
        Block-format layers keep int8 activations (their kernels take no others); in a
        split layer (``fmt`` ``"split"``) the int4 parts follow this rule as ``"int4"``.
        """
        if self.bf16_attention_input and fmt == "int4" and layer.role == ATTENTION_INPUT:
            return False
        return self.int8_activations

    # ---- the format decision ----------------------------------------------------------------
    @abstractmethod
    def choose_format(self, shards: list[Shard]) -> str:
        """``"int4"``, ``"int8"``, ``"dense"``, ``"qblock"`` (one GGUF block type kept) or
        ``"split"`` (one product per shard format) for a layer made of ``shards``."""

    def int4_group_size(self) -> int:
        return 32

    # ---- LinearMethod -------------------------------------------------------------------------
    def create_weights(self, layer: Linear, dtype: torch.dtype, device: torch.device) -> None:
        if device.type != "cpu":
            raise ValueError(f"quantized linears run on the CPU kernels only (device {device}); "
                             "use --quantization none on this device")
        layer.weight = None
        layer.bias = None
        if layer.has_bias:
            layer.bias = nn.Parameter(torch.zeros(layer.output_size, dtype=dtype, device=device),
                                      requires_grad=False)
        layer.packed_id = None     # a layer kept dense packs through DenseLinearMethod
        layer.native_weight = None
        layer.qweight = None
        layer.qformat = None
        layer.dtype = dtype
        layer.staged = {}

    def load_weight(self, layer: Linear, name: str, tensor: CheckpointTensor,
                    shard: Optional[int]) -> None:
        if name == "bias":
            self.dense.load_weight(layer, name, tensor, shard)
            return
        if name != "weight":
            raise ValueError(f"layer has no {name!r} parameter")
        if layer.qformat is not None:
            raise ValueError("weights loaded twice into a packed layer")
        rows = layer.output_size if shard is None else layer.output_sizes[shard]
        if tuple(tensor.shape) != (rows, layer.input_size):
            raise ValueError(f"weight: checkpoint shape {tuple(tensor.shape)} does not fit "
                             f"{(rows, layer.input_size)} (shard {shard})")
        layer.staged[-1 if shard is None else shard] = decode_shard(tensor, self.q4_k_blocks)
        if -1 in layer.staged or len(layer.staged) == len(layer.output_sizes):
            self._pack(layer)

    def process_weights_after_loading(self, layer: Linear) -> None:
        if layer.qformat is None:
            missing = [i for i in range(len(layer.output_sizes)) if i not in layer.staged]
            raise ValueError(f"linear layer {layer.output_sizes} never received shards {missing}")

    def _pack(self, layer: Linear) -> None:
        shards = [layer.staged[k] for k in sorted(layer.staged)]
        layer.staged = {}
        fmt = self.choose_format(shards)
        g = self.int4_group_size()
        stored = [s.values for s in shards if isinstance(s.values, Int4Groups)]
        if fmt == "int4" and self.keeps_stored_groups and len(stored) == len(shards):
            if not Int4Groups.fusable(stored):   # act-order shards in different input orders
                fmt = "split"
            g = stored[0].group_size
        if fmt == "int4" and layer.input_size % g:
            fits = [s for s in INT4_GROUP_SIZES if s < g and layer.input_size % s == 0]
            if fits:
                logger.info("linear %s: input size %d is not a multiple of the int4 group %d; "
                            "using groups of %d", layer.output_sizes, layer.input_size, g,
                            fits[-1])
                g = fits[-1]
            else:
                logger.warning("linear %s: input size %d fits no int4 group; kept dense",
                               layer.output_sizes, layer.input_size)
                fmt = "dense"
        if fmt == "int4":
            exact = len(stored) == len(shards) and stored[0].group_size == g \
                and Int4Groups.fusable(stored)
            groups = Int4Groups.cat([s.values for s in shards]) if exact else \
                quantize_int4(torch.cat([s.as_float() for s in shards]), g)
            layer.qweight = Int4Weight(groups,
                                       int8_activations=self.layer_int8_activations(layer, fmt))
        elif fmt == "qblock":
            layer.qweight = QBlockWeight(BlockCodes.cat([s.values for s in shards]))
        elif fmt == "split":
            layer.qweight = SplitWeight(self._split_parts(layer, shards))
        elif fmt == "int8":   # with int8 activations where the tier's int8 x int8 kernel runs
            layer.qweight = Int8Weight(*quantize_int8(torch.cat([s.as_float() for s in shards])),
                                       int8_activations=self.int8_activations)
        elif fmt == "dense":
            weight = torch.cat([s.as_float() for s in shards]).to(layer.dtype)
            layer.weight = nn.Parameter(weight, requires_grad=False)
            self.dense.process_weights_after_loading(layer)
        else:
            raise ValueError(f"unknown packed format {fmt!r}")
        layer.qformat = fmt
        if fmt in ("int4", "qblock", "split", "int8"):
            layer.qformat = layer.qweight.format_name

    def _split_parts(self, layer: Linear, shards: list[Shard]) -> "list[nn.Module]":
        """One weight per run of consecutive shards of one kind (int4 groups of one size and
        input order, a block type)."""
        runs: list[list[Shard]] = []
        for s in shards:
            if runs and runs[-1][0].kind == s.kind and (
                    not isinstance(s.values, Int4Groups)
                    or Int4Groups.fusable([runs[-1][0].values, s.values])):
                runs[-1].append(s)
            else:
                runs.append([s])
        parts: list[nn.Module] = []
        for run in runs:
            if run[0].origin == EXACT_INT4:
                parts.append(Int4Weight(Int4Groups.cat([s.values for s in run]),
                                        int8_activations=self.layer_int8_activations(layer,
                                                                                     "int4")))
            else:
                parts.append(QBlockWeight(BlockCodes.cat([s.values for s in run])))
        return parts

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if layer.qweight is None:
            return self.dense.apply(layer, x)
        y = layer.qweight(x)
        return y if layer.bias is None else y + layer.bias

    def weight_bytes(self, layer: Linear) -> int:
        if layer.qweight is None:
            return self.dense.weight_bytes(layer)
        bias = 0 if layer.bias is None else layer.bias.numel() * layer.bias.element_size()
        return layer.qweight.nbytes + bias


class Int4LinearMethod(QuantizedLinearMethod):
    """Every linear in int4 with groups of ``group_size`` (round-to-nearest where not exact)."""

    def __init__(self, group_size: int = 32, int8_activations: bool = False,
                 bf16_attention_input: bool = False) -> None:
        super().__init__(int8_activations, bf16_attention_input)
        if group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, "
                             f"got {group_size}")
        self.group_size = group_size

    def int4_group_size(self) -> int:
        return self.group_size

    def choose_format(self, shards: list[Shard]) -> str:
        return "int4"


class Int8LinearMethod(QuantizedLinearMethod):
    """Every linear in int8, one scale per output channel (round-to-nearest)."""

    def choose_format(self, shards: list[Shard]) -> str:
        return "int8"


class GGUFLinearMethod(QuantizedLinearMethod):
    """Keep what the GGUF file holds: Q4_0/Q4_1 as exact int4; with int8 activations the
    K-quants and 5/8-bit types in their own blocks (mixed fused layers split by format);
    without them Q4_K as int4 groups and the rest int8."""

    def __init__(self, int8_activations: bool = False,
                 bf16_attention_input: bool = False) -> None:
        super().__init__(int8_activations, bf16_attention_input)
        #: the block kernels run here (int8 activations, VNNI, self-test passed)
        self.block_kernels = int8_activations and native_qblock_available()
        #: Q4_K in its own blocks (4.625 bits a weight, exact) rather than int4 groups of 32
        #: with an fp16 scale and zero each (5 bits, the zero rounded)
        self.q4_k_blocks = self.block_kernels
        #: a K-quant/5-bit embedding table (and tied head) in its own blocks too
        self.gguf_block_tables = self.block_kernels
        #: layers per GGUF type that were dequantized and requantized to int8 per channel
        self.requantized: Counter = Counter()

    def choose_format(self, shards: list[Shard]) -> str:
        origins = {s.origin for s in shards}
        if origins == {EXACT_INT4}:
            return "int4"
        if FLOAT in origins:
            return "dense"
        if self.block_kernels and origins <= {EXACT_INT4, BLOCKS}:
            return "qblock" if len({s.kind for s in shards}) == 1 else "split"
        self.requantized.update(s.kind for s in shards if s.origin != EXACT_INT4)
        return "int8"



class Int4CheckpointLinearMethod(QuantizedLinearMethod):
    """Keep what a GPTQ/AWQ folder holds: its int4 linears in their own groups (act-order
    included; fused shards in different input orders become one product each), its float
    linears (``modules_to_not_convert``, an unquantized layer) dense."""

    keeps_stored_groups = True

    def choose_format(self, shards: list[Shard]) -> str:
        origins = {s.origin for s in shards}
        if origins == {EXACT_INT4}:
            return "int4"
        if OTHER_QUANT in origins:
            logger.warning("a %s linear's groups fit no int4 kernel group size: kept dense",
                           "/".join(sorted({s.kind for s in shards})))
        return "dense"

"""Token embedding and the LM head (which may share the embedding's weight).

A GGUF file's block-quantized table (given raw by a quantized load) is held once, and a tied
head multiplies on the same bytes:

- a K-quant or 5-bit table (Q4_K, Q5_K, Q6_K, Q5_0, Q5_1: a Q4_K_M file's Q6_K table) stays
  in its own blocks where the linear method runs the block kernel (:class:`QBlockTable`,
  ``gguf_block_tables``): the lookup decodes the selected rows, gguf's own values;
- any other (Q8_0, Q4_0, ..., or without the block kernel) becomes int8 rows with one bf16
  scale each (:class:`Int8Weight`): the lookup dequantizes the selected rows, the head runs
  llmserve's native int8 kernels, with int8 activations where the linear method has them
  (``--int4-activations``).

A float table stays dense in the model dtype.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.model.layers import cpu_kernels
from llmserve.model.layers.gemm_row_granule import dtype_kind, row_granule
from llmserve.model.layers.linear import Linear, LinearMethod
from llmserve.model.layers.native_dense import can_pack_native, native_mm, pack_native
from llmserve.model.loading.gguf import RawGGUFTensor

_QUANT_CHUNK_ROWS = 4096
#: GGUF table types kept in their own blocks where the block kernel runs: the ones with a
#: block mode of fewer than 8 bits, which int8 rows would hold in more bytes than the file.
#: Q8_0 stays int8 rows (8 bits against the file's 8.5, one scale a row: a second rounding,
#: 0.8% at most) for the default model's int8 head, tuned for its 49152 x 576 table.
_BLOCK_TABLE_TYPES = frozenset({"Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1"})


def _block_table(raw: RawGGUFTensor, device: torch.device):
    """The table in its file's blocks, or None where they cannot be kept (non-finite scales)."""
    from llmserve.model.quant.native_qblock import QBlockTable

    table = QBlockTable.from_raw(raw)
    return None if table is None else table.to(device)


def _int8_table(raw: RawGGUFTensor, device: torch.device):
    """Requantize a GGUF table to int8 per row, a few thousand rows at a time."""
    from llmserve.model.quant.kernels import Int8Weight, quantize_int8

    rows = raw.shape[0]
    q = torch.empty(raw.shape, dtype=torch.int8)
    scale = torch.empty(rows, dtype=torch.bfloat16)
    for start in range(0, rows, _QUANT_CHUNK_ROWS):
        end = min(start + _QUANT_CHUNK_ROWS, rows)
        q[start:end], scale[start:end] = quantize_int8(torch.from_numpy(raw.dequantize(start, end)))
    return Int8Weight(q.to(device), scale.to(device))


class VocabEmbedding(nn.Module):
    """``ids (T,) -> (T, hidden)`` lookup in a ``(vocab, hidden)`` table of the model dtype,
    or, loaded from a block-quantized GGUF tensor, in its blocks (``block_table``, a
    K-quant/5-bit type) or int8 rows; tied or not, the table is held once."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device, block_table: bool = False) -> None:
        super().__init__()
        self.shape = (vocab_size, hidden_size)
        #: a K-quant/5-bit GGUF table stays in its blocks (the method's gguf_block_tables)
        self.block_table = block_table
        self.dtype = dtype
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype, device=device),
                                   requires_grad=False)
        self.qweight = None
        #: a float32 table held once in ``f32_mm``'s strips by a tied head (lookups read it)
        self.strips: Optional[torch.Tensor] = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            return self.qweight.rows(ids, self.dtype)
        if self.strips is not None:   # row n: strip n // 16, lane n % 16 of every k
            return self.strips.view(-1, self.shape[1], 16)[ids // 16, :, ids % 16]
        return F.embedding(ids, self.weight)

    def keep_as_strips(self, strips: torch.Tensor) -> None:
        """Hold the table only as ``strips`` (a tied head's float32 packing): lookups
        gather their rows from it, and the row-major copy is dropped."""
        self.strips = strips
        self.weight = None

    def load(self, name: str, tensor: "torch.Tensor | RawGGUFTensor", shard: object = None) -> None:
        if name != "weight" or tuple(tensor.shape) != self.shape:
            raise ValueError(f"embedding {self.shape} cannot load {name} of shape "
                             f"{tuple(tensor.shape)}")
        if isinstance(tensor, RawGGUFTensor):
            device = self.weight.device
            self.weight = None
            if self.block_table and tensor.qtype.name in _BLOCK_TABLE_TYPES:
                self.qweight = _block_table(tensor, device)
            if self.qweight is None:
                self.qweight = _int8_table(tensor, device)
            return
        if self.weight is None:
            raise ValueError("embedding loaded twice")
        self.weight.data.copy_(tensor)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the table as held here (0 when a tied head holds it as strips)."""
        if self.qweight is not None:
            return self.qweight.nbytes
        if self.weight is None:
            return 0
        return self.weight.numel() * self.weight.element_size()


class LMHead(nn.Module):
    """Float32 logits ``(N, vocab)``; its own Linear, or the embedding table when tied.

    A tied bf16 head on CPU multiplies with a packed copy of the table (the native bf16
    kernel's pairs, or oneDNN's layout; the lookup keeps the row-major table). A tied float32
    head packs the table into ``f32_mm``'s strips and the embedding then looks its rows up
    there (``VocabEmbedding.keep_as_strips``): the table is held once. Without ``f32_mm``
    (the ``none`` tier) a float32 table takes oneDNN's layout as a bf16 one does.
    """

    def __init__(self, vocab_size: int, hidden_size: int, *, tied_to: Optional[VocabEmbedding],
                 method: LinearMethod, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.tied = tied_to
        self.linear: Optional[Linear] = None
        if tied_to is None:
            self.linear = Linear(hidden_size, vocab_size, bias=False, method=method, dtype=dtype,
                                 device=device)
        self.vocab_size = vocab_size
        self.packed_id: Optional[int] = None
        self.native_head: Optional[torch.Tensor] = None
        self.row_granule = 0   # a tied table left to F.linear: PyTorch's row granule (0: not)
        # the linear method's choice for quantized products (--int4-activations) also
        # holds for a tied int8 table
        self.int8_activations = bool(getattr(method, "int8_activations", False))

    def finish_loading(self, prepack: bool = True) -> None:
        if self.linear is None and self.tied.qweight is not None and self.int8_activations:
            self.tied.qweight = self.tied.qweight.with_int8_activations()
        if self.linear is not None or self.tied.weight is None:
            return
        if prepack and can_pack_native(self.tied.weight.data):
            self.native_head = pack_native(self.tied.weight.data)
            if self.native_head.dtype == torch.float32:   # one copy: lookups use the strips
                self.tied.keep_as_strips(self.native_head)
        elif prepack and cpu_kernels.can_prepack(self.tied.weight):
            self.packed_id = cpu_kernels.prepack_linear(self.tied.weight.data)
        elif self.tied.weight.device.type == "cpu":
            self.row_granule = row_granule(dtype_kind(self.tied.weight.dtype))

    @property
    def extra_bytes(self) -> int:
        """Bytes held beyond the embedding table (its own weight, or a packed copy)."""
        if self.linear is not None:
            return self.linear.weight_bytes
        if self.native_head is not None:
            return self.native_head.numel() * self.native_head.element_size()
        return cpu_kernels.packed_bytes(self.packed_id) if self.packed_id is not None else 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.linear is not None:
            return self.linear(x).float()
        if self.native_head is not None:
            return native_mm(x, self.native_head, self.vocab_size, float_out=True)
        if self.packed_id is not None:
            return cpu_kernels.packed_linear(x, self.packed_id, self.vocab_size).float()
        if self.tied.qweight is not None:
            return self.tied.qweight.logits(x)
        return cpu_kernels.linear_rows(x, self.tied.weight, None, self.row_granule).float()

    def __del__(self) -> None:
        pid = self.__dict__.get("packed_id")
        if pid is not None:
            cpu_kernels.release(pid)

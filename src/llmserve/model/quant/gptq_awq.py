"""GPTQ/AWQ linears as the int4 kernels' groups: an exact re-layout of the stored codes.

The kernels take ``w = (q - 8) * scale + zero`` in contiguous groups of 32/64/128/256
inputs (:class:`~llmserve.model.quant.kernels.Int4Groups`). A checkpoint's
``w = scale * (q - z)`` (:mod:`llmserve.model.loading.int4_checkpoint`) maps onto it exactly:

- the codes ``q`` are kept as they are, and ``zero = scale * (8 - z)`` for the integer zero
  point ``z``;
- act-order (GPTQ ``desc_act``): the input columns are sorted by group (stable), so every group
  is contiguous; the product gathers ``x``'s columns in that order first (``Int4Groups.perm``);
- a group size the kernels lack, or that does not divide K (a last, partial group), is cut
  into the largest kernel group size whose runs of columns all fall inside one stored group:
  the scales and zeros repeat, the values are unchanged. Per-channel (``group_size -1``)
  becomes the largest kernel size dividing K.

When no kernel size fits (K not a multiple of 32 with groups that break inside 32 columns),
:func:`checkpoint_int4_groups` returns None and the caller keeps the layer dense.
"""
from __future__ import annotations

from typing import Optional

import torch

from llmserve.model.loading.int4_checkpoint import PackedInt4Tensor
from llmserve.model.quant.kernels import INT4_GROUP_SIZES, Int4Groups


def _kernel_group(sorted_groups: torch.Tensor) -> Optional[int]:
    """The largest kernel group size ``s`` such that every run of ``s`` consecutive columns
    (of the group-sorted order) lies in one stored group."""
    k = sorted_groups.numel()
    for size in sorted(INT4_GROUP_SIZES, reverse=True):
        if k % size == 0:
            runs = sorted_groups.view(k // size, size)
            if bool((runs[:, 0] == runs[:, -1]).all()):
                return size
    return None


def checkpoint_int4_groups(packed: PackedInt4Tensor) -> Optional[Int4Groups]:
    """The exact :class:`Int4Groups` of a stored GPTQ/AWQ linear (None: no kernel group
    size fits its groups; see the module docstring)."""
    group_of = packed.group_of_input()
    perm: Optional[torch.Tensor] = None
    if bool((group_of[1:] < group_of[:-1]).any()):    # act-order: sort columns by group
        perm = torch.argsort(group_of, stable=True)
        group_of = group_of[perm]
    size = _kernel_group(group_of)
    if size is None:
        return None
    q, z, s = packed.codes()
    if perm is not None:
        q = q[:, perm].contiguous()
    run_group = group_of[::size]                          # the stored group of each run
    scale = s[:, run_group].contiguous()
    zero = scale * (8.0 - z[:, run_group].float())
    return Int4Groups(q, scale, zero, size, perm=perm)

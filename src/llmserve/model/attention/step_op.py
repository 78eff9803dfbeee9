"""Attention as one opaque operator, so a step of any shape compiles around it.

A decode-only step compiles whole (model/compile.py): its attention is a few tensor ops
over the slot table. A step with prefill chunks or speculative drafts has a ragged layout
(per-sequence query lengths, grouped SDPA calls chosen on the host) that a graph cannot
hold, yet the rest of each layer (projections, norms, rotary, MLP) is the same dense
math over ``T`` tokens as in decode. So the general compiled step traces the model with
``meta=None`` and every layer's attention becomes a call of ``llmserve::step_attention``:
inductor fuses and schedules everything between the calls, and the operator runs the
backend eagerly with the step's metadata, which the runner installs for the duration of
the call (``step_metadata``)::

    compiled graph:  embed -> [qkv, norm, rotary] -> step_attention(q, k, v, K, V, id)
                            -> [o_proj, residual, norm, mlp] -> ... x layers
    step_attention:  AttentionBackend.forward(q, k, v, K, V, <installed metadata>, ...)

The operator writes the new K/V into the caches (declared as mutated arguments) and
returns ``(T, H * D)``. Layers are found by the integer id given at registration.
"""
from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager
from typing import Iterator, Optional

import torch

from llmserve.model.attention.backend import AttentionMetadata

_state = threading.local()
_layers: list[weakref.ref] = []
_registry_lock = threading.Lock()


def register_layer(attention: torch.nn.Module) -> int:
    """An id for ``attention`` (it needs ``backend``, ``scale``, ``window``, ``softcap``)."""
    with _registry_lock:
        _layers.append(weakref.ref(attention))
        return len(_layers) - 1


@contextmanager
def step_metadata(meta: AttentionMetadata) -> Iterator[None]:
    """Install ``meta`` as the metadata every ``step_attention`` call of this thread uses."""
    previous: Optional[AttentionMetadata] = getattr(_state, "meta", None)
    _state.meta = meta
    try:
        yield
    finally:
        _state.meta = previous


@torch.library.custom_op("llmserve::step_attention", mutates_args=("k_cache", "v_cache"))
def step_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, layer_id: int) -> torch.Tensor:
    """Write ``k``/``v`` into the caches and attend ``q`` over them, for layer ``layer_id``,
    with the installed step metadata. ``q (T, H, D)`` -> ``(T, H * D)``."""
    meta = getattr(_state, "meta", None)
    if meta is None:
        raise RuntimeError("step_attention called outside step_metadata()")
    layer = _layers[layer_id]()
    if layer is None:
        raise RuntimeError(f"attention layer {layer_id} no longer exists")
    out = layer.backend.forward(q, k, v, k_cache, v_cache, meta, layer.scale, layer.window,
                                layer.softcap)
    return out.clone() if out.data_ptr() in (q.data_ptr(), k.data_ptr(), v.data_ptr()) else out


@step_attention.register_fake
def _step_attention_shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor,
                          layer_id: int) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * v.shape[2])

"""LoRA slots of one model: wrapping, host copies, the LRU of resident adapters, step rows.

    register(ref)    read + validate the PEFT tensors, keep them in host memory
    prepare(step)    every adapter of the step gets a slot (least recently used evicted,
                     copied in from host memory), then each slot's token rows for all layers
    unregister(ref)  forget the host copy and free its slot

Only the projections a family's ``rename`` maps onto a :class:`Linear` are wrapped (the
Llama family: all seven). Wrapping happens only when LoRA is enabled (``--max-loras``), so
an engine without adapters runs the plain layers.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Optional, Sequence

import torch
from torch import nn

from llmserve.lora.layers import LoraLinear, LoraStepState
from llmserve.lora.registry import SUPPORTED_TARGETS, LoraError, LoraRef
from llmserve.lora.weights import TARGET_SUBPATH, LoadedAdapter, check_shapes, load_adapter_tensors
from llmserve.model.layers.linear import Linear

logger = logging.getLogger(__name__)


class LoraManager:
    """Owns the LoRA-wrapped layers of ``model`` and which adapter sits in which slot."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"LoRA needs max_loras >= 1 and max_lora_rank >= 1, got "
                             f"{max_loras} and {max_rank}")
        self.model = model
        self.max_loras = max_loras
        self.max_rank = max_rank
        # small bf16/fp16 matmuls are slow on CPUs (no packed kernel for them): the
        # low-rank products run in float32 there; on accelerators in the model dtype
        self.dtype = torch.float32 if device.type == "cpu" else dtype
        self.device = device
        self.state = LoraStepState(max_loras)
        self.num_layers = len(model.layers)
        #: (layer, PEFT target) -> (wrapped layer, shard of the fused layer)
        self.targets: dict[tuple[int, str], tuple[LoraLinear, Optional[int]]] = {}
        self.layers: list[LoraLinear] = []   # each wrapped layer once (a fused one has targets)
        self._wrap()
        self.host: dict[str, LoadedAdapter] = {}            # content hash -> tensors
        self.resident: "OrderedDict[str, int]" = OrderedDict()  # content hash -> slot (LRU)
        self.free_slots = list(range(max_loras))
        self.num_swaps = 0

    # ---- wrapping -------------------------------------------------------------------
    def _wrap(self) -> None:
        wrapped: dict[str, LoraLinear] = {}
        for i in range(self.num_layers):
            for target in SUPPORTED_TARGETS:
                path, shard = self.model.rename(TARGET_SUBPATH[target])
                full = f"layers.{i}.{path}"
                layer = wrapped.get(full)
                if layer is None:
                    try:
                        base = self.model.get_submodule(full)
                    except AttributeError:
                        continue
                    if not isinstance(base, Linear):
                        continue
                    layer = LoraLinear(base, self.state, self.max_loras, self.max_rank,
                                       self.dtype, self.device)
                    parent_path, attr = full.rsplit(".", 1)
                    setattr(self.model.get_submodule(parent_path), attr, layer)
                    wrapped[full] = layer
                self.targets[(i, target)] = (layer, shard)
        self.layers = list(wrapped.values())
        if not self.targets:
            raise ValueError(f"LoRA adapters are not supported for {type(self.model).__name__}: "
                             "none of its projections is a plain Linear layer")
        logger.info("LoRA: %d layers wrapped, %d slots of rank <= %d (%.1f MB)", len(wrapped),
                    self.max_loras, self.max_rank, self.slot_bytes / 1e6)

    # ---- adapters -------------------------------------------------------------------
    def register(self, ref: LoraRef) -> None:
        """Load ``ref``'s tensors into host memory after checking they fit the model."""
        if ref.rank > self.max_rank:
            raise LoraError(f"LoRA adapter {ref.name!r} has rank {ref.rank}, above "
                            f"--max-lora-rank {self.max_rank}")
        adapter = load_adapter_tensors(ref, self.num_layers)
        for pair in adapter.pairs:
            found = self.targets.get((pair.layer, pair.target))
            if found is None:
                raise LoraError(f"LoRA adapter {ref.name!r} targets {pair.target}, which "
                                f"{type(self.model).__name__} has no plain layer for")
            layer, shard = found
            _col, out = layer.shard_columns(shard)
            check_shapes(adapter, layer.input_size, out, pair)
        self.host[ref.content_hash] = adapter

    def unregister(self, ref: LoraRef) -> None:
        """Forget an adapter (host copy and slot); unknown refs are ignored."""
        self.host.pop(ref.content_hash, None)
        slot = self.resident.pop(ref.content_hash, None)
        if slot is not None:
            for layer in self.layers:
                layer.clear_slot(slot)
            self.free_slots.append(slot)

    def _slot_for(self, ref: LoraRef, keep: set[str]) -> int:
        key = ref.content_hash
        slot = self.resident.get(key)
        if slot is not None:
            self.resident.move_to_end(key)
            return slot
        adapter = self.host.get(key)
        if adapter is None:   # not registered through this manager: read it now
            self.register(ref)
            adapter = self.host[key]
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            victim = next((k for k in self.resident if k not in keep), None)
            if victim is None:
                raise RuntimeError(f"a step uses more than {self.max_loras} LoRA adapters "
                                   "(the scheduler should have kept it within --max-loras)")
            slot = self.resident.pop(victim)
        self._write(slot, adapter)
        self.resident[key] = slot
        self.num_swaps += 1
        return slot

    def _write(self, slot: int, adapter: LoadedAdapter) -> None:
        for layer in self.layers:
            layer.clear_slot(slot)
        for pair in adapter.pairs:
            layer, shard = self.targets[(pair.layer, pair.target)]
            layer.set_shard(slot, shard, pair.lora_a.to(self.dtype), pair.lora_b.to(self.dtype),
                            adapter.ref.scaling)

    # ---- one step -------------------------------------------------------------------
    def prepare(self, loras: Sequence[Optional[LoraRef]], query_lens: Sequence[int]) -> None:
        """Slots for this step's adapters and each slot's token rows (in runner order:
        ``loras[i]`` and ``query_lens[i]`` of the i-th staged sequence)."""
        if all(ref is None for ref in loras):
            self.state.clear()
            return
        keep = {ref.content_hash for ref in loras if ref is not None}
        index = [0 if ref is None else 1 + self._slot_for(ref, keep) for ref in loras]
        self.state.set(index, list(query_lens), self.device)

    @property
    def slot_bytes(self) -> int:
        return sum(w.slot_bytes for w in self.layers)

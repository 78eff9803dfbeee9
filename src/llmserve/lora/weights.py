"""Reading a PEFT adapter's tensors and mapping them onto the model's fused layers.

PEFT names one low-rank pair per projection of the Hugging Face model::

    base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight   [r, hidden]
    base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight   [q_rows, r]

llmserve fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``; the model family's
``rename`` (the same table the checkpoint loader uses) gives each projection its fused
module and shard, so ``q_proj`` lands in shard 0 of ``layers.3.self_attn.qkv_proj``. Any
other tensor (embeddings, DoRA magnitudes, biases, ``modules_to_save`` copies) is refused.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional

import torch

from llmserve.lora.registry import (
    SUPPORTED_TARGETS,
    WEIGHTS_FILE,
    LoraError,
    LoraRef,
    adapter_content_hash,
)

_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")

#: PEFT target -> the sub-module path of a decoder layer in the Hugging Face naming
TARGET_SUBPATH = {t: ("self_attn." if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp.")
                  + t for t in SUPPORTED_TARGETS}


@dataclass
class LoraPair:
    """One projection of one layer: ``A [r, in]``, ``B [out, r]`` (CPU, float32)."""

    layer: int
    target: str
    lora_a: torch.Tensor
    lora_b: torch.Tensor


@dataclass
class LoadedAdapter:
    """An adapter's tensors in host memory, ready to be copied into a slot."""

    ref: LoraRef
    pairs: list[LoraPair]

    @property
    def nbytes(self) -> int:
        return sum(p.lora_a.numel() * 4 + p.lora_b.numel() * 4 for p in self.pairs)


def load_adapter_tensors(ref: LoraRef, num_layers: int) -> LoadedAdapter:
    """Read ``ref``'s safetensors file; check it is still the registered content."""
    from safetensors.torch import load_file

    if adapter_content_hash(ref.path) != ref.content_hash:
        raise LoraError(f"LoRA adapter {ref.name!r}: the files in {ref.path} changed since it "
                        "was registered; load it again")
    try:
        tensors = load_file(os.path.join(ref.path, WEIGHTS_FILE), device="cpu")
    except Exception as exc:  # noqa: BLE001 - a corrupt file is the adapter's error
        raise LoraError(f"LoRA adapter {ref.name!r}: cannot read {WEIGHTS_FILE}: {exc}") from None
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise LoraError(f"LoRA adapter {ref.name!r}: tensor {key!r} is not a LoRA A/B "
                            "weight of a supported projection (DoRA, embeddings, biases and "
                            "modules_to_save are not supported)")
        layer, group, target, half = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if target not in SUPPORTED_TARGETS or TARGET_SUBPATH[target] != f"{group}.{target}":
            raise LoraError(f"LoRA adapter {ref.name!r}: tensor {key!r} targets an unsupported "
                            f"module; supported: {list(SUPPORTED_TARGETS)}")
        if not 0 <= layer < num_layers:
            raise LoraError(f"LoRA adapter {ref.name!r}: tensor {key!r} names layer {layer}, "
                            f"the model has {num_layers}")
        if tensor.dim() != 2:
            raise LoraError(f"LoRA adapter {ref.name!r}: tensor {key!r} is not a matrix")
        if not bool(torch.isfinite(tensor).all()):
            raise LoraError(f"LoRA adapter {ref.name!r}: tensor {key!r} holds NaN or infinite "
                            "values")
        halves.setdefault((layer, target), {})[half] = tensor.float()
    pairs = []
    for (layer, target), ab in sorted(halves.items()):
        if set(ab) != {"A", "B"}:
            raise LoraError(f"LoRA adapter {ref.name!r}: layer {layer} {target} has lora_"
                            f"{''.join(ab)} but not its pair")
        a, b = ab["A"], ab["B"]
        if a.shape[0] != ref.rank or b.shape[1] != ref.rank:
            raise LoraError(f"LoRA adapter {ref.name!r}: layer {layer} {target} has rank "
                            f"{a.shape[0]}/{b.shape[1]}, the config says r={ref.rank}")
        pairs.append(LoraPair(layer, target, a, b))
    if not pairs:
        raise LoraError(f"LoRA adapter {ref.name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    return LoadedAdapter(ref, pairs)


def check_shapes(adapter: LoadedAdapter, in_size: int, out_size: int, pair: LoraPair,
                 where: Optional[str] = None) -> None:
    """LoraError unless ``pair`` fits a projection of ``in_size`` -> ``out_size``."""
    if tuple(pair.lora_a.shape) != (adapter.ref.rank, in_size) or \
            tuple(pair.lora_b.shape) != (out_size, adapter.ref.rank):
        raise LoraError(
            f"LoRA adapter {adapter.ref.name!r} does not fit this model: layer {pair.layer} "
            f"{pair.target} has A {tuple(pair.lora_a.shape)} and B {tuple(pair.lora_b.shape)}, "
            f"the model's {where or pair.target} maps {in_size} -> {out_size} (is the adapter "
            "for another base model?)")

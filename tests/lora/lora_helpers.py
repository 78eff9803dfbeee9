"""Tiny random LoRA adapters built with peft at test time (ground truth: transformers + peft)."""
from __future__ import annotations

import json
import os
from typing import Optional, Sequence

import torch

from tests.model.tiny_checkpoints import make_tiny_checkpoint

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_base(directory: str, seed: int = 1) -> str:
    """A tiny random Llama (4 heads, 2 KV heads, hidden 64, 2 layers)."""
    return make_tiny_checkpoint(directory, arch="llama", num_heads=4, num_kv_heads=2, seed=seed)


def make_adapter(base: str, out: str, *, r: int = 4, alpha: int = 8, seed: int = 0,
                 targets: Sequence[str] = ALL_TARGETS, use_rslora: bool = False,
                 scale: float = 0.3) -> str:
    """Save a PEFT LoRA on ``base`` with random A and B (so the delta is not zero)."""
    import peft
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets),
                          use_rslora=use_rslora, init_lora_weights=False)
    model = peft.get_peft_model(hf, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
    model.save_pretrained(out)
    return out


def load_peft(base: str, adapter: str):
    """transformers + peft model of ``base`` with ``adapter`` (fp32, eval)."""
    import peft
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(hf, adapter)
    model.eval()
    return model


def peft_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def peft_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def edit_config(adapter: str, **changes: Optional[object]) -> None:
    """Rewrite fields of an adapter's adapter_config.json."""
    path = os.path.join(adapter, "adapter_config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(path, "w") as f:
        json.dump(cfg, f)


def make_adapter_set(root: str) -> tuple[str, str, str]:
    """(base, adapter a: all targets, adapter b: q/v only with rsLoRA) under ``root``."""
    base = make_base(os.path.join(root, "base"))
    a = make_adapter(base, os.path.join(root, "lora_a"), seed=1)
    b = make_adapter(base, os.path.join(root, "lora_b"), r=8, alpha=16, seed=2,
                     targets=["q_proj", "v_proj"], use_rslora=True)
    return base, a, b

"""``llmserve export-hf``: write a checkpoint llmserve can load as a Hugging Face model folder.

The main use is a GGUF file (the default model is a Q4_1 GGUF) for peers that only read HF
folders, such as vLLM: the weights are dequantized by llmserve's own loader (which already
un-permutes llama.cpp's Q/K rows to HF's rotary layout), cast to ``dtype`` and written as::

    config.json               architecture, sizes, rope, special token ids, dtype
    model.safetensors         HF-named tensors (no lm_head when the embeddings are tied)
    generation_config.json    bos / eos ids
    tokenizer.json            the tokenizer (rebuilt from GGUF metadata for a GGUF file)
    tokenizer_config.json     special tokens and the chat template

An HF folder works as a source too (a dtype conversion, in effect).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any, Optional

from llmserve.model.config import ModelConfig

logger = logging.getLogger(__name__)

#: ModelConfig.architecture -> (HF architectures[0], model_type).
HF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}
EXPORT_DTYPES = ("bfloat16", "float16", "float32")


def hf_config_dict(config: ModelConfig, dtype: str) -> dict[str, Any]:
    """The ``config.json`` content transformers (5.x and 4.x readers) and vLLM expect."""
    if config.architecture not in HF_ARCHITECTURES:
        raise ValueError(f"cannot export architecture {config.architecture!r}; "
                         f"supported: {sorted(HF_ARCHITECTURES)}")
    arch_name, model_type = HF_ARCHITECTURES[config.architecture]
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling:
        rope.update(config.rope_scaling)
    eos = list(config.eos_token_ids)
    out: dict[str, Any] = {
        "architectures": [arch_name],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "hidden_act": config.hidden_act,
        "rope_theta": config.rope_theta,
        "rope_parameters": rope,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "dtype": dtype,
        "torch_dtype": dtype,
    }
    if config.rope_scaling:
        out["rope_scaling"] = dict(config.rope_scaling)
    if config.architecture == "llama":
        out.update(attention_bias=config.attention_bias, mlp_bias=False)
    elif config.architecture == "mistral":
        out.update(sliding_window=config.sliding_window)
    elif config.architecture == "qwen3":
        out.update(attention_bias=config.attention_bias, use_sliding_window=False,
                   sliding_window=None)
    else:
        out.update(use_sliding_window=False, sliding_window=None)
    return out


def _write_json(path: str, doc: dict) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(doc, handle, indent=2, ensure_ascii=False)
        handle.write("\n")


def export_hf(source: str, out_dir: str, dtype: str = "bfloat16",
              tokenizer_source: Optional[str] = None) -> str:
    """Write ``source`` (a GGUF file or HF folder) as an HF folder in ``out_dir``; return it.

    ``tokenizer_source`` (an HF folder, ``.gguf`` or ``tokenizer.json`` path) overrides where
    the tokenizer comes from; by default it is ``source`` itself. A source without tokenizer
    data still exports its weights, with a warning and no tokenizer files.

    Raises:
        FileNotFoundError: ``source`` does not exist.
        ValueError: an unsupported dtype or architecture, or weights that do not match.
    """
    import torch
    from safetensors.torch import save_file

    from llmserve.model.loading.loader import load_checkpoint
    from llmserve.tokenizer.tokenizer import Tokenizer

    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype must be one of {EXPORT_DTYPES}, got {dtype!r}")
    if not os.path.exists(source):
        raise FileNotFoundError(f"model path {source!r} does not exist")
    if os.path.abspath(source) == os.path.abspath(out_dir):
        raise ValueError("the output folder must differ from the source")
    ckpt = load_checkpoint(source, dtype=torch.float32)
    target = getattr(torch, dtype)
    weights = {name: t.to(target).contiguous() for name, t in ckpt.weights.items()}
    os.makedirs(out_dir, exist_ok=True)
    save_file(weights, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    _write_json(os.path.join(out_dir, "config.json"), hf_config_dict(ckpt.config, dtype))
    eos = list(ckpt.config.eos_token_ids)
    _write_json(os.path.join(out_dir, "generation_config.json"), {
        "bos_token_id": ckpt.config.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
    })
    try:
        tokenizer = Tokenizer.from_path(tokenizer_source or source)
    except (ValueError, KeyError, FileNotFoundError) as exc:
        if tokenizer_source:
            raise
        logger.warning("no tokenizer written: %s has no usable tokenizer (%s)", source, exc)
    else:
        tokenizer.save_pretrained(out_dir)
    logger.info("exported %s (%s, %d tensors) to %s in %s", source, ckpt.config.architecture,
                len(weights), out_dir, dtype)
    return out_dir


def add_export_hf_subparser(subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    """Register ``export-hf GGUF_OR_FOLDER OUT_DIR [--dtype D] [--tokenizer PATH]``."""
    p = subparsers.add_parser("export-hf", help="write a GGUF file (or HF folder) as an HF "
                              "folder: config, safetensors, tokenizer, chat template")
    p.add_argument("source", help="a .gguf file, an HF folder, or 'default'")
    p.add_argument("out_dir")
    p.add_argument("--dtype", choices=EXPORT_DTYPES, default="bfloat16")
    p.add_argument("--tokenizer", default=None,
                   help="take the tokenizer from this path instead of the source")
    p.set_defaults(func=export_hf_command)
    return p


def export_hf_command(args: argparse.Namespace) -> int:
    """Handler of ``export-hf``."""
    from llmserve.default_model import resolve_model_path

    out = export_hf(resolve_model_path(args.source), args.out_dir, args.dtype, args.tokenizer)
    sys.stdout.write(out + "\n")
    return 0

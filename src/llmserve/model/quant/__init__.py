"""Weight quantization: which linear method an engine runs, and what it ended up holding.

``--quantization`` (EngineConfig.quantization):

    none  dense weights in the model dtype (a GGUF file is dequantized at load)
    auto  a GGUF file keeps its quantized weights packed (GGUFLinearMethod), and a GPTQ/AWQ
          folder its int4 linears in their own groups (Int4CheckpointLinearMethod), when the
          model runs bf16 activations on the CPU (the kernels' arithmetic), or float32 ones
          on the avx2 tier with its int8-activation kernels (no native bf16 there);
          otherwise, like none (dequantized). HF float checkpoints stay dense.
    int8  every linear int8 per output channel (round-to-nearest at load)
    int4  every linear int4 in groups of ``quantization_group_size`` (32/64/128/256),
          round-to-nearest at load; a GGUF file's 4-bit blocks of 32 are kept exactly

An explicit int8/int4 with a float32 model converts activations to bf16 around each
quantized product. ``--int4-activations`` (EngineConfig.int4_activations) says what meets the
int4 codes: ``int8`` rows quantized in blocks of 32 (llama.cpp's Q4 x Q8 arithmetic, on
AVX512-VNNI) for every product, ``bf16`` the activations as they are; ``auto`` is int8 where
the kernel runs except the q/k/v projection of int4 groups, which keeps bf16 activations where
the native bf16 kernel runs (the AVX512-BF16 tier): per unit of time saved, int8 activations
cost the most quality there (docs/QUANTIZATION.md).
The same choice holds for a GGUF file's tied embedding table kept as int8 rows: with int8
activations the LM head multiplies by ``int8_a8_mm`` (``embedding:int8-a8`` in the name); a
K-quant or 5-bit table stays in its blocks where the block kernel runs
(``embedding:gguf-q6_k-a8``, layers/embedding.py).
The kernels are CPU-only; other devices need ``none``.
See docs/QUANTIZATION.md for formats, kernels, errors and figures.
"""
from __future__ import annotations

import logging
from collections import Counter

import torch
from torch import nn

from llmserve.config import INT4_ACTIVATIONS
from llmserve.model.config import ModelConfig
from llmserve.model.layers.embedding import VocabEmbedding
from llmserve.model.layers.linear import DenseLinearMethod, Linear, LinearMethod
from llmserve.model.native.ops import cpu_tier
from llmserve.model.quant.kernels import kernels_available
from llmserve.model.quant.methods import (
    GGUFLinearMethod,
    Int4CheckpointLinearMethod,
    Int4LinearMethod,
    Int8LinearMethod,
)
from llmserve.model.quant.native_int4 import native_int4_a8_available, native_int4_available

logger = logging.getLogger(__name__)

QUANTIZATION_CHOICES = ("auto", "none", "int8", "int4")
_FLOAT_FILE_TYPES = ("gguf:F32", "gguf:F16", "gguf:BF16")


def int4_int8_activations(choice: str, device: torch.device) -> bool:
    """Whether int4 products quantize their activations to int8 (``--int4-activations``).

    Raises:
        ValueError: an unknown choice, or ``int8`` where the int4 x int8 kernel cannot run.
    """
    if choice not in INT4_ACTIVATIONS:
        raise ValueError(f"int4_activations must be one of {', '.join(INT4_ACTIVATIONS)}; "
                         f"got {choice!r}")
    if choice == "bf16":
        return False
    usable = device.type == "cpu" and native_int4_a8_available()
    if choice == "int8" and not usable:
        raise ValueError("--int4-activations int8 needs llmserve's int4 x int8 CPU kernel "
                         "(AVX512-VNNI, a C++ compiler); use auto or bf16 on this machine")
    return usable


def _int8_products_without_bf16(int4_activations: str, device: torch.device) -> bool:
    """The avx2 tier with its int8-activation kernels: a float32 model (``--dtype auto`` on a
    CPU without native bf16) keeps a packed file packed, as llama.cpp does there (float32
    activations, quantized to int8 rows for each product)."""
    return (device.type == "cpu" and cpu_tier() == "avx2" and int4_activations != "bf16"
            and native_int4_a8_available())


def _bf16_attention_input(int4_activations: str, int8_activations: bool) -> bool:
    """``auto``'s one exception to int8 activations: the q/k/v projection's int4 products keep
    bf16 activations where the native bf16 int4 kernel runs (the AVX512-BF16 tiers; not the
    avx2 tier, whose float32 rows all meet int8 kernels); ``int8`` quantizes every
    product's activations."""
    return int4_activations == "auto" and int8_activations and native_int4_available()


def select_linear_method(quantization: str, group_size: int, model: ModelConfig,
                         dtype: torch.dtype, device: torch.device,
                         int4_activations: str = "auto") -> LinearMethod:
    """The LinearMethod for ``--quantization`` on this model, dtype and device;
    ``int4_activations`` as :func:`int4_int8_activations`.

    Raises:
        ValueError: an unknown choice, or int8/int4 on a device without the kernels.
    """
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}; "
                         f"got {quantization!r}")
    if quantization == "none":
        return DenseLinearMethod()
    usable = kernels_available(device)
    if quantization == "auto":
        gguf = model.source_format == "gguf" and model.quantization not in _FLOAT_FILE_TYPES
        int4_folder = model.source_format == "hf" and model.quantization is not None
        packed_file = gguf or int4_folder
        if packed_file and usable and (dtype == torch.bfloat16 or (
                dtype == torch.float32 and _int8_products_without_bf16(int4_activations,
                                                                       device))):
            a8 = int4_int8_activations(int4_activations, device)
            mixed = _bf16_attention_input(int4_activations, a8)
            return GGUFLinearMethod(a8, mixed) if gguf else Int4CheckpointLinearMethod(a8, mixed)
        if packed_file:
            logger.info("quantization auto: %s weights dequantized to %s (packed kernels need "
                        "bf16 activations on the CPU, or int8 ones on the avx2 tier)",
                        model.quantization, str(dtype).replace("torch.", ""))
        return DenseLinearMethod()
    if not usable:
        raise ValueError(f"--quantization {quantization} needs the CPU int4/int8 kernels; "
                         f"device {device} has none (use --quantization none)")
    if quantization == "int8":
        return Int8LinearMethod()
    a8 = int4_int8_activations(int4_activations, device)
    return Int4LinearMethod(group_size, a8, _bf16_attention_input(int4_activations, a8))


def describe_quantization(model: nn.Module) -> str:
    """What the loaded model holds, e.g. ``linear:int4-g32x210;embedding:int8``.

    It names the runtime formats, so two engines with the same file but different
    ``--quantization`` (or dtype) never share a fingerprint.
    """
    embedding = "none"
    for module in model.modules():
        if isinstance(module, VocabEmbedding):
            q = module.qweight
            embedding = "dense" if q is None else q.format_name
    linear = ",".join(f"{k}x{v}" for k, v in sorted(linear_formats(model).items()))
    return f"linear:{linear};embedding:{embedding}"


def linear_formats(model: nn.Module) -> Counter:
    """How many linears hold each packed format (``dense`` for unpacked ones)."""
    return Counter(getattr(m, "qformat", None) or "dense" for m in model.modules()
                   if isinstance(m, Linear))


__all__ = ["QUANTIZATION_CHOICES", "describe_quantization", "int4_int8_activations",
           "linear_formats",
           "select_linear_method",
           "GGUFLinearMethod", "Int4CheckpointLinearMethod", "Int4LinearMethod",
           "Int8LinearMethod"]

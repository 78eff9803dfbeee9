"""The kernel plan: which implementation runs each operation of a loaded model, decided once.

Built by the runner after loading (:func:`kernel_plan`), logged as one block at start-up
(:func:`format_kernel_plan`), returned by ``GET /v1/status`` (``kernel_plan``, per served model)
and hashed into the engine fingerprint (its ``kernels`` part: two engines whose products differ
never share cached prefixes or responses). Every entry is what the layers already hold:
each linear's packed format (chosen at load), the LM head's and the embedding's, the attention
backend's decode and prefill paths (chosen at construction), the native kernels that passed
their self-tests, and the row granule of each PyTorch GEMM that dense weights fell to.
``step`` (compiled or eager) is reported but not hashed: a background compile switches it
while serving, with identical logits.
"""
from __future__ import annotations

from typing import Any

from torch import nn

from llmserve.lora.layers import LoraLinear
from llmserve.model.layers.activation import GATED_ACTIVATIONS, native_silu_mul
from llmserve.model.layers.cpu_kernels import packed_kind, packed_row_granule
from llmserve.model.layers.embedding import LMHead, VocabEmbedding
from llmserve.model.layers.gemm_row_granule import dtype_kind
from llmserve.model.layers.linear import Linear
from llmserve.model.layers.native_dense import native_product_name
from llmserve.model.layers.norm import RMSNorm, rows_norm_name
from llmserve.model.native.ops import a8_library, cpu_tier, self_test_results
from llmserve.model.platform import cpu_flags
from llmserve.model.quant import linear_formats

#: CPU flags worth naming in the plan (the ones a kernel choice depends on)
_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "amx_bf16",
          "amx_int8")


def _lm_head(head: LMHead) -> str:
    if head.linear is not None:
        return f"linear:{getattr(head.linear, 'qformat', None) or 'dense'}"
    if head.native_head is not None:
        return f"tied:{native_product_name(head.native_head)}"
    if head.packed_id is not None:
        return "tied:onednn-prepacked"
    tied = head.tied
    if tied is not None and tied.qweight is not None:
        return f"tied:{tied.qweight.format_name}"
    return "tied:dense"


def _gemm_row_granules(model: nn.Module) -> dict[str, int]:
    """The PyTorch GEMMs this model's dense weights fell to (no native product took them),
    by kind, with the row granule their calls pad to (gemm_row_granule)."""
    found: dict[str, int] = {}
    for module in model.modules():
        pid = getattr(module, "packed_id", None)
        if pid is not None:
            found[packed_kind(pid)] = packed_row_granule(pid)
        # row_granule > 0: the layer multiplies by F.linear on the CPU
        if isinstance(module, Linear) and getattr(module, "row_granule", 0):
            found[dtype_kind(module.weight.dtype)] = module.row_granule
        if isinstance(module, LMHead) and module.row_granule:
            found[dtype_kind(module.tied.weight.dtype)] = module.row_granule
        if isinstance(module, LoraLinear) and not module.native and module.a.is_cpu:
            found[f"lora-{dtype_kind(module.a.dtype)}"] = module.granule
    return dict(sorted(found.items()))


def _activation(fn: object) -> str:
    """The name of an MLP's gated activation function in the plan."""
    if fn is native_silu_mul:
        return "native silu_mul"
    names = [name for name, f in GATED_ACTIVATIONS.items() if f is fn]
    return f"torch {names[0]}" if names else getattr(fn, "__name__", type(fn).__name__)


def kernel_plan(model: nn.Module, backend: Any, dtype: str, kv_dtype: str) -> dict[str, Any]:
    """The plan of a loaded ``model`` with attention ``backend`` (plain JSON values)."""
    embedding = "dense"
    head = "none"
    activations = sorted({_activation(m.act) for m in model.modules()
                          if hasattr(m, "gate_up_proj") and callable(getattr(m, "act", None))})
    for module in model.modules():
        if isinstance(module, VocabEmbedding):
            embedding = "dense" if module.qweight is None else \
                module.qweight.format_name.removesuffix("-a8")
        elif isinstance(module, LMHead):
            head = _lm_head(module)
    norms = sorted({rows_norm_name(m.rows_norm) for m in model.modules()
                    if isinstance(m, RMSNorm)})
    native_decode = bool(getattr(backend, "native_decode", False))
    kernel = getattr(backend, "decode_kernel", None) or "paged_decode"
    return {
        "cpu": {"tier": cpu_tier(), "flags": [f for f in _FLAGS if f in cpu_flags()],
                # which library's int4_a8_mm / int8_a8_mm the -a8 formats run
                "a8_library": a8_library()},
        "dtype": dtype,
        "kv_dtype": kv_dtype,
        "linear": dict(sorted(linear_formats(model).items())),
        "lm_head": head,
        "embedding": embedding,
        "mlp_activation": ", ".join(activations) or "none",
        "norm": ", ".join(norms) or "none",
        "attention": {
            "backend": getattr(backend, "name", type(backend).__name__),
            "decode": f"native {kernel}" if native_decode else "torch",
            "prefill": f"native {kernel}, one causal row per token" if native_decode
            else "gather + SDPA" if getattr(backend, "inductor_decode", True)
            else "gather + SDPA, one decode row per token",
        },
        "native_kernels": self_test_results(),
        # PyTorch GEMMs that dense weights fall to, and the row granule their calls pad to
        "gemm_row_granule": _gemm_row_granules(model),
    }


def format_kernel_plan(plan: dict[str, Any], step: str) -> str:
    """The plan as the start-up log's block (one operation per line)."""
    linear = ", ".join(f"{k} x{v}" for k, v in plan["linear"].items()) or "none"
    kernels = plan["native_kernels"]
    passed = ", ".join(k for k, ok in kernels.items() if ok) or "none"
    failed = ", ".join(k for k, ok in kernels.items() if not ok)
    lines = [
        f"kernel plan (CPU tier {plan['cpu']['tier']}; {plan['dtype']}, KV {plan['kv_dtype']})",
        f"  linear:     {linear}",
        f"  lm head:    {plan['lm_head']}; embedding: {plan['embedding']}",
        f"  mlp act:    {plan.get('mlp_activation', 'none')}; norm: {plan.get('norm', 'none')}",
        f"  attention:  {plan['attention']['backend']}: decode {plan['attention']['decode']}, "
        f"prefill {plan['attention']['prefill']}",
        f"  step:       {step}",
        f"  native:     {passed}" + (f" (failed self-test: {failed})" if failed else "")
        + (f"; int8-activation products from {plan['cpu']['a8_library']}"
           if plan["cpu"].get("a8_library") else ""),
    ]
    pages = plan["cpu"].get("huge_pages")
    if pages:
        lines.append(f"  memory:     2 MB pages: weights {pages['weights_bytes'] / 1e6:.0f} MB, "
                     f"KV pool {pages['kv_pool_bytes'] / 2**30:.2f} GiB advised "
                     f"(transparent huge pages: {pages['thp']})")
    granules = plan.get("gemm_row_granule") or {}
    if granules:
        lines.append("  torch gemm: " + ", ".join(
            f"{kind} rows padded to {g}" if g > 1 else f"{kind} rows not padded (row-count dependent)"
            for kind, g in granules.items()))
    return "\n".join(lines)

"""The gated activations of decoder MLPs, on a fused ``[gate | up]`` projection output.

:func:`gated_activation` picks a model's function once, when its MLPs are built: for SwiGLU
on bf16 CPU rows, llmserve's native ``silu_mul`` (``model/native/csrc/gated_activation.cpp``:
the same roundings as ``F.silu(gate) * up``, a faster exp) where the library is loaded and
its self-test passed; PyTorch's expression otherwise. Every path of the model (the compiled
decode and verify steps, eager prefill chunks of any row count) then calls that one
function, so which path computed a row never changes its bits.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

#: A gated activation: ``(T, 2 I)`` projection output -> ``(T, I)``
GatedActivation = Callable[[torch.Tensor], torch.Tensor]


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for a fused ``[gate | up]`` projection output."""
    gate, up = gate_up.chunk(2, -1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` (GeGLU, Gemma's ``gelu_pytorch_tanh``) for ``[gate | up]``."""
    gate, up = gate_up.chunk(2, -1)
    return F.gelu(gate, approximate="tanh") * up


def native_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """:func:`silu_and_mul` by llmserve's native kernel (bf16; any leading dimensions)."""
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    if gate_up.dim() == 2:
        return torch.ops.llmserve_native.silu_mul(gate_up)
    rows = torch.ops.llmserve_native.silu_mul(gate_up.reshape(-1, gate_up.shape[-1]))
    return rows.view(*gate_up.shape[:-1], rows.shape[-1])


#: HF ``hidden_act`` / ``hidden_activation`` names -> gated activation of a fused projection.
GATED_ACTIVATIONS: dict[str, GatedActivation] = {
    "silu": silu_and_mul,
    "swish": silu_and_mul,
    "gelu_pytorch_tanh": gelu_tanh_and_mul,
    "gelu_tanh": gelu_tanh_and_mul,
}


def _self_test() -> bool:
    """The native kernel against PyTorch's expression: random rows, a tail of odd width,
    and the values whose exp under- or overflows, infinities and NaN."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 2 * 300, generator=gen) * 6
    x[0, :8] = torch.tensor([90.0, -90.0, 104.0, -104.0, float("inf"), float("-inf"),
                             float("nan"), 0.0])
    x = x.bfloat16()
    want = silu_and_mul(x).float()
    got = native_silu_mul(x).float()
    same_nan = torch.equal(want.isnan(), got.isnan())
    close = torch.isclose(got, want, rtol=2 ** -7, atol=0.0, equal_nan=True)
    return bool(same_nan and close.all())


def native_silu_mul_available() -> bool:
    """The native library is loaded and its ``silu_mul`` passed the self-test (once per
    process; logged when it fails)."""
    from llmserve.model.native.ops import kernel_checked

    return kernel_checked("silu_mul", _self_test)


def gated_activation(name: str, dtype: Optional[torch.dtype] = None,
                     device: Optional[torch.device] = None) -> GatedActivation:
    """The gated activation called ``name`` for rows of ``dtype`` on ``device``: the native
    SwiGLU kernel for bf16 CPU rows where it is available, else PyTorch's expression.

    Raises:
        ValueError: an unsupported activation name (the message lists the supported ones).
    """
    if name not in GATED_ACTIVATIONS:
        raise ValueError(f"hidden activation {name!r} is not supported; supported: "
                         f"{sorted(GATED_ACTIVATIONS)}")
    fn = GATED_ACTIVATIONS[name]
    if (fn is silu_and_mul and dtype == torch.bfloat16
            and (device is None or torch.device(device).type == "cpu")
            and native_silu_mul_available()):
        return native_silu_mul
    return fn

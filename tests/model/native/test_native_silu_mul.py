"""llmserve_native::silu_mul (model/native/csrc/gated_activation.cpp) and its place in the
model: the SwiGLU activation of every path of a bf16 model on the CPU."""
from __future__ import annotations

import pytest
import torch

from llmserve.model.layers.activation import (
    gated_activation,
    native_silu_mul,
    native_silu_mul_available,
    silu_and_mul,
)
from llmserve.model.native import ops as native
from tests.model.native import needs_native


def _gate_up(rows: int, width: int, seed: int = 0, scale: float = 5.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 2 * width, generator=gen) * scale).bfloat16()


@needs_native
@pytest.mark.parametrize("rows,width", [(1, 576), (3, 17), (32, 1536), (70, 4864), (5, 300)])
def test_silu_mul_rounds_as_pytorchs_bf16_expression(rows, width):
    x = _gate_up(rows, width)
    got, want = native_silu_mul(x), silu_and_mul(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, width)
    # the same float32 steps and roundings; only exp's last bits may differ, which moves
    # a result by at most one bf16 rounding step
    assert torch.allclose(got.float(), want.float(), rtol=2 ** -7, atol=0.0)
    assert (got != want).float().mean().item() < 1e-3


@needs_native
def test_silu_mul_keeps_pytorchs_infinities_nans_and_zeros():
    special = torch.tensor([0.0, -0.0, 88.5, 89.5, -88.5, -89.5, 104.0, -104.0, 200.0, -200.0,
                            float("inf"), float("-inf"), float("nan"), 1e-30, -1e-30, 3.0])
    x = torch.cat([special, torch.full_like(special, 2.0)]).bfloat16().unsqueeze(0)
    up_inf = torch.cat([torch.full_like(special, 1.5),
                        torch.full_like(special, float("inf"))]).bfloat16().unsqueeze(0)
    for case in (x, up_inf):
        got, want = native_silu_mul(case).float(), silu_and_mul(case).float()
        assert torch.equal(got.isnan(), want.isnan()), (got, want)
        finite = ~want.isnan()
        assert torch.equal(got[finite], want[finite]), (got, want)


@needs_native
def test_a_row_gets_the_same_bits_alone_and_in_any_batch():
    """Each element is computed on its own: the row count, the threads' split (a large
    batch runs in parallel, a small one on one thread) and the row's place never matter."""
    batch = _gate_up(2048, 1536, seed=3)
    whole = native_silu_mul(batch)
    for row in (0, 1, 31, 1000, 2047):
        assert torch.equal(native_silu_mul(batch[row:row + 1]), whole[row:row + 1])
    assert torch.equal(native_silu_mul(batch[5:69]), whole[5:69])


@needs_native
def test_silu_mul_reads_rows_with_a_padded_stride_and_leading_dimensions():
    padded = _gate_up(9, 1536 + 8)[:, :3072]      # a product's padded columns cut off
    assert torch.equal(native_silu_mul(padded), native_silu_mul(padded.contiguous()))
    three_d = _gate_up(12, 64).view(3, 4, 128)
    assert torch.equal(native_silu_mul(three_d).view(12, 64),
                       native_silu_mul(three_d.reshape(12, 128)))


@needs_native
def test_silu_mul_rejects_what_it_cannot_read():
    with pytest.raises(RuntimeError, match="even"):
        torch.ops.llmserve_native.silu_mul(torch.zeros(2, 7, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bf16"):
        torch.ops.llmserve_native.silu_mul(torch.zeros(2, 8))


@needs_native
def test_silu_mul_in_a_compiled_graph_equals_the_eager_call():
    def mlp_tail(gate_up: torch.Tensor) -> torch.Tensor:
        return native_silu_mul(gate_up * 2) + 1

    compiled = torch.compile(mlp_tail, dynamic=True, fullgraph=True)
    for rows in (2, 7, 65):
        x = _gate_up(rows, 256, seed=rows)
        assert torch.equal(compiled(x), mlp_tail(x))


@needs_native
def test_gated_activation_picks_the_native_kernel_for_bf16_cpu_rows_only():
    assert native_silu_mul_available()
    assert gated_activation("silu", torch.bfloat16, torch.device("cpu")) is native_silu_mul
    assert gated_activation("swish", torch.bfloat16) is native_silu_mul
    assert gated_activation("silu", torch.float32) is silu_and_mul
    assert gated_activation("gelu_pytorch_tanh", torch.bfloat16).__name__ == "gelu_tanh_and_mul"
    assert native.self_test_results()["silu_mul"] is True


def test_gated_activation_names_the_supported_ones():
    with pytest.raises(ValueError, match="relu2.*supported"):
        gated_activation("relu2", torch.bfloat16)

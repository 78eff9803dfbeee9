"""int8 weights x int8 activations (``llmserve_native::int8_a8_mm``, the tied int8 LM head
with ``--int4-activations int8``): the kernel against its float64 reference, rows independent
of their batch, NaN and tiny blocks, operand checks, the quad layout and its read-back,
``Int8Weight(int8_activations=True)`` and its fallback, one compiled graph. (An engine's tied
head following ``--int4-activations``: test_native_int4_a8.py's engine test.)"""
from __future__ import annotations

import pytest
import torch

from llmserve.model.quant.kernels import Int8Weight, quantize_int8
from llmserve.model.quant.native_int8 import (
    int8_a8_mm,
    int8_a8_reference,
    native_int8_a8_available,
    native_int8_available,
    pack_int8,
    pack_int8_a8,
    packed_rows,
    quantized_rows_reference,
)
from tests.model.native.test_native_kernels import assert_one_compiled_graph_for_every_batch

needs_a8 = pytest.mark.skipif(not native_int8_a8_available(),
                              reason="the int8 x int8 kernel needs AVX512-VNNI and a compiler")


def operands(n: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    q[0, :2] = torch.tensor([-128, 127], dtype=torch.int8)     # both ends of the +128 offset
    scale = (torch.rand(n, generator=gen) * 0.01 + 1e-3).bfloat16()
    return q, scale


def a8_layer(n: int, k: int, seed: int):
    """Codes, scales and their ``Int8Weight`` with int8 activations; the global torch seed
    (the tests' activations) set to ``seed`` too."""
    torch.manual_seed(seed)
    q, scale = operands(n, k, seed=seed)
    return q, scale, Int8Weight(q, scale, int8_activations=True)


def padded_scale(scale: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.cat([scale, scale.new_zeros(packed.shape[0] * 16 - scale.shape[0])])


def within_rounding(y, x, q, scale, bf16_out: bool) -> bool:
    """``y`` is the float64 reference up to float32 sums (one FMA per block of 32, slack
    scaling with the terms' magnitudes) and, for bf16 output, its rounding."""
    ref = int8_a8_reference(x, q, scale)
    terms = quantized_rows_reference(x).abs() @ (q.double().abs() * scale.double()[:, None]).T
    blocks = x.shape[1] // 32
    slack = ref.abs() * (2.0 ** -8 if bf16_out else 2.0 ** -23) + (blocks + 1) * 2.0 ** -23 * terms
    return bool(((y.double() - ref).abs() <= slack).all())


@needs_a8
@pytest.mark.parametrize("n", [40, 49, 256])
@pytest.mark.parametrize("k", [32, 96, 576])
def test_int8_a8_mm_equals_its_float64_reference(n, k):
    torch.manual_seed(n + k)
    q, scale = operands(n, k, seed=n * k)
    packed = pack_int8_a8(q)
    sc = padded_scale(scale, packed)
    w = q.double() * scale.double()[:, None]
    for rows in (1, 2, 3, 4, 5, 8, 9, 17, 33):
        x = torch.randn(rows, k).bfloat16()
        x[0, :32] = 0                              # an all-zero block: codes 0, no NaN
        for float_out in (True, False):
            y = int8_a8_mm(x, packed, sc, float_out, n)
            assert y.shape == (rows, n), rows
            assert y.dtype == (torch.float32 if float_out else torch.bfloat16)
            assert within_rounding(y, x, q, scale, not float_out), (rows, float_out)
            exact = x.double() @ w.T               # int8 activations: ~0.5% of its scale
            assert (y.double() - exact).abs().max() <= 0.02 * exact.abs().max(), rows
        full = int8_a8_mm(x, packed, sc, True)     # padded channels: zero scale, zero output
        assert full.shape == (rows, packed.shape[0] * 16) and not full[:, n:].any()


@needs_a8
def test_a_row_gives_the_same_bits_alone_as_in_any_batch():
    q, scale, layer = a8_layer(96, 256, seed=1)
    x = torch.randn(37, 256).bfloat16()
    x[5] *= 1000                                   # an outlier row quantizes on its own scale
    batch, logits = layer(x), layer.logits(x)
    for i in (0, 5, 8, 36):
        assert torch.equal(layer(x[i:i + 1]), batch[i:i + 1]), i
        assert torch.equal(layer.logits(x[i:i + 1]), logits[i:i + 1]), i
    assert torch.equal(layer.logits(x[3:12]), logits[3:12])


@needs_a8
def test_a_nan_or_inf_activation_gives_nan_outputs_and_tiny_blocks_contribute_zero():
    q, scale, layer = a8_layer(32, 96, seed=2)
    x = torch.randn(5, 96).bfloat16()
    x[1, 40] = float("nan")
    x[2] = 1e-35                                   # max|x| below the kernel's tiny threshold
    x[3, 32:64] = 1e-35
    x[4, 5] = float("-inf")                        # no int8 code stands for it either
    y = layer.logits(x)
    assert bool(torch.isnan(y[1]).all()) and bool(torch.isnan(y[4]).all())
    assert bool(torch.isnan(int8_a8_reference(x[4:5], q, scale)).all())
    assert bool(torch.isfinite(y[[0, 2, 3]]).all())
    assert torch.equal(y[0:1], layer.logits(x[0:1]))          # the NaN stays in its row
    assert bool((y[2] == 0).all())
    zeroed = x[3:4].clone()
    zeroed[0, 32:64] = 0
    assert torch.equal(y[3:4], layer.logits(zeroed))


@needs_a8
def test_int8_a8_mm_rejects_bad_operands():
    q, scale = operands(32, 64, seed=3)
    packed = pack_int8_a8(q)
    x = torch.randn(2, 64).bfloat16()
    with pytest.raises(RuntimeError, match="packed weight is for K=64, x has K=128"):
        int8_a8_mm(torch.randn(2, 128).bfloat16(), packed, scale)
    for k in (48, 0):
        with pytest.raises(RuntimeError, match=r"K must be a positive multiple of 32"):
            int8_a8_mm(torch.randn(2, k).bfloat16(), torch.zeros(2, k * 16, dtype=torch.uint8),
                       scale)
    with pytest.raises(RuntimeError, match="one value per \\(padded\\) channel"):
        int8_a8_mm(x, packed, scale[:24])
    with pytest.raises(RuntimeError, match="x must be a contiguous 2-D bf16"):
        int8_a8_mm(x.float(), packed, scale)
    with pytest.raises(RuntimeError, match="packed must be a contiguous 2-D uint8"):
        int8_a8_mm(x, pack_int8(q), scale)         # the pair layout is not the quad layout
    with pytest.raises(RuntimeError, match="scale must be contiguous bf16"):
        int8_a8_mm(x, packed, scale.float())


def test_quad_layout_matches_the_documented_bytes_and_reads_back():
    q, _ = operands(20, 64, seed=4)
    packed = pack_int8_a8(q)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 64 * 16)
    for s in range(2):
        for o in range(16):
            for c in range(16):
                for j in range(4):
                    byte = int(packed[s, o * 64 + 4 * c + j])
                    code = int(q[16 * s + c, 4 * o + j]) if 16 * s + c < 20 else 0
                    assert byte == code + 128, (s, o, c, j)
    with pytest.raises(ValueError, match="K % 32 == 0"):
        pack_int8_a8(q[:, :48])
    ids = torch.tensor([0, 15, 16, 19, 3])
    quad, pair = packed_rows(packed, ids), packed_rows(pack_int8(q), ids)
    assert quad.dtype == torch.int8 and torch.equal(quad, q[ids])
    assert pair.dtype == torch.int8 and torch.equal(pair, q[ids])


@needs_a8
def test_int8_weight_with_int8_activations_and_its_fallback():
    torch.manual_seed(6)
    q, scale = quantize_int8(torch.randn(40, 96))
    layer = Int8Weight(q, scale, int8_activations=True)
    assert layer.int8_activations and "int8 activations" in layer.extra_repr()
    assert layer.qweight.dtype == torch.uint8
    x = torch.randn(2, 3, 96).bfloat16()
    y, logits = layer(x), layer.logits(x)
    assert y.shape == logits.shape == (2, 3, 40)
    assert y.dtype == torch.bfloat16 and logits.dtype == torch.float32
    assert within_rounding(y.view(6, 40), x.view(6, 96), q, scale, True)
    assert within_rounding(logits.view(6, 40), x.view(6, 96), q, scale, False)
    # K = 34: no blocks of 32, so the weight keeps bf16 activations
    q34, s34 = quantize_int8(torch.randn(24, 34))
    odd = Int8Weight(q34, s34, int8_activations=True)
    assert not odd.int8_activations and "int8 activations" not in odd.extra_repr()
    x34 = torch.randn(5, 34).bfloat16()
    exact = x34.double() @ (q34.double() * s34.double()[:, None]).T
    # the native bf16-activation kernel sums in float32; PyTorch's (the avx2 tier's
    # fallback: K padded to 16 with zeros, it crashed on K = 34) rounds its output to bf16
    tol = 1e-4 if odd.native else 2 ** -8
    assert (odd.logits(x34).double() - exact).abs().max() <= tol * exact.abs().max()
    assert odd.native or odd.k_pad == 14
    assert torch.equal(odd.rows(torch.tensor([[3, 0]]), torch.float32)[0, 0],
                       q34[3].float() * s34[3].bfloat16().float())
    assert odd.with_int8_activations() is odd
    # a bf16-activation table (the pair layout, or PyTorch's row-major one on the avx2
    # tier) repacked: same embedding rows, a8 logits
    base = Int8Weight(q, scale)
    assert base.native == native_int8_available()
    assert not base.int8_activations and base.qweight.dtype == torch.int8
    a8 = base.with_int8_activations()
    assert a8 is not base and a8.int8_activations and a8.with_int8_activations() is a8
    ids = torch.tensor([[0, 39], [17, 5]])
    for dtype in (torch.bfloat16, torch.float32):
        assert torch.equal(a8.rows(ids, dtype), base.rows(ids, dtype))
    assert torch.equal(a8.rows(ids, torch.float32)[0, 1],
                       q[39].float() * scale[39].float())
    x2 = torch.randn(9, 96).bfloat16()
    assert within_rounding(a8.logits(x2), x2, q, scale, False)
    assert torch.equal(a8.logits(x2), layer.logits(x2))


@needs_a8
def test_int8_a8_weight_in_one_compiled_graph_for_every_batch():
    q, scale, layer = a8_layer(96, 128, seed=7)
    assert layer.int8_activations
    assert_one_compiled_graph_for_every_batch(layer, 128)
    assert_one_compiled_graph_for_every_batch(layer.logits, 128)

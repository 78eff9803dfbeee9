"""Quantized linear methods against dense arithmetic.

GGUF: every supported type's packed product equals ``gguf.quants.dequantize`` followed by a
dense float32 product (activations rounded to bf16 as the kernels take them), within:

    4-bit types (Q4_0, Q4_1, Q4_K), kept exactly as int4   relative error <= 0.5% (seen 0.25%)
    other types requantized to int8 per channel            relative error <= 1.5% (seen 0.8%)

(relative error = ||y - y_ref|| / ||y_ref||; what remains is the bf16 rounding of scales,
zeros and the output, plus for the int8 path one rounding to a per-row step of
max|w_row| / 127.)
RTN at load: int8 per channel and int4 (groups 32/64/128) keep every weight within half a
step of the float weight.
"""
from __future__ import annotations

import gguf
import pytest
import torch

from llmserve.model.layers.linear import Linear
from llmserve.model.quant import describe_quantization
from llmserve.model.quant.kernels import Int4Weight, quantize_int4, quantize_int8
from llmserve.model.quant.methods import GGUFLinearMethod, Int4LinearMethod, Int8LinearMethod
from tests.model.quant_helpers import Q, gguf_blocks

EXACT = [Q.Q4_0, Q.Q4_1, Q.Q4_K]
REQUANT = [Q.Q8_0, Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q6_K, Q.Q2_K, Q.Q3_K]
ROWS, COLS = 96, 512


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).norm() / ref.norm())


def reference(raw, x: torch.Tensor) -> torch.Tensor:
    w = torch.from_numpy(gguf.quants.dequantize(raw.data, raw.qtype).reshape(raw.shape).copy())
    return x.to(torch.bfloat16).float() @ w.float().T


def linear(method, outputs, cols=COLS, bias=False, dtype=torch.bfloat16) -> Linear:
    return Linear(cols, outputs, bias=bias, method=method, dtype=dtype,
                  device=torch.device("cpu"))


@pytest.mark.parametrize("qtype", EXACT + REQUANT, ids=lambda q: q.name)
def test_gguf_type_matches_dequantize_then_dense(qtype):
    raw = gguf_blocks(qtype, ROWS, COLS)
    layer = linear(GGUFLinearMethod(), ROWS)
    layer.load("weight", raw)
    layer.finish_loading()
    assert layer.qformat == ("int4-g32" if qtype in EXACT else "int8")
    x = torch.randn(5, COLS)
    err = rel_err(layer(x.to(torch.bfloat16)), reference(raw, x))
    assert err <= (0.005 if qtype in EXACT else 0.015), f"{qtype.name}: {err:.4f}"


def test_exact_int4_weights_equal_dequantize_up_to_bf16():
    """Read the packed weight back through an identity product: w within bf16 rounding."""
    for qtype in EXACT:
        raw = gguf_blocks(qtype, 64, 256, seed=3)
        layer = linear(GGUFLinearMethod(), 64, cols=256)
        layer.load("weight", raw)
        got = layer(torch.eye(256, dtype=torch.bfloat16)).float().T
        want = torch.from_numpy(gguf.quants.dequantize(raw.data, qtype).reshape(64, 256).copy())
        step = want.abs().amax()
        assert (got - want).abs().max() <= 2e-2 * step, qtype.name


def test_fused_layer_mixes_types_and_shards_land_in_order():
    q = gguf_blocks(Q.Q4_K, 64, 256, seed=1)
    k = gguf_blocks(Q.Q4_K, 32, 256, seed=2)
    v = gguf_blocks(Q.Q6_K, 32, 256, seed=4)
    layer = linear(GGUFLinearMethod(), [64, 32, 32], cols=256)
    for i, t in enumerate((q, k, v)):
        layer.load("weight", t, shard=i)
    assert layer.qformat == "int8"    # Q6_K cannot be int4: the fused layer goes int8
    x = torch.randn(3, 256)
    ref = torch.cat([reference(t, x) for t in (q, k, v)], -1)
    assert rel_err(layer(x.to(torch.bfloat16)), ref) <= 0.015

    same = linear(GGUFLinearMethod(), [64, 32], cols=256)
    same.load("weight", k, shard=1)     # shards in any order
    assert same.qformat is None
    same.load("weight", q, shard=0)
    assert same.qformat == "int4-g32"
    ref = torch.cat([reference(t, x) for t in (q, k)], -1)
    assert rel_err(same(x.to(torch.bfloat16)), ref) <= 0.005


def test_float_shards_stay_dense_and_bias_is_added():
    w = torch.randn(48, 64)
    layer = linear(GGUFLinearMethod(), 48, cols=64, bias=True, dtype=torch.float32)
    layer.load("weight", w)
    layer.load("bias", torch.ones(48))
    assert layer.qformat == "dense"
    x = torch.randn(2, 64)
    torch.testing.assert_close(layer(x), x @ w.T + 1)


def test_missing_shard_is_an_error():
    layer = linear(GGUFLinearMethod(), [64, 32], cols=256)
    layer.load("weight", gguf_blocks(Q.Q4_0, 64, 256), shard=0)
    with pytest.raises(ValueError, match="never received shards"):
        layer.finish_loading()
    with pytest.raises(ValueError, match="does not fit"):
        layer.load("weight", gguf_blocks(Q.Q4_0, 16, 256), shard=1)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_rtn_error_within_half_a_step(group):
    w = torch.randn(80, 256) * 0.1
    g = quantize_int4(w, group)
    step = g.scale.repeat_interleave(group, 1)
    assert ((g.dequantize() - w).abs() <= step / 2 + 1e-6 + 2 ** -8 * w.abs()).all()
    layer = linear(Int4LinearMethod(group), 80, cols=256, dtype=torch.float32)
    layer.load("weight", w)
    assert layer.qformat == f"int4-g{group}"
    x = torch.randn(4, 256)
    ref = x.to(torch.bfloat16).float() @ w.T
    assert rel_err(layer(x), ref) <= 0.12       # 4-bit RTN of Gaussian weights: ~8%
    assert layer(x).dtype == torch.float32      # fp32 model: bf16 only inside the op


def test_int8_rtn_error_within_half_a_step():
    w = torch.randn(80, 256) * 0.1
    q, scale = quantize_int8(w)
    assert ((q.float() * scale.float()[:, None] - w).abs() <= scale.float()[:, None] / 2 + 1e-6).all()
    layer = linear(Int8LinearMethod(), [40, 40], cols=256)
    layer.load("weight", w[:40], shard=0)
    layer.load("weight", w[40:], shard=1)
    x = torch.randn(4, 256)
    assert rel_err(layer(x.to(torch.bfloat16)), x.to(torch.bfloat16).float() @ w.T) <= 0.01


@pytest.mark.parametrize("rows", [1, 4, 5, 16, 33])
@pytest.mark.parametrize("outputs", [480, 17000])
def test_int8_both_kernels_match_dense(rows, outputs):
    """Few rows: _weight_int8pack_mm; more (sooner for wide weights): bf16 tiles + GEMM."""
    w = torch.randn(outputs, 96) * 0.1
    layer = linear(Int8LinearMethod(), outputs, cols=96)
    layer.load("weight", w)
    x = torch.randn(rows, 96)
    assert rel_err(layer(x.to(torch.bfloat16)), x.to(torch.bfloat16).float() @ w.T) <= 0.015


def test_int8_one_row_compiled_is_a_fused_reduction_matching_the_pack_kernel():
    """One row inside a compiled graph takes the fused int8 reduction (the LM head of a
    batch-1 decode): the same product as _weight_int8pack_mm, to bf16 rounding."""
    w = torch.randn(2000, 96) * 0.1
    layer = linear(Int8LinearMethod(), 2000, cols=96)
    layer.load("weight", w)
    x = torch.randn(1, 96).to(torch.bfloat16)
    eager = layer(x)
    compiled = torch.compile(lambda t: layer(t), fullgraph=True)(x)
    assert rel_err(compiled, eager.float()) <= 0.01
    assert rel_err(compiled, x.float() @ w.T) <= 0.015


def test_pytorch_int8_and_int4_products_give_a_row_the_same_bits_at_every_row_count():
    """Without the native kernels (the none tier) an int8 or int4 product runs PyTorch's
    kernel at every row count, eager and compiled: a row's result is the same alone as
    among 2..100 rows and inside a compiled graph with a dynamic batch (a bf16-tile GEMM
    for many rows and a fused reduction for one compiled row each summed in another order)."""
    from torch._dynamo.utils import counters

    gen = torch.Generator().manual_seed(5)
    w = torch.randn(17000, 96, generator=gen) * 0.1
    int8 = linear(Int8LinearMethod(), 17000, cols=96)
    int8.load("weight", w)
    int4 = Int4Weight(quantize_int4(torch.randn(960, 256, generator=gen), 32), native=False)
    for layer, k in ((int8, 96), (int4, 256)):
        if isinstance(layer, Int4Weight):
            assert not layer.native
        x = torch.randn(100, k, generator=gen).to(torch.bfloat16)
        alone = torch.cat([layer(x[i:i + 1]) for i in range(len(x))])
        for rows in (2, 5, 33, 100):
            assert torch.equal(layer(x[:rows]), alone[:rows])
        torch._dynamo.reset()
        counters.clear()
        one = torch.compile(lambda t, _l=layer: _l(t) * 2, fullgraph=True, dynamic=False)
        many = torch.compile(lambda t, _l=layer: _l(t) * 2, fullgraph=True, dynamic=True)
        assert torch.equal(one(x[:1]), alone[:1] * 2)
        for rows in (2, 4, 5, 33):
            assert torch.equal(many(x[:rows]), alone[:rows] * 2)
        assert counters["stats"]["unique_graphs"] == 2


def test_int4_pads_output_rows_to_the_kernel_tile():
    w = torch.randn(24, 64)                   # 24 rows: not a multiple of 16
    g = quantize_int4(w, 32)
    packed = Int4Weight(g)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    y = packed(x)
    assert y.shape == (3, 24)
    ref = x.float() @ g.dequantize().T
    assert rel_err(y, ref) <= 0.01


def test_describe_counts_formats():
    model = torch.nn.Sequential(linear(GGUFLinearMethod(), 96))
    model[0].load("weight", gguf_blocks(Q.Q4_1, 96, COLS))
    assert describe_quantization(model) == "linear:int4-g32x1;embedding:none"

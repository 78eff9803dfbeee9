"""int4 weights x int8 activations (``llmserve_native::int4_a8_mm``, ``--int4-activations``):
the kernel against its float64 reference, rows independent of their batch, packing limits,
one compiled graph, the method choice and the fingerprint."""
from __future__ import annotations

import pytest
import torch

from llmserve import LLM
from llmserve.config import EngineConfig
from llmserve.model.config import ModelConfig
from llmserve.model.quant import int4_int8_activations, select_linear_method
from llmserve.model.quant import native_int4 as n4
from llmserve.model.quant.kernels import Int4Groups, Int4Weight, quantize_int4
from llmserve.model.quant.native_int4 import int4_a8_mm, int4_a8_reference, native_int4_a8_available, pack_int4_a8
from tests.model.native.test_native_kernels import (
    INT4_SHAPES,
    assert_one_compiled_graph_for_every_batch,
    assert_rejects_a_weight_for_k64,
)
from tests.model.tiny_checkpoints import make_tiny_checkpoint, make_tiny_gguf

needs_a8 = pytest.mark.skipif(not native_int4_a8_available(),
                              reason="the int4 x int8 kernel needs AVX512-VNNI and a compiler")


def within_rounding(y: torch.Tensor, ref: torch.Tensor, x: torch.Tensor,
                    w: torch.Tensor) -> bool:
    """``y`` is ``ref`` up to the bf16 output rounding and float32 sums (the slack scales
    with the sum of the terms' magnitudes)."""
    terms = x.abs().double() @ w.abs().double().T
    return bool(((y.double() - ref).abs() <= ref.abs() * 2.0 ** -8 + 1e-5 * terms + 1e-6).all())


@needs_a8
@pytest.mark.parametrize("n,k,g", INT4_SHAPES)
def test_int4_a8_mm_equals_its_float64_reference(n, k, g):
    torch.manual_seed(n + k)
    groups = quantize_int4(torch.randn(n, k), g)
    layer = Int4Weight(groups, int8_activations=True)
    assert layer.int8_activations and "int8 activations" in layer.extra_repr()
    w = groups.dequantize()
    for rows in (1, 2, 3, 4, 5, 8, 9, 17, 33, 64, 130):
        x = torch.randn(rows, k).bfloat16()
        x[0, :32] = 0                             # an all-zero block: scale 0, codes 0
        y = layer(x)
        assert y.shape == (rows, n) and y.dtype == torch.bfloat16
        ref = int4_a8_reference(x, groups.q, groups.scale, groups.zero, g)
        assert within_rounding(y, ref, x, w), rows
        # and int8 activations stay close to the exact product (~1% of its scale)
        exact = x.double() @ w.double().T
        assert (y.double() - exact).abs().max() <= 0.02 * exact.abs().max(), rows


@needs_a8
@pytest.mark.parametrize("n", [96, 80])
def test_a_row_gives_the_same_bits_alone_as_in_any_batch(n):
    """One row runs the one-strip kernel, more rows the strip-pair kernel in tiles of 6
    (80 channels: 5 strips, the odd last one alone): the same bits either way."""
    torch.manual_seed(0)
    layer = Int4Weight(quantize_int4(torch.randn(n, 256), 32), int8_activations=True)
    x = torch.randn(37, 256).bfloat16()
    x[5] *= 1000                                  # an outlier row quantizes on its own scale
    batch = layer(x)
    for i in (0, 5, 8, 36):
        assert torch.equal(layer(x[i:i + 1]), batch[i:i + 1]), i
    for rows in range(2, 14):      # every tile size of a strip pair (up to 6 rows)
        assert torch.equal(layer(x[3:3 + rows]), batch[3:3 + rows]), rows


@needs_a8
def test_the_one_strip_and_strip_pair_kernels_give_the_same_bits_on_a_wide_layer():
    """A row alone (the one-strip kernel) against the same row in a batch of 64 (strip
    pairs, tiles of 6 and a tail of 4) on an MLP-sized layer (3088 x 1536: 193 strips, the
    last alone): 200k outputs, so even a one-ulp float32 difference in the per-block sums
    (a different order of the two FMAs, say) shows after the bf16 rounding."""
    torch.manual_seed(1)
    layer = Int4Weight(quantize_int4(torch.randn(3088, 1536), 32), int8_activations=True)
    x = torch.randn(64, 1536).bfloat16()
    batch = layer(x)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(64)])
    assert torch.equal(alone, batch), int((alone != batch).sum())


@needs_a8
def test_a_nan_or_inf_activation_gives_nan_outputs_and_tiny_blocks_give_zeros():
    groups = quantize_int4(torch.randn(32, 64), 32)
    layer = Int4Weight(groups, int8_activations=True)
    x = torch.randn(4, 64).bfloat16()
    x[1, 40] = float("nan")
    x[2] = 1e-35                                  # max|x| below the kernel's tiny threshold
    x[3, 3] = float("inf")                        # no int8 code stands for it either
    y = layer(x)
    assert bool(torch.isnan(y[1]).all()) and bool(torch.isfinite(y[0]).all())
    assert bool(torch.isnan(y[3]).all())
    assert bool((y[2] == 0).all())


@needs_a8
def test_int4_a8_mm_rejects_mismatched_operands():
    groups = quantize_int4(torch.randn(32, 64), 32)
    packed, sm = pack_int4_a8(groups.q, groups.scale, groups.zero, 32)
    assert_rejects_a_weight_for_k64(int4_a8_mm, (packed, sm))
    with pytest.raises(RuntimeError, match="fp16"):
        int4_a8_mm(torch.randn(2, 64).bfloat16(), packed, sm.float(), 32)
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_int4_a8(groups.q[:, :48], groups.scale[:, :3], groups.zero[:, :3], 16)


def test_scales_outside_fp16_keep_bf16_activations(caplog):
    q = torch.randint(0, 16, (16, 64), dtype=torch.uint8)
    zero = torch.zeros(16, 2)
    assert pack_int4_a8(q, torch.full((16, 2), 1e6), zero, 32) is None     # overflows fp16
    assert pack_int4_a8(q, torch.full((16, 2), 1e-6), zero, 32) is None    # subnormal in fp16
    assert pack_int4_a8(q, torch.full((16, 2), 1e-9), zero, 32) is None    # 0 in fp16
    assert pack_int4_a8(q, torch.full((16, 2), 1e-3), zero, 32) is not None
    if native_int4_a8_available():
        groups = Int4Groups(q, torch.full((16, 2), 1e-6), zero, 32)
        layer = Int4Weight(groups, int8_activations=True)
        assert not layer.int8_activations
        assert "keeps bf16 activations" in caplog.text


@needs_a8
def test_int4_a8_layer_in_one_compiled_graph_for_every_batch():
    layer = Int4Weight(quantize_int4(torch.randn(96, 128), 32), int8_activations=True)
    assert_one_compiled_graph_for_every_batch(layer, 128)


def test_activation_choice(monkeypatch):
    cpu = torch.device("cpu")
    assert int4_int8_activations("bf16", cpu) is False
    assert int4_int8_activations("auto", torch.device("cuda")) is False
    with pytest.raises(ValueError, match="int4_activations must be one of"):
        int4_int8_activations("fp8", cpu)
    with pytest.raises(ValueError, match="int4_activations"):
        EngineConfig.from_kwargs(int4_activations="int4")
    monkeypatch.setattr("llmserve.model.quant.native_int4_a8_available", lambda: True)
    monkeypatch.setattr("llmserve.model.quant.native_int4_available", lambda: True)
    monkeypatch.setattr("llmserve.model.quant.kernels_available", lambda device: True)
    cfg = ModelConfig("LlamaForCausalLM", 256, 64, 128, 2, 4, 2, 16, 512, source_format="gguf",
                      quantization="gguf:Q4_1")
    picks = {choice: select_linear_method("auto", 32, cfg, torch.bfloat16, cpu, choice)
             for choice in ("auto", "int8", "bf16")}
    # auto: int8 activations except a q/k/v projection of int4 groups; int8: every product
    assert [(m.int8_activations, m.bf16_attention_input) for m in picks.values()] == [
        (True, True), (True, False), (False, False)]
    monkeypatch.setattr("llmserve.model.quant.native_int4_available", lambda: False)
    assert not select_linear_method("auto", 32, cfg, torch.bfloat16, cpu).bf16_attention_input
    monkeypatch.setattr("llmserve.model.quant.native_int4_a8_available", lambda: False)
    assert int4_int8_activations("auto", cpu) is False
    with pytest.raises(ValueError, match="AVX512-VNNI"):
        int4_int8_activations("int8", cpu)


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory):
    hf = make_tiny_checkpoint(str(tmp_path_factory.mktemp("a8hf")), num_heads=4,
                              num_kv_heads=2, hidden=64, seed=5, tie=True)
    return make_tiny_gguf(hf, str(tmp_path_factory.mktemp("a8gguf") / "t.Q4_1.gguf"),
                          quant="Q4_1", embedding_quant="Q8_0", with_tokenizer=True)


@needs_a8
def test_engines_with_either_activation_differ_in_fingerprint_not_in_greedy_tokens(tiny_q4):
    """The int4 products and the tied int8 LM head both follow --int4-activations."""
    from llmserve import SamplingParams
    from llmserve.model.quant.native_int8 import native_int8_a8_available
    prompt = [[5, 17, 300, 42, 9, 1000, 77, 8]]
    outs, prints = {}, {}
    for act in ("int8", "bf16"):
        llm = LLM(tiny_q4, num_kv_blocks=32, dtype="bfloat16", int4_activations=act)
        name = llm.engine.runner.quantization
        assert ("-a8x" in name) == (act == "int8")
        head = "int8-a8" if act == "int8" and native_int8_a8_available() else "int8"
        assert name.endswith(f"embedding:{head}"), name
        prints[act] = llm.engine.fingerprint
        outs[act] = llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0,
                                                        ignore_eos=True))[0].outputs[0]
    assert prints["int8"] != prints["bf16"]       # prefix caches never mix the two
    agree = sum(a == b for a, b in zip(outs["int8"].token_ids, outs["bf16"].token_ids))
    assert outs["int8"].token_ids[0] == outs["bf16"].token_ids[0] and agree >= 3


def test_packing_layout_matches_the_documented_bytes():
    q = torch.arange(16 * 64, dtype=torch.int64).remainder(16).view(16, 64).to(torch.uint8)
    q = (q + torch.arange(16).view(16, 1)).remainder(16).to(torch.uint8)
    packed, sm = pack_int4_a8(q, torch.ones(16, 2), torch.full((16, 2), 8.0), 32)
    assert packed.shape == (1, 64 // 8 * 64) and sm.shape == (1, 2, 2, 16)
    assert sm.dtype == torch.float16 and bool((sm[0, :, 1] == 0).all())   # min = zero - 8
    for o, c, j in [(0, 0, 0), (3, 5, 2), (7, 15, 3)]:
        byte = int(packed[0, o * 64 + 4 * c + j])
        assert byte & 15 == int(q[c, 8 * o + j]) and byte >> 4 == int(q[c, 8 * o + 4 + j])
    assert n4.A8_BLOCK == 32

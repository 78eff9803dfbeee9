"""GGUF K-quant, 5-bit and 8-bit blocks on the int8-activation kernel
(``llmserve_native::qblock_a8_mm``):
decoding is exact against gguf's dequantizer, the kernel matches its float64 reference at
strip and row-tile boundaries, rows never depend on their batch, NaN rows stay in their row,
resident bytes stay at the file's size, operand errors are clear, the GGUF method keeps the
types (and splits a mixed fused layer) and counts the types it requantizes for the load log,
one compiled graph serves every batch, a block table's rows are gguf's values, and an engine
on a Q5_0 file generates the float32 dequantized run's greedy tokens."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from llmserve.model.layers.embedding import VocabEmbedding
from llmserve.model.layers.linear import ATTENTION_INPUT, Linear
from llmserve.model.quant.block_codes import BlockCodes, to_block_codes
from llmserve.model.quant.kernels import Int8Weight
from llmserve.model.quant.methods import GGUFLinearMethod
from llmserve.model.quant.native_int4 import native_int4_a8_available, native_int4_available
from llmserve.model.quant.native_int8 import quantized_rows_reference
from llmserve.model.quant.native_qblock import (
    QBlockTable,
    QBlockWeight,
    native_qblock_available,
    pack_qblock,
    qblock_a8_mm,
    qblock_reference,
)
from tests.model.native.test_native_kernels import assert_one_compiled_graph_for_every_batch
from tests.model.quant_helpers import gguf_blocks

needs_qblock = pytest.mark.skipif(not native_qblock_available(),
                                  reason="the block kernel needs AVX512-VNNI and a compiler")
TYPES = [Q.Q8_0, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]
#: file bits per weight (issue 29: the packed form within 5%; it is within 3%)
FILE_BITS = {Q.Q8_0: 8.5, Q.Q5_0: 5.5, Q.Q5_1: 6.0, Q.Q4_K: 4.5, Q.Q5_K: 5.5, Q.Q6_K: 6.5625}


def codes_of(raw):
    """Block codes of any type the block kernel takes (Q4_K included)."""
    return to_block_codes(raw, q4_k=True)


@pytest.mark.parametrize("qtype", TYPES)
def test_decoded_blocks_are_ggufs_values_exactly(qtype):
    raw = gguf_blocks(qtype, 24, 512, seed=2)
    codes = codes_of(raw)
    ref = gguf.quants.dequantize(raw.data, qtype).reshape(24, 512)
    assert torch.equal(codes.dequantize(), torch.from_numpy(ref))
    assert int(codes.codes.max()) < (1 << codes.bits)


def test_other_types_are_not_block_codes():
    assert to_block_codes(gguf_blocks(Q.Q4_K, 16, 256)) is None    # int4 groups unless asked
    assert to_block_codes(gguf_blocks(Q.Q4_K, 16, 256), q4_k=True) is not None
    assert to_block_codes(gguf_blocks(Q.Q3_K, 16, 256)) is None


@needs_qblock
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("n", [16, 40])                 # one strip; a padded last strip
def test_kernel_matches_its_reference_at_tile_boundaries(qtype, n):
    codes = codes_of(gguf_blocks(qtype, n, 512, seed=5))
    weight = QBlockWeight(codes)
    torch.manual_seed(0)
    for rows in (1, 7, 8, 9, 17, 24, 31):   # from 9 (Q6_K) / 24 rows: 5-6-bit codes through a panel
        x = torch.randn(rows, 512).bfloat16()
        y = weight.logits(x).double()
        ref = qblock_reference(x, codes)
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)
        assert y.shape == (rows, n)
        out = weight(x)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2)


@needs_qblock
@pytest.mark.parametrize("qtype", TYPES)
def test_a_row_never_depends_on_its_batch(qtype):
    weight = QBlockWeight(codes_of(gguf_blocks(qtype, 48, 512, seed=7)))
    torch.manual_seed(1)
    x = torch.randn(30, 512).bfloat16()
    batched = weight.logits(x)     # 30 rows: every 5- and 6-bit type through a panel of bytes
    # every tile size of one strip (8) and of a pair (6), on packed codes and on a panel
    for rows in (*range(1, 14), 23, 24, 25):
        assert torch.equal(weight.logits(x[:rows]), batched[:rows]), rows
    alone = torch.cat([weight.logits(x[i:i + 1]) for i in range(30)])
    assert torch.equal(alone, batched)


@needs_qblock
def test_nan_and_zero_rows_stay_in_their_row():
    weight = QBlockWeight(codes_of(gguf_blocks(Q.Q6_K, 32, 256, seed=8)))
    x = torch.randn(4, 256).bfloat16()
    x[1, 5] = float("nan")
    x[2] = 0
    y = weight.logits(x)
    assert bool(torch.isnan(y[1]).all())
    assert bool((y[2] == 0).all())
    assert torch.equal(y[[0, 3]], weight.logits(x[[0, 3]]))


@needs_qblock
@pytest.mark.parametrize("qtype", TYPES)
def test_resident_bytes_stay_at_the_files_size(qtype):
    raw = gguf_blocks(qtype, 256, 1024, seed=3)
    weight = QBlockWeight(codes_of(raw))
    assert raw.data.nbytes == 256 * 1024 * FILE_BITS[qtype] / 8
    assert weight.nbytes <= 1.03 * raw.data.nbytes


@needs_qblock
def test_operand_errors_are_clear():
    weight = QBlockWeight(codes_of(gguf_blocks(Q.Q5_K, 16, 512, seed=1)))
    x = torch.randn(2, 256).bfloat16()
    with pytest.raises(RuntimeError, match="packed weight is for K=512"):
        qblock_a8_mm(x, weight.qweight, weight.sub, weight.sup, 5, 1)
    with pytest.raises(RuntimeError, match="no kernel for 7-bit"):
        qblock_a8_mm(x, weight.qweight, weight.sub, weight.sup, 7, 1)
    with pytest.raises(RuntimeError, match="needs super-block scales"):
        qblock_a8_mm(torch.randn(2, 512).bfloat16(), weight.qweight, weight.sub, None, 5, 1)


@needs_qblock
def test_one_compiled_graph_for_every_batch():
    assert_one_compiled_graph_for_every_batch(
        QBlockWeight(codes_of(gguf_blocks(Q.Q5_0, 48, 128, seed=4))), 128)


def _fused(method, shards, role=""):
    layer = Linear(256, [s.shape[0] for s in shards], bias=False, method=method,
                   dtype=torch.bfloat16, device=torch.device("cpu"), role=role)
    for i, raw in enumerate(shards):
        layer.method.load_weight(layer, "weight", raw, i)
    layer.method.process_weights_after_loading(layer)
    return layer


def _dense(shards):
    return torch.from_numpy(np.concatenate([
        gguf.quants.dequantize(r.data, r.qtype).reshape(r.shape) for r in shards])).double()


@pytest.mark.skipif(not (native_int4_a8_available() and native_int4_available()),
                    reason="needs the int4 x int8 and int4 x bf16 kernels")
def test_auto_activations_keep_bf16_for_the_attention_input_of_int4_groups():
    """``--int4-activations auto``: the q/k/v projection of int4 groups meets bf16 activations
    (its product equals the bf16 kernel's, not the int8 one's); every other int4 layer, and a
    q/k/v projection held in another format, quantizes its activations to int8."""
    q4 = [gguf_blocks(Q.Q4_0, rows, 256, seed=s) for s, rows in ((1, 64), (2, 32), (3, 32))]
    mixed = GGUFLinearMethod(int8_activations=True, bf16_attention_input=True)
    qkv = _fused(mixed, q4, role=ATTENTION_INPUT)
    other = _fused(mixed, q4)
    assert (qkv.qformat, other.qformat) == ("int4-g32", "int4-g32-a8")
    bf16 = _fused(GGUFLinearMethod(int8_activations=False), q4)
    a8 = _fused(GGUFLinearMethod(int8_activations=True), q4, role=ATTENTION_INPUT)
    assert a8.qformat == "int4-g32-a8"      # --int4-activations int8: every product
    torch.manual_seed(3)
    x = torch.randn(7, 256).bfloat16()
    assert torch.equal(qkv(x), bf16(x)) and torch.equal(other(x), a8(x))
    assert not torch.equal(qkv(x), a8(x))
    if native_qblock_available():           # a block-format q/k/v keeps its int8 kernel
        q6 = [gguf_blocks(Q.Q6_K, 32, 256, seed=s) for s in (4, 5)]
        assert _fused(mixed, q6, role=ATTENTION_INPUT).qformat == "gguf-q6_k-a8"
        # a split q/k/v (Q4_0 q/k beside a Q6_K v): its int4 part takes bf16 activations
        split = _fused(mixed, q4[:2] + q6[:1], role=ATTENTION_INPUT)
        assert split.qformat == "split:int4-g32+gguf-q6_k-a8"
        assert torch.equal(split.qweight.parts[0](x), bf16.qweight(x)[:, :96])


@needs_qblock
@pytest.mark.skipif(not native_int4_a8_available(), reason="needs the int4 x int8 kernel")
def test_gguf_method_keeps_block_types_and_splits_a_mixed_fused_layer():
    """Q4_K q/k with a Q6_K v (a Q4_K_M file's attention) is one product per format, each
    exact; Q4_0 beside Q6_K keeps the int4 kernel for its part; a layer of one type is one
    block weight; bf16 activations keep Q4_K as int4 groups and the rest int8 per channel."""
    q, k = gguf_blocks(Q.Q4_K, 64, 256, seed=1), gguf_blocks(Q.Q4_K, 32, 256, seed=2)
    v = gguf_blocks(Q.Q6_K, 32, 256, seed=3)
    torch.manual_seed(2)
    x = torch.randn(5, 256).bfloat16()
    layer = _fused(GGUFLinearMethod(int8_activations=True), [q, k, v])
    assert layer.qformat == "split:gguf-q4_k-a8+gguf-q6_k-a8"
    ref = quantized_rows_reference(x) @ _dense([q, k, v]).T
    torch.testing.assert_close(layer.qweight.parts[0].logits(x).double(), ref[:, :96],
                               rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(layer(x).double(), ref, rtol=0.01,
                               atol=0.01 * float(ref.abs().max()))
    q4_0 = gguf_blocks(Q.Q4_0, 32, 256, seed=4)
    mixed = _fused(GGUFLinearMethod(int8_activations=True), [q4_0, v])
    assert mixed.qformat == "split:int4-g32-a8+gguf-q6_k-a8"
    ref = quantized_rows_reference(x) @ _dense([q4_0, v]).T
    # the int4 part's scales are bf16 in its layout: a few parts in 1e3
    torch.testing.assert_close(mixed(x).double(), ref, rtol=0.02,
                               atol=0.02 * float(ref.abs().max()))
    same = _fused(GGUFLinearMethod(int8_activations=True), [v, gguf_blocks(Q.Q6_K, 32, 256)])
    assert same.qformat == "gguf-q6_k-a8"
    assert _fused(GGUFLinearMethod(int8_activations=False), [q, k]).qformat == "int4-g32"
    assert _fused(GGUFLinearMethod(int8_activations=False), [q, k, v]).qformat == "int8"


@needs_qblock
@pytest.mark.parametrize("qtype", TYPES)
def test_a_block_tables_rows_are_ggufs_values_and_its_head_the_block_product(qtype):
    """The lookup decodes rows from the packed strips (every channel of a strip, a padded
    last strip, repeated and unordered ids, a 2-D id tensor): gguf's dequantized values."""
    raw = gguf_blocks(qtype, 40, 512, seed=9)
    table = QBlockTable(codes_of(raw))
    dense = torch.from_numpy(gguf.quants.dequantize(raw.data, qtype).reshape(40, 512))
    ids = torch.tensor([[0, 15, 16, 39], [7, 7, 38, 1]])
    assert torch.equal(table.rows(ids, torch.float32), dense[ids])
    assert torch.equal(table.rows(ids, torch.bfloat16), dense[ids].bfloat16())
    every = torch.arange(40)
    assert torch.equal(table.rows(every, torch.float32), dense)
    x = torch.randn(3, 512).bfloat16()
    assert torch.equal(table.logits(x), QBlockWeight(codes_of(raw)).logits(x))
    # the padded last strip's rows are not the table's
    with pytest.raises(RuntimeError, match="id 40 outside the 40 rows"):
        table.rows(torch.tensor([40]), torch.float32)
    # loaded in chunks of whole strips: the same buffers
    chunked = QBlockTable.from_raw(raw, chunk_rows=16)
    for name in ("qweight", "sub", "sup"):
        a, b = getattr(chunked, name), getattr(table, name)
        assert (a is None and b is None) or torch.equal(a, b)
    assert torch.equal(chunked.rows(ids, torch.float32), dense[ids])


@needs_qblock
def test_the_row_lookup_checks_its_operands():
    raw = gguf_blocks(Q.Q5_K, 32, 256, seed=12)
    t = QBlockTable(codes_of(raw))
    rows = torch.ops.llmserve_native.qblock_rows
    with pytest.raises(RuntimeError, match="no table of 7-bit codes"):
        rows(torch.tensor([0]), t.qweight, t.sub, t.sup, 7, 1, 32)
    with pytest.raises(RuntimeError, match=r"sub must be contiguous \(2, blocks, 2, 16\)"):
        rows(torch.tensor([0]), t.qweight, t.sub[:, :, :1].contiguous(), t.sup, 5, 1, 32)
    with pytest.raises(RuntimeError, match="needs fp16 super-block scales"):
        rows(torch.tensor([0]), t.qweight, t.sub, t.sup[:, :, :1].contiguous(), 5, 1, 32)
    with pytest.raises(RuntimeError, match="needs fp16 super-block scales"):
        rows(torch.tensor([0]), t.qweight, t.sub, None, 5, 1, 32)
    with pytest.raises(RuntimeError, match="64 rows do not fill 2 strips"):
        rows(torch.tensor([0]), t.qweight, t.sub, t.sup, 5, 1, 64)
    with pytest.raises(RuntimeError, match="ids must be a contiguous 1-D int64"):
        rows(torch.tensor([0], dtype=torch.int32), t.qweight, t.sub, t.sup, 5, 1, 32)


def test_non_finite_k_quant_scales_keep_the_float_path():
    raw = gguf_blocks(Q.Q6_K, 16, 256, seed=13)
    raw.data[3, 208:210] = np.array([np.inf], dtype=np.float16).view(np.uint8)
    assert to_block_codes(raw) is None
    with pytest.raises(ValueError, match="float16 values"):
        pack_qblock(BlockCodes("Q5_K", torch.zeros(16, 256, dtype=torch.uint8), 5, 1,
                               torch.zeros(16, 8, 2, dtype=torch.uint8),
                               torch.full((16, 1, 2), 0.1)))


@needs_qblock
def test_an_embedding_keeps_a_k_quant_table_in_its_blocks_and_q8_0_as_int8_rows():
    cpu = torch.device("cpu")
    q6 = gguf_blocks(Q.Q6_K, 64, 256, seed=10)
    emb = VocabEmbedding(64, 256, torch.bfloat16, cpu, block_table=True)
    emb.load("weight", q6)
    assert isinstance(emb.qweight, QBlockTable) and emb.qweight.format_name == "gguf-q6_k-a8"
    assert emb.weight_bytes <= 1.03 * q6.data.nbytes
    dense = torch.from_numpy(gguf.quants.dequantize(q6.data, Q.Q6_K).reshape(64, 256))
    assert torch.equal(emb(torch.tensor([3, 60])), dense[[3, 60]].bfloat16())
    q8 = VocabEmbedding(64, 256, torch.bfloat16, cpu, block_table=True)
    q8.load("weight", gguf_blocks(Q.Q8_0, 64, 256, seed=11))
    assert isinstance(q8.qweight, Int8Weight)
    without = VocabEmbedding(64, 256, torch.bfloat16, cpu)
    without.load("weight", q6)
    assert isinstance(without.qweight, Int8Weight)


@needs_qblock
def test_engine_on_a_q5_0_file_matches_the_float32_run(tmp_path):
    from llmserve import LLM, SamplingParams
    from tests.model.tiny_checkpoints import make_tiny_checkpoint, make_tiny_gguf

    hf = make_tiny_checkpoint(str(tmp_path / "hf"), num_heads=4, num_kv_heads=2, hidden=64,
                              seed=3, tie=True)
    path = make_tiny_gguf(hf, str(tmp_path / "tiny.Q5_0.gguf"), quant="Q5_0",
                          with_tokenizer=True)
    packed = LLM(path, dtype="bfloat16", num_kv_blocks=64, block_size=16)
    assert "gguf-q5_0-a8" in packed.engine.runner.quantization
    dense = LLM(path, dtype="float32", num_kv_blocks=64, block_size=16)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompt = [list(range(100, 140))]
    assert packed.generate(prompt, params)[0].outputs[0].token_ids == \
        dense.generate(prompt, params)[0].outputs[0].token_ids


def test_types_without_a_packed_kernel_are_counted_for_the_load_log():
    method = GGUFLinearMethod(int8_activations=native_qblock_available())
    layer = _fused(method, [gguf_blocks(Q.Q3_K, 32, 256, seed=1),
                            gguf_blocks(Q.Q3_K, 16, 256, seed=2)])
    # int8 per channel, its rows meeting int8 activations where the layer runs them
    assert layer.qformat == ("int8-a8" if method.int8_activations else "int8")
    assert method.requantized == {"Q3_K": 2}

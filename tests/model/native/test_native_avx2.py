"""The avx2 tier's kernels (``model/native/csrc/avx2/``, ``torch.ops.llmserve_avx2``).

``int4_a8_mm`` and ``int8_a8_mm`` on AVX2 + FMA, the same packed layouts as the AVX512-VNNI
kernels: checked against their float64 references at row-tile (4) and strip (16) boundaries,
odd widths, zero and NaN rows and every group size; bit for bit against the AVX-512 kernels
where this CPU has both (their int32 block dots and float32 epilogues are the same
operations); and end to end, a fresh process with ``LLMSERVE_CPU_ISA=avx2`` runs the default
model's formats on them (``--dtype auto`` resolving to float32 as on an AVX2-only CPU) and
follows the dequantized float32 run.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from llmserve.model.native import ops
from llmserve.model.platform import cpu_flags
from llmserve.model.quant.native_int4 import int4_a8_reference, pack_int4_a8
from llmserve.model.quant.native_int8 import int8_a8_reference, pack_int8_a8
from tests.model.tiny_checkpoints import make_tiny_checkpoint, make_tiny_gguf

HAS_AVX2 = ops.CPU_TIERS["avx2"] <= cpu_flags()
pytestmark = pytest.mark.skipif(not HAS_AVX2 or ops._compiler() is None,
                                reason="needs AVX2 + FMA + F16C and a C++ compiler")


@pytest.fixture(scope="module")
def avx2():
    """The avx2 library loaded into this process beside the AVX-512 one (other op names)."""
    path = ops.build(ops._compiler(), "llmserve_avx2", ops.AVX2_SOURCES, ops.AVX2_HEADERS,
                     ops._AVX2_FLAGS)
    torch.ops.load_library(str(path))
    assert torch.ops.llmserve_avx2.cpu_supported()
    return torch.ops.llmserve_avx2


def _avx512_vnni() -> bool:
    return ops.native_available() and ops.a8_supported()


def _x(rows: int, k: int, seed: int) -> torch.Tensor:
    x = (torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)) * 2).bfloat16()
    if rows > 2:
        x[1] = 0                      # a zero row: all blocks tiny
        x[2, 7] = float("nan")        # a NaN poisons its row's outputs only
    return x


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9])
@pytest.mark.parametrize("n,k,group", [(16, 64, 32), (48, 576, 32), (40, 256, 128),
                                       (32, 512, 256), (24, 192, 64)])
def test_int4_a8_matches_reference_and_the_avx512_kernel(avx2, rows, n, k, group):
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale = torch.rand(n, k // group, generator=gen) * 0.1 + 0.01
    zero = torch.rand(n, k // group, generator=gen) - 0.5
    pad = -n % 16
    if pad:   # the packer wants whole strips: zero rows, as Int4Weight pads
        q = torch.cat([q, q.new_full((pad, k), 8)])
        scale = torch.cat([scale, scale.new_zeros(pad, k // group)])
        zero = torch.cat([zero, zero.new_zeros(pad, k // group)])
    packed, sm = pack_int4_a8(q, scale, zero, group)
    x = _x(rows, k, rows)
    y = avx2.int4_a8_mm(x, packed, sm, group)
    ref = int4_a8_reference(x, q, scale, zero, group)
    finite = ~torch.isnan(x).any(1)
    got = y.double()[finite]
    want = ref[finite]
    assert ((got - want).abs() <= 0.008 * want.abs() + 1e-3).all()    # bf16 output rounding
    assert torch.isnan(y[~finite]).all()
    if _avx512_vnni():
        same = torch.ops.llmserve_native.int4_a8_mm(x, packed, sm, group)
        assert torch.equal(y.view(torch.int16), same.view(torch.int16))


@pytest.mark.parametrize("rows", [1, 4, 6])
@pytest.mark.parametrize("float_out", [False, True])
def test_int8_a8_matches_reference_and_the_avx512_kernel(avx2, rows, float_out):
    gen = torch.Generator().manual_seed(rows)
    n, k = 48, 96
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)   # -128 included
    scale = (torch.rand(n, generator=gen) * 0.01).bfloat16()
    packed = pack_int8_a8(q)
    x = _x(rows, k, rows + 50)
    y = avx2.int8_a8_mm(x, packed, scale, float_out)
    ref = int8_a8_reference(x, q, scale)
    finite = ~torch.isnan(x).any(1)
    tol = 1e-4 if float_out else 0.008
    assert ((y.double()[finite] - ref[finite]).abs() <= tol * ref[finite].abs() + 1e-4).all()
    if _avx512_vnni():
        same = torch.ops.llmserve_native.int8_a8_mm(x, packed, scale, float_out)
        view = torch.int32 if float_out else torch.int16
        assert torch.equal(y.view(view), same.view(view))


@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (4, 4, 128), (14, 2, 64), (8, 1, 16)])
@pytest.mark.parametrize("softcap", [0.0, 30.0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_paged_decode_follows_the_reference_and_keeps_each_rows_bits(avx2, heads, kv_heads, d,
                                                                      softcap, dtype):
    """The avx2 tier's decode attention against the compiled formulation's float32 math
    (one query row per sequence, masked keys, a row with no valid key, a context past
    several 8-key vectors; bf16 and float32, the dtype of a model on a CPU without native
    bf16), and each row's bits the same alone, in any batch, and
    with its table padded wider (the row count picks the thread split, never the sums)."""
    from llmserve.model.attention.paged import paged_decode_inplace

    gen = torch.Generator().manual_seed(heads * 100 + d)
    kc = torch.randn(300, kv_heads, d, generator=gen).to(dtype)
    vc = torch.randn(300, kv_heads, d, generator=gen).to(dtype)
    q = torch.randn(7, heads, d, generator=gen).to(dtype)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    slots = torch.randint(0, 300, (7, 90), generator=gen)
    lens = torch.tensor([90, 1, 33, 0, 64, 17, 89])
    valid = torch.arange(90).unsqueeze(0) < lens.unsqueeze(1)
    valid[4, 10:20] = False                           # a window's hole
    scale = d ** -0.5
    got = avx2.paged_decode(q, kc, vc, slots, valid, scale, softcap)
    ref = paged_decode_inplace(q, kc, vc, slots, valid, scale, softcap or None)
    ok = lens > 0
    assert ((got.float()[ok] - ref.float()[ok]).abs() <= 0.02).all()
    assert (got[3] == 0).all()                        # no valid key: zeros, not NaN
    for i in range(7):
        alone = avx2.paged_decode(q[i:i + 1], kc, vc, slots[i:i + 1, :int(lens[i]) + 5],
                                  valid[i:i + 1, :int(lens[i]) + 5], scale, softcap)
        assert torch.equal(alone.view(bits), got[i:i + 1].view(bits))
    pairs = torch.cat([avx2.paged_decode(q[i:i + 2], kc, vc, slots[i:i + 2], valid[i:i + 2],
                                         scale, softcap) for i in range(0, 6, 2)])
    assert torch.equal(pairs.view(bits), got[:6].view(bits))


def test_operand_errors_are_clear(avx2):
    x = torch.randn(2, 64).bfloat16()
    q = torch.randint(0, 16, (16, 64), dtype=torch.uint8)
    packed, sm = pack_int4_a8(q, torch.full((16, 2), 0.1), torch.zeros(16, 2), 32)
    with pytest.raises(RuntimeError, match=r"int4_a8_mm \(avx2\): packed weight is for K=64"):
        avx2.int4_a8_mm(torch.randn(2, 96).bfloat16(), packed, sm, 32)
    with pytest.raises(RuntimeError, match="x must be a contiguous 2-D bf16"):
        avx2.int4_a8_mm(x.float(), packed, sm, 32)


_RUN = """
import json, sys
import torch
from llmserve import LLM, SamplingParams
from llmserve.model.executor.capture import LogitsCapture
llm = LLM(sys.argv[1], num_kv_blocks=64, block_size=16, enforce_eager=True,
          quantization=sys.argv[2])
runner = llm.engine.runner
runner.capture = LogitsCapture.ALL
seen, inner = [], runner.execute
runner.execute = lambda step: seen.append(inner(step)) or seen[-1]
out = llm.generate([[5, 17, 300, 42, 9, 1000, 77, 8]], SamplingParams(max_tokens=1,
                   temperature=0))[0]
torch.save(seen[0].all_logits[out.request_id], sys.argv[3])
print(json.dumps(runner.kernel_plan))
"""


def test_a_forced_avx2_engine_runs_packed_on_these_kernels(tmp_path):
    hf = make_tiny_checkpoint(str(tmp_path / "hf"), num_heads=4, num_kv_heads=2, hidden=64,
                              seed=5, tie=True)
    gguf = make_tiny_gguf(hf, str(tmp_path / "tiny.Q4_1.gguf"), quant="Q4_1",
                          embedding_quant="Q8_0", with_tokenizer=True)
    plans, logits = {}, {}
    for name, quant in (("avx2", "auto"), ("dense", "none")):
        env = dict(os.environ, LLMSERVE_CPU_ISA="avx2")
        out = subprocess.run([sys.executable, "-c", _RUN, gguf, quant, str(tmp_path / name)],
                             env=env, check=True, capture_output=True, text=True, timeout=600)
        plans[name] = json.loads(out.stdout.strip().splitlines()[-1])
        logits[name] = torch.load(tmp_path / name)
    plan = plans["avx2"]
    assert plan["cpu"]["tier"] == "avx2" and plan["cpu"]["a8_library"] == "llmserve_avx2"
    assert plan["dtype"] == "float32"          # --dtype auto without native bf16
    assert plan["linear"] == {"int4-g32-a8": 8} and plan["lm_head"] == "tied:int8-a8"
    assert plans["dense"]["linear"] == {"dense": 8}
    p = torch.log_softmax(logits["dense"], -1)
    q = torch.log_softmax(logits["avx2"], -1)
    assert ((p.exp() * (p - q)).sum(-1)).max() < 0.01


def test_a_rows_result_never_depends_on_its_batch(avx2):
    """Batch invariance of both avx2 kernels: each row alone equals, bit for bit, the same
    row inside batches of 2..9 rows (across the 4-row tiles)."""
    gen = torch.Generator().manual_seed(3)
    n, k = 48, 256
    q4 = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    packed4, sm = pack_int4_a8(q4, torch.rand(n, k // 32, generator=gen) * 0.1 + 0.01,
                               torch.rand(n, k // 32, generator=gen) - 0.5, 32)
    packed8 = pack_int8_a8(torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8))
    scale8 = (torch.rand(n, generator=gen) * 0.01).bfloat16()
    x = (torch.randn(9, k, generator=gen) * 2).bfloat16()
    products = (lambda rows: avx2.int4_a8_mm(rows, packed4, sm, 32),
                lambda rows: avx2.int8_a8_mm(rows, packed8, scale8, True))
    for product in products:
        alone = torch.cat([product(x[i:i + 1]) for i in range(9)])
        for size in (2, 4, 5, 8, 9):
            batched = product(x[:size])
            assert torch.equal(batched, alone[:size]), size


_GREEDY = """
import json, sys
from llmserve import LLM, SamplingParams
llm = LLM(sys.argv[1], num_kv_blocks=128, block_size=16, enforce_eager=True)
params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
prompts = [[5 + i, 17, 300 + 7 * i, 42, 9, 1000 - i, 77] for i in range(8)]
alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
batches = {n: [o.outputs[0].token_ids for o in llm.generate(prompts[:n], params)]
           for n in (4, 8)}
print(json.dumps({"alone": alone, "batches": batches}))
"""


def test_forced_avx2_greedy_tokens_are_the_same_alone_and_in_batches(tmp_path):
    hf = make_tiny_checkpoint(str(tmp_path / "hf"), num_heads=4, num_kv_heads=2, hidden=64,
                              seed=6, tie=True)
    gguf = make_tiny_gguf(hf, str(tmp_path / "tiny.Q4_1.gguf"), quant="Q4_1",
                          embedding_quant="Q8_0", with_tokenizer=True)
    env = dict(os.environ, LLMSERVE_CPU_ISA="avx2")
    out = subprocess.run([sys.executable, "-c", _GREEDY, gguf], env=env, check=True,
                         capture_output=True, text=True, timeout=600)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    for n, tokens in got["batches"].items():
        assert tokens == got["alone"][:int(n)], n

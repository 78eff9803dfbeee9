"""KV-cache quantization (int8, fp8 e4m3): codes and scales, every attention path reading them,
and an int8-KV engine that never shares prefix-cache blocks with a bf16-KV one.

Error bounds per element: int8 |x - x'| <= scale / 2 with scale = max|x_row| / 127;
fp8 e4m3 |x - x'| <= 2^-4 |x| + 2^-9 scale (3 mantissa bits; subnormal spacing near 0).
"""
from __future__ import annotations

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.engine.kv.block_hash import extend_block_hashes, namespace_hash
from llmserve.model.attention.backend import StepBatch, make_backend
from llmserve.model.attention.paged import paged_decode_inplace
from llmserve.model.executor.kv_cache import kv_bytes_per_block
from llmserve.model.quant.kv import KV_QUANT_DTYPES, dequantize_kv, quantize_kv, store_kv
from tests.model.test_parity import StepRecorder
from tests.model.tiny_checkpoints import make_tiny_checkpoint

DTYPES = [pytest.param(t, id=n) for n, t in KV_QUANT_DTYPES.items()]
H, HKV, D, BS = 4, 2, 16, 4


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("kvq")), arch="llama",
                                num_heads=4, num_kv_heads=2, seed=9)


@pytest.mark.parametrize("dtype", DTYPES)
def test_roundtrip_within_bounds(dtype):
    x = torch.randn(50, HKV, D) * torch.logspace(-3, 1, 50).view(50, 1, 1)
    rows = quantize_kv(x, dtype)
    assert rows.shape == (50, HKV, D + 4) and rows.dtype == dtype
    back = dequantize_kv(rows, torch.float32)
    amax = x.abs().amax(-1, keepdim=True)
    if dtype == torch.int8:
        bound = amax / 127 / 2 * (1 + 1e-6)
    else:
        bound = x.abs() * 2 ** -4 + amax / 448 * 2 ** -9
    assert ((back - x).abs() <= bound + 1e-12).all()
    assert torch.equal(dequantize_kv(quantize_kv(torch.zeros(1, 1, D), dtype), torch.float32),
                       torch.zeros(1, 1, D))


def _caches(dtype, num_blocks=12):
    slots = (num_blocks + 1) * BS
    qk = torch.zeros(slots, HKV, D + 4, dtype=torch.uint8).view(dtype)
    qv = torch.zeros_like(qk.view(torch.uint8)).view(dtype)
    return qk, qv


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend_name", ["reference", "paged"])
def test_backends_read_quantized_cache_like_its_values(dtype, backend_name):
    """Attention over a quantized cache equals attention over a float cache holding the
    dequantized values: the backend dequantizes exactly what was stored."""
    gen = torch.Generator().manual_seed(0)
    # built for the quantized cache, as the engine builds it (a float32 one would take the
    # avx2 tier's native decode, which reads float caches only)
    backend = make_backend(backend_name, H, HKV, D, BS, kv_dtype=dtype)
    qk, qv = _caches(dtype)
    fk, fv = torch.zeros(qk.shape[0], HKV, D), torch.zeros(qk.shape[0], HKV, D)
    tables = torch.tensor([[0, 1, 2, 12], [3, 4, 5, 6], [7, 8, 12, 12]])
    ctx = [9, 15, 6]          # seq 0, 1 decode one token each; seq 2 prefills 6 tokens
    qlens = [1, 1, 6]
    hist = [(0, 8), (1, 14)]  # cached tokens of the decoding sequences
    for seq, n in hist:
        slots = torch.tensor([int(tables[seq, p // BS]) * BS + p % BS for p in range(n)])
        k, v = torch.randn(n, HKV, D, generator=gen), torch.randn(n, HKV, D, generator=gen)
        store_kv(qk, slots, k)
        store_kv(qv, slots, v)
        fk[slots], fv[slots] = dequantize_kv(qk[slots], torch.float32), \
            dequantize_kv(qv[slots], torch.float32)
    new_slots = torch.tensor([int(tables[0, 8 // BS]) * BS + 0, int(tables[1, 14 // BS]) * BS + 2]
                             + [int(tables[2, p // BS]) * BS + p % BS for p in range(6)])
    q = torch.randn(8, H, D, generator=gen)
    k, v = torch.randn(8, HKV, D, generator=gen), torch.randn(8, HKV, D, generator=gen)
    kq = dequantize_kv(quantize_kv(k, dtype), torch.float32)
    vq = dequantize_kv(quantize_kv(v, dtype), torch.float32)
    batch = StepBatch(slot_mapping=new_slots, block_tables=tables, context_lens=torch.tensor(ctx),
                      num_decodes=2, query_lens=qlens, context_lens_host=ctx,
                      table_widths=[3, 4, 2])
    meta = backend.build_metadata(batch)
    got = backend.forward(q, k, v, qk, qv, meta, D ** -0.5)
    want = backend.forward(q, kq, vq, fk, fv, backend.build_metadata(batch), D ** -0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_compiled_paged_decode_reads_quantized_cache(dtype):
    gen = torch.Generator().manual_seed(1)
    qk, qv = _caches(dtype)
    slots_all = torch.arange(qk.shape[0])
    store_kv(qk, slots_all, torch.randn(qk.shape[0], HKV, D, generator=gen))
    store_kv(qv, slots_all, torch.randn(qk.shape[0], HKV, D, generator=gen))
    q = torch.randn(2, H, D, generator=gen)
    slots = torch.tensor([[0, 1, 2, 3, 8, 9, 10, 11], [20, 21, 22, 23, 24, 25, 26, 27]])
    valid = torch.tensor([[True] * 6 + [False] * 2, [True] * 8])
    eager = paged_decode_inplace(q, qk, qv, slots, valid, D ** -0.5)
    compiled = torch.compile(paged_decode_inplace, fullgraph=True)(q, qk, qv, slots, valid,
                                                                   D ** -0.5)
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)


def test_pool_bytes_count_codes_and_scales(tiny_path):
    llm = LLM(tiny_path, dtype="float32", kv_cache_dtype="int8", num_kv_blocks=16, block_size=BS)
    mc = llm.engine.model_config
    per_token = 2 * mc.num_hidden_layers * mc.num_key_value_heads * (mc.head_dim + 4)
    assert llm.engine.runner.kv.bytes_per_token == per_token
    assert kv_bytes_per_block(mc, BS, torch.int8) == per_token * BS
    k_cache = llm.engine.runner.kv_caches[0][0]
    assert k_cache.dtype == torch.int8 and k_cache.shape[-1] == mc.head_dim + 4


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_engine_logits_follow_float_kv(tiny_path, kv):
    prompt = list(range(300, 340))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    got = {}
    for name in ("float32", kv):
        llm = LLM(tiny_path, dtype="float32", kv_cache_dtype=name, num_kv_blocks=32,
                  block_size=BS)
        rec = StepRecorder(llm)
        out = llm.generate([prompt], params)[0]
        got[name] = torch.stack(rec.sampled_logits(out.request_id))
    ref, test = got["float32"], got[kv]
    p, q = torch.log_softmax(ref, -1), torch.log_softmax(test, -1)
    kl = (p.exp() * (p - q)).sum(-1)
    assert kl.max() < (1e-3 if kv == "int8" else 1e-2), kl


def test_int8_kv_engine_never_hits_bf16_kv_blocks(tiny_path):
    kw = dict(dtype="float32", num_kv_blocks=32, block_size=BS)
    bf16 = LLM(tiny_path, kv_cache_dtype="bfloat16", **kw).engine
    int8 = LLM(tiny_path, kv_cache_dtype="int8", **kw).engine
    assert bf16.kv_dtype == "bfloat16" and int8.kv_dtype == "int8"
    assert bf16.fingerprint != int8.fingerprint
    tokens = list(range(100, 100 + 4 * BS))
    chains = []
    for eng in (bf16, int8):
        hashes: list = []
        extend_block_hashes(hashes, tokens, BS, namespace_hash(eng.fingerprint, None))
        chains.append(set(hashes))
    assert len(chains[0]) == 4 and not chains[0] & chains[1]


def test_compiled_step_with_int4_weights_and_int8_kv(tiny_path):
    """The compiled decode graph calls the int4 kernel and reads the int8 cache like eager."""
    prompts = [list(range(100 + 13 * i, 110 + 13 * i + 5 * i)) for i in range(3)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    kw = dict(dtype="float32", kv_cache_dtype="int8", quantization="int4", num_kv_blocks=64,
              block_size=BS, max_num_seqs=4)
    results = {}
    for eager in (True, False):
        llm = LLM(tiny_path, enforce_eager=eager, **kw)
        rec = StepRecorder(llm)
        outs = llm.generate(prompts, params)
        results[eager] = ([o.outputs[0].token_ids for o in outs],
                          [torch.stack(rec.sampled_logits(o.request_id)) for o in outs])
        if not eager:
            assert llm.engine.runner.compiled is not None
            assert not llm.engine.runner.compiled.failed
    assert results[False][0] == results[True][0]
    for got, ref in zip(results[False][1], results[True][1]):
        torch.testing.assert_close(got, ref, atol=1e-3, rtol=1e-3)

"""The kernel plan (model/executor/kernel_plan.py) and the CPU tier setting: an engine on a
tiny Q5_0 GGUF logs its plan once and returns it from a live server's ``GET /v1/status``;
``LLMSERVE_CPU_ISA`` forces lower tiers in fresh processes (the block kernels give way to int8
per channel, the avx2 tier runs its own int8-activation library, then every native kernel gives
way to PyTorch's); an unknown tier is a clear error."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest
import torch

from llmserve.model.native.ops import CPU_TIERS, cpu_tier
from llmserve.model.platform import cpu_flags
from llmserve.model.quant.kv import KV_QUANT_DTYPES
from tests.model.tiny_checkpoints import make_tiny_checkpoint, make_tiny_gguf

HAS_VNNI = CPU_TIERS["avx512_vnni"] <= cpu_flags()

_PLAN_SCRIPT = """
import json, sys
from llmserve import LLM
llm = LLM(sys.argv[1], dtype="bfloat16", num_kv_blocks=64, block_size=16, enforce_eager=True)
print(json.dumps(llm.engine.runner.kernel_plan))
"""


@pytest.fixture(scope="module")
def tiny_q5(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plan")
    hf = make_tiny_checkpoint(str(folder / "hf"), num_heads=4, num_kv_heads=2, hidden=64,
                              seed=3, tie=True)
    return make_tiny_gguf(hf, str(folder / "tiny.Q5_0.gguf"), quant="Q5_0", with_tokenizer=True)


def _plan_in_a_fresh_process(path: str, isa: str) -> dict:
    env = dict(os.environ, LLMSERVE_CPU_ISA=isa)
    out = subprocess.run([sys.executable, "-c", _PLAN_SCRIPT, path], env=env, check=True,
                         capture_output=True, text=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_an_unknown_tier_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("LLMSERVE_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="LLMSERVE_CPU_ISA must be auto or one of"):
        cpu_tier()
    monkeypatch.setenv("LLMSERVE_CPU_ISA", "AVX2")        # case and dashes are forgiven
    assert cpu_tier() in ("avx2", "none")
    monkeypatch.setenv("LLMSERVE_CPU_ISA", "none")
    assert cpu_tier() == "none"


def test_the_plan_is_logged_and_served_in_status(tiny_q5, caplog):
    from llmserve.async_llm import AsyncLLM
    from llmserve.config import EngineConfig
    from tests.server.conftest import LiveServer

    with caplog.at_level("INFO", logger="llmserve.model.executor.runner"):
        engine = AsyncLLM.from_config(EngineConfig.from_kwargs(
            model=tiny_q5, dtype="bfloat16", num_kv_blocks=64, block_size=16,
            enforce_eager=True, device="cpu"))
    try:
        blocks = [r.getMessage() for r in caplog.records if "kernel plan" in r.getMessage()]
        assert len(blocks) == 1
        assert "linear:" in blocks[0] and "attention:" in blocks[0]
        live = LiveServer(engine).start()
        try:
            body = httpx.get(live.url("/v1/status"), timeout=30).json()
        finally:
            live.stop()
        plan = body["kernel_plan"][engine.model_name]
        assert plan == json.loads(json.dumps(engine.kernel_plan()))
        assert plan["cpu"]["tier"] == cpu_tier()
        fmts = set(plan["linear"])
        if HAS_VNNI and plan["native_kernels"].get("qblock_a8"):
            assert "gguf-q5_0-a8" in fmts
        assert sum(plan["linear"].values()) == 2 * 4       # 2 layers x (qkv, o, gate_up, down)
    finally:
        engine.shutdown()


@pytest.mark.skipif(not HAS_VNNI, reason="needs a CPU with the avx512_vnni tier to step down")
def test_forced_tiers_step_down_in_fresh_processes(tiny_q5):
    top = _plan_in_a_fresh_process(tiny_q5, "auto")
    bf16 = _plan_in_a_fresh_process(tiny_q5, "avx512_bf16")
    avx2 = _plan_in_a_fresh_process(tiny_q5, "avx2")
    none = _plan_in_a_fresh_process(tiny_q5, "none")
    assert top["cpu"]["tier"] == "avx512_vnni" and "gguf-q5_0-a8" in top["linear"]
    assert bf16["cpu"]["tier"] == "avx512_bf16"
    assert not any(f.endswith("-a8") for f in bf16["linear"])
    assert "int8" in bf16["linear"] and bf16["native_kernels"].get("qblock_a8") is None
    # avx2: the avx2 library's int8-activation products (Q5_0 as int8 rows x int8) and
    # decode attention, the AVX-512 library's other kernels gone
    assert avx2["cpu"]["tier"] == "avx2" and avx2["cpu"]["a8_library"] == "llmserve_avx2"
    assert set(avx2["linear"]) == {"int8-a8"}, avx2["linear"]
    assert avx2["native_kernels"].get("int8_a8") is True
    assert avx2["native_kernels"].get("paged_decode") is True
    assert not any(avx2["native_kernels"].get(k) for k in ("int8", "qblock_a8", "silu_mul"))
    assert avx2["attention"]["decode"] == "native paged_decode (llmserve_avx2)"
    assert none["cpu"]["tier"] == "none" and not any(none["native_kernels"].values())
    assert none["cpu"]["a8_library"] is None
    assert none["attention"]["decode"] == "torch"
    assert none["attention"]["prefill"] == "gather + SDPA, one decode row per token"
    assert top["attention"]["decode"] == "native paged_decode (llmserve_native)"
    # every tier's norm is one opaque op: its library's rms_norm, else ATen's behind an op
    for plan in (top, bf16):
        assert plan["norm"] == "native rms_norm (llmserve_native)"
    assert avx2["norm"] == "native rms_norm (llmserve_avx2)"
    assert none["norm"] == "torch rms_norm (one op on every path)"


@pytest.mark.parametrize("kw", [dict(dtype="bfloat16", kv_cache_dtype="int8"),
                                dict(dtype="bfloat16", kv_cache_dtype="fp8_e4m3"),
                                dict(dtype="float32")])
def test_decode_attention_is_decided_once_from_the_dtypes(tiny_q5, kw):
    """The backend picks the native decode kernel at construction, from the model and KV
    dtypes (no check per call): an int8 or fp8 cache gets it wherever the tier has a library
    (``paged_decode_q8``, or the avx2 tier's ``paged_decode``), a float32 one where the avx2
    library's float32 kernel is loaded (its tier, or beside the AVX-512 library); the plan
    says so."""
    from llmserve import LLM, SamplingParams
    from llmserve.model.attention.native_decode import native_decode_serves
    from llmserve.model.native.ops import tier_library

    llm = LLM(tiny_q5, num_kv_blocks=64, block_size=16, enforce_eager=True, **kw)
    kv = kw.get("kv_cache_dtype")
    if kv is None:   # float32: the avx2 library's kernel, its own tier or loaded beside
        native = native_decode_serves(torch.float32)
    else:            # an 8-bit cache: a kernel wherever the tier has a library
        native = tier_library() is not None
        assert native_decode_serves(torch.bfloat16, KV_QUANT_DTYPES[kv]) is native
    assert llm.engine.runner.backend.native_decode is native
    decode = llm.engine.runner.kernel_plan["attention"]["decode"]
    assert (decode == "torch") is not native
    if native and cpu_tier().startswith("avx512"):
        assert decode == {"int8": "native paged_decode_q8 (llmserve_native)",
                          "fp8_e4m3": "native paged_decode_q8 (llmserve_native)",
                          None: "native paged_decode (llmserve_avx2)"}[kv]
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, temperature=0,
                                                      ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 3


def test_only_a_float32_model_loads_the_avx2_library_beside_the_avx512_one(tiny_q5):
    """The avx2 library's float32 ``paged_decode`` is loaded on an AVX-512 tier when a
    float32 model asks for it, never for a bf16 one (whose start-up must not build or load a
    second library), each in a fresh process."""
    if not cpu_tier().startswith("avx512"):
        pytest.skip("only the AVX-512 tiers load a second library")
    code = ("import sys, json; from llmserve import LLM; "
            "llm = LLM(sys.argv[1], dtype=sys.argv[2], num_kv_blocks=64, enforce_eager=True); "
            "from llmserve.model.native import ops; "
            "print(json.dumps([ops._state.get('avx2', False), "
            "llm.engine.runner.backend.native_decode]))")
    got = {}
    for dtype in ("bfloat16", "float32"):
        proc = subprocess.run([sys.executable, "-c", code, tiny_q5, dtype], capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        got[dtype] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["bfloat16"] == [False, True]
    assert got["float32"] == [True, True]

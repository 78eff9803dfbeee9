"""GPTQ and AWQ folders straight into the int4 kernels (issue 29 item 3).

The folders are written by tests/model/int4_checkpoints.py's own packer from a tiny random
checkpoint, with a float32 folder of exactly the values they encode beside them (the
dequantized reference). Checked: the unpacking is exact for every layout (GPTQ v1/v2,
act-order, per channel, partial groups; AWQ's nibble order), the packed layers' products,
the engine's logits and greedy tokens against the reference, the quality gate, and clear
errors for what is not read.
"""
from __future__ import annotations

import json
import os
import re

import pytest
import torch

from llmserve import SamplingParams
from llmserve.eval.gate import run_gate
from llmserve.model.distributed.layers import check_shardable
from llmserve.model.layers.linear import DenseLinearMethod, Linear
from llmserve.model.loading.int4_checkpoint import PackedInt4Tensor
from llmserve.model.loading.loader import load_model_config, open_checkpoint
from llmserve.model.native.ops import cpu_tier
from llmserve.model.quant import select_linear_method
from llmserve.model.quant.gptq_awq import checkpoint_int4_groups
from llmserve.model.quant.methods import Int4CheckpointLinearMethod
from llmserve.model.quant.native_int4 import native_int4_a8_available, native_int4_available
from llmserve.model.quant.native_qblock import SplitWeight
from tests.model.family_parity import StepRecorder, make_llm
from tests.model.int4_checkpoints import make_int4_checkpoint
from tests.model.tiny_checkpoints import make_tiny_checkpoint

PROMPT = [5, 17, 300, 42, 9, 1000, 77, 8, 12, 400, 31, 2048]
LAYOUTS = {
    "gptq-g32": dict(method="gptq", group_size=32),
    "gptq-act": dict(method="gptq", group_size=32, act_order=True),
    "gptq-act-own-orders": dict(method="gptq", group_size=32, act_order=True,
                                shared_order=False),
    "gptq-v2-channel": dict(method="gptq", group_size=-1, checkpoint_format="gptq_v2"),
    "gptq-g128-partial": dict(method="gptq", group_size=128),    # K = 64 and 192
    "awq-g64": dict(method="awq", group_size=64),
    "awq-g32-float-down": dict(method="awq", group_size=32, keep_float=("down_proj",)),
}


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("int4ckpt") / "float"),
                                num_heads=4, num_kv_heads=2, hidden=64, intermediate=192,
                                seed=7)


@pytest.fixture(scope="module")
def folders(float_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("int4ckpt-out")
    return {name: make_int4_checkpoint(float_dir, str(root / name), seed=i, **kw)
            for i, (name, kw) in enumerate(LAYOUTS.items())}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_unpacking_is_exact(folders, layout):
    packed_dir, ref_dir = folders[layout]
    reference = dict(open_checkpoint(ref_dir).iter_weights())
    stored = dict(open_checkpoint(packed_dir).iter_weights(raw_gguf=True))
    dequantized = dict(open_checkpoint(packed_dir).iter_weights())
    assert set(stored) == set(reference) == set(dequantized)   # GPTQ's zero biases skipped
    packed = {n: t for n, t in stored.items() if isinstance(t, PackedInt4Tensor)}
    assert len(packed) == (12 if "float-down" in layout else 14)
    for name, tensor in packed.items():
        want = reference[name].float()
        assert torch.equal(tensor.dequantize(), want), name
        assert torch.equal(dequantized[name], want), name
        groups = checkpoint_int4_groups(tensor)
        assert groups is not None and torch.equal(groups.dequantize(), want), name
        if "act" in layout:
            assert groups.perm is not None, name


def test_kernel_group_sizes_follow_the_stored_groups(folders):
    sizes = {}
    for layout in ("gptq-v2-channel", "gptq-g128-partial", "gptq-act"):
        for name, t in open_checkpoint(folders[layout][0]).iter_weights(raw_gguf=True):
            if name.endswith(("q_proj.weight", "down_proj.weight")):
                sizes[layout, name.split(".")[-2]] = checkpoint_int4_groups(t).group_size
    # per channel: the largest kernel group dividing K; 128 over K = 192 (a last group of
    # 64): groups of 64; act-order keeps 32
    assert sizes["gptq-v2-channel", "q_proj"] == 64 and sizes["gptq-v2-channel", "down_proj"] == 64
    assert sizes["gptq-g128-partial", "q_proj"] == 64
    assert sizes["gptq-g128-partial", "down_proj"] == 64
    assert sizes["gptq-act", "down_proj"] == 32


def test_groups_no_kernel_size_fits_stay_dense():
    from llmserve.model.loading.int4_checkpoint import Int4CheckpointScheme

    k, n = 48, 16                      # K = 48: no kernel group of 32.. divides it
    t = PackedInt4Tensor(Int4CheckpointScheme("awq", 16), "x", torch.zeros(k, n // 8,
                         dtype=torch.int32), torch.zeros(3, n // 8, dtype=torch.int32),
                         torch.ones(3, n, dtype=torch.float16))
    assert checkpoint_int4_groups(t) is None
    layer = Linear(k, n, bias=False, method=Int4CheckpointLinearMethod(), dtype=torch.bfloat16,
                   device=torch.device("cpu"))
    layer.method.load_weight(layer, "weight", t, None)
    assert layer.qformat == "dense"


def _fused_layer(folder: str, a8: bool) -> tuple[Linear, torch.Tensor]:
    weights = dict(open_checkpoint(folder).iter_weights(raw_gguf=True))
    parts = [weights[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]
    method = Int4CheckpointLinearMethod(int8_activations=a8)
    layer = Linear(64, [p.shape[0] for p in parts], bias=False, method=method,
                   dtype=torch.bfloat16,
                   device=torch.device("cpu"))
    for i, p in enumerate(parts):
        method.load_weight(layer, "weight", p, i)
    return layer, torch.cat([p.dequantize() for p in parts])


@pytest.mark.parametrize("a8", [False, True])
def test_fused_products_match_the_dequantized_weight(folders, a8):
    if a8 and not native_int4_a8_available():
        pytest.skip("int8 activations need the int4 x int8 kernel (AVX512-VNNI)")
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    for layout, split in (("gptq-act", False), ("gptq-act-own-orders", True), ("awq-g64", False)):
        layer, w = _fused_layer(folders[layout][0], a8)
        assert isinstance(layer.qweight, SplitWeight) == split, layout
        assert layer.qformat.startswith("split" if split else "int4-g")
        y = layer(x).float()
        ref = x.float() @ w.T
        # bf16 (a16) or fp16 (a8) scales and zeros, int8 activation rows, a bf16 output
        err = (y - ref).abs().max() / ref.abs().max()
        assert err < 0.02, (layout, float(err))


def _logits_and_tokens(path: str, **kw) -> tuple[torch.Tensor, list[int]]:
    llm = make_llm(path, **kw)
    rec = StepRecorder(llm)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0,
                                                ignore_eos=True))[0]
    return torch.stack(rec.sampled_logits(out.request_id)), out.outputs[0].token_ids


@pytest.mark.parametrize("layout", ["gptq-act", "awq-g64"])
def test_engine_follows_the_dequantized_reference(folders, layout):
    packed_dir, ref_dir = folders[layout]
    exact, exact_tokens = _logits_and_tokens(packed_dir, quantization="none")   # fp32
    ref, ref_tokens = _logits_and_tokens(ref_dir, quantization="none")
    torch.testing.assert_close(exact, ref, atol=1e-5, rtol=1e-5)   # the same values
    assert exact_tokens == ref_tokens
    llm = make_llm(packed_dir, dtype="bfloat16", quantization="auto")
    fmt = llm.engine.runner.quantization
    # 8 fused projections packed; the float lm_head is the one dense linear
    g = r"int4-g(32|64)"
    if not native_int4_a8_available():
        linears = rf"{g}x8"
    elif native_int4_available():   # auto: q/k/v keeps bf16 activations, the rest int8
        linears = rf"{g}x2,{g}-a8x6"
    else:
        linears = rf"{g}-a8x8"
    assert re.fullmatch(rf"linear:densex1,{linears};embedding:dense", fmt), fmt
    packed, _ = _logits_and_tokens(packed_dir, dtype="bfloat16", quantization="auto")
    p, q = torch.log_softmax(ref, -1), torch.log_softmax(packed, -1)
    kl = (p.exp() * (p - q)).sum(-1)
    assert kl.max() < 0.01, kl


@pytest.mark.parametrize("layout", ["gptq-act", "awq-g64"])
def test_quality_gate_passes(folders, layout):
    results = run_gate(folders[layout][0], ["fp32", "packed"], max_tokens=48, window=24,
                       continuation_tokens=4)
    ref, packed = results
    assert "int4-g" in packed.quantization, packed.quantization
    assert packed.weight_bytes < ref.weight_bytes
    assert packed.passed, packed.failures


def test_method_choice_and_tensor_parallel_refusal(folders):
    cfg = load_model_config(folders["gptq-act"][0])
    assert cfg.quantization == "gptq:int4-g32-act"
    cpu = torch.device("cpu")
    method = select_linear_method("auto", 32, cfg, torch.bfloat16, cpu)
    assert isinstance(method, Int4CheckpointLinearMethod)
    # float32 dequantizes, except on the avx2 tier, whose int8-activation kernels keep a
    # float32 model's file packed (no native bf16 there)
    fp32_packed = cpu_tier() == "avx2" and native_int4_a8_available()
    assert isinstance(select_linear_method("auto", 32, cfg, torch.float32, cpu),
                      Int4CheckpointLinearMethod if fp32_packed else DenseLinearMethod)
    with pytest.raises(ValueError, match="GPTQ- or AWQ-packed"):
        check_shardable(cfg, 2, method)


def _with_config(src: str, dst, **qc) -> str:
    import shutil

    path = str(dst)
    shutil.copytree(src, path)
    cfg_path = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["quantization_config"].update(qc)
    json.dump(cfg, open(cfg_path, "w"))
    return path


@pytest.mark.parametrize("qc,message", [
    (dict(bits=8), "8 bits is not supported"),
    (dict(checkpoint_format="marlin"), "checkpoint_format 'marlin'"),
    (dict(group_size=12), "group_size 12"),
    (dict(lm_head=True), "quantized lm_head"),
])
def test_unsupported_gptq_configs_are_clear_errors(folders, tmp_path, qc, message):
    path = _with_config(folders["gptq-g32"][0], tmp_path / "bad", **qc)
    with pytest.raises(ValueError, match=message):
        load_model_config(path)


def test_awq_gemv_layout_is_refused(folders, tmp_path):
    path = _with_config(folders["awq-g64"][0], tmp_path / "gemv", version="gemv")
    with pytest.raises(ValueError, match="AWQ version 'gemv'"):
        load_model_config(path)


def test_missing_or_inconsistent_parts_are_named(folders, tmp_path):
    from safetensors.torch import load_file, save_file

    src = folders["awq-g64"][0]
    tensors = load_file(os.path.join(src, "model.safetensors"))
    name = "model.layers.1.mlp.up_proj"
    missing = dict(tensors)
    del missing[f"{name}.qzeros"]
    path = _with_config(src, tmp_path / "missing")
    save_file(missing, os.path.join(path, "model.safetensors"))
    with pytest.raises(ValueError, match=rf"{name}: awq tensors \['qzeros'\] are missing"):
        list(open_checkpoint(path).iter_weights(raw_gguf=True))
    bad = dict(tensors)
    bad[f"{name}.scales"] = bad[f"{name}.scales"][:, :8].contiguous()
    path = _with_config(src, tmp_path / "inconsistent")
    save_file(bad, os.path.join(path, "model.safetensors"))
    with pytest.raises(ValueError, match=rf"{name}: inconsistent awq tensors"):
        list(open_checkpoint(path).iter_weights(raw_gguf=True))

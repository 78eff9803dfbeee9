"""Quantized engines end to end on tiny checkpoints: packed GGUF weights equal the dequantized
ones (Q/K rows un-permuted alike), quantize-at-load of HF folders, the method choice, and the
fingerprint naming the runtime quantization."""
from __future__ import annotations

import json
import os

import gguf
import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.model.config import ModelConfig
from llmserve.model.executor.capture import LogitsCapture
from llmserve.model.layers.linear import DenseLinearMethod, Linear
from llmserve.model.loading.loader import load_model_config, open_checkpoint
from llmserve.model.native.ops import cpu_tier
from llmserve.model.quant import select_linear_method
from llmserve.model.quant.methods import GGUFLinearMethod, Int4LinearMethod, Int8LinearMethod
from llmserve.model.quant.native_int4 import native_int4_a8_available, native_int4_available
from llmserve.model.quant.native_int8 import native_int8_a8_available
from tests.model.tiny_checkpoints import make_tiny_checkpoint, make_tiny_gguf


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("qhf")), num_heads=4,
                                num_kv_heads=2, hidden=64, seed=3, tie=True)


@pytest.fixture(scope="module")
def tiny_q4(tiny_hf, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("qgguf") / "tiny.Q4_1.gguf")
    return make_tiny_gguf(tiny_hf, out, quant="Q4_1", embedding_quant="Q8_0",
                          with_tokenizer=True)


def engine(path: str, **kw) -> LLM:
    args = dict(num_kv_blocks=32, block_size=16, dtype="bfloat16")
    args.update(kw)
    return LLM(path, **args)


def effective_weights(layer: Linear) -> torch.Tensor:
    """The weight a layer multiplies with, read back through an identity product."""
    eye = torch.eye(layer.input_size, dtype=layer.dtype if hasattr(layer, "dtype") else
                    torch.float32)
    return layer(eye).float().T


def linears(llm: LLM) -> dict[str, Linear]:
    return {n: m for n, m in llm.engine.runner.model.named_modules() if isinstance(m, Linear)}


@pytest.mark.parametrize("activations", ["bf16", "int8"])
def test_packed_gguf_weights_equal_dequantized(tiny_q4, activations):
    if activations == "int8" and not native_int4_a8_available():
        pytest.skip("the int4 x int8 kernel needs AVX512-VNNI")
    packed = engine(tiny_q4, quantization="auto", int4_activations=activations)
    dense = engine(tiny_q4, quantization="none", dtype="float32")
    fmt = "int4-g32-a8" if activations == "int8" else "int4-g32"
    head = "int8-a8" if activations == "int8" and native_int8_a8_available() else "int8"
    assert packed.engine.runner.quantization == f"linear:{fmt}x8;embedding:{head}"
    assert dense.engine.runner.quantization == "linear:densex8;embedding:dense"
    dense_layers = linears(dense)
    for name, layer in linears(packed).items():
        want = effective_weights(dense_layers[name])   # float32: packed for f32_mm, exact
        got = effective_weights(layer)
        assert got.shape == want.shape
        # exact int4 up to bf16 (fp16) scales and a bf16 output: within 1% of the layer's
        # range (an identity row quantizes to int8 exactly)
        assert (got - want).abs().max() <= 0.01 * want.abs().max(), name
    emb_q = packed.engine.runner.model.embed_tokens
    emb_d = dense.engine.runner.model.embed_tokens
    ids = torch.arange(0, 49152, 97)
    table = emb_d(torch.arange(emb_d.shape[0]))   # float32: held as f32_mm strips if tied
    step = table.abs().amax(-1, keepdim=True)[ids] / 127
    assert ((emb_q(ids).float() - table[ids]).abs() <= step).all()   # int8 rows: < 1 step


def test_packed_gguf_logits_follow_dequantized(tiny_q4):
    prompt = [5, 17, 300, 42, 9, 1000, 77, 8, 12, 400]
    logits = {}
    for key, kw in {"packed": dict(quantization="auto"),
                    "dense": dict(quantization="none", dtype="float32")}.items():
        llm = engine(tiny_q4, **kw)
        runner = llm.engine.runner
        runner.capture = LogitsCapture.ALL
        inner, seen = runner.execute, []
        runner.execute = lambda step: seen.append(inner(step)) or seen[-1]
        out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))[0]
        logits[key] = seen[0].all_logits[out.request_id]
    p = torch.log_softmax(logits["dense"], -1)
    q = torch.log_softmax(logits["packed"], -1)
    kl = (p.exp() * (p - q)).sum(-1)
    assert kl.max() < 0.01, kl
    assert (logits["dense"].argmax(-1) == logits["packed"].argmax(-1)).float().mean() >= 0.8


@pytest.mark.parametrize("quantization,fmt", [("int8", "int8"), ("int4", "int4-g64")])
def test_hf_checkpoint_quantized_at_load(tiny_hf, quantization, fmt):
    llm = engine(tiny_hf, quantization=quantization, quantization_group_size=64)
    linear = f"{fmt}x8"
    if fmt.startswith("int4") and native_int4_a8_available():
        # --int4-activations auto: int8 where the kernel runs, but q/k/v (one of each
        # layer's four linears) keeps bf16 activations where the bf16 kernel runs
        linear = f"{fmt}x2,{fmt}-a8x6" if native_int4_available() else f"{fmt}-a8x8"
    assert llm.engine.runner.quantization == f"linear:{linear};embedding:dense"
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0,
                                                      ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4


def test_fingerprint_names_the_runtime_quantization(tiny_q4):
    prints = {q: engine(tiny_q4, quantization=q).engine.fingerprint
              for q in ("auto", "none", "int8")}
    assert len(set(prints.values())) == 3
    if native_int4_a8_available() and native_int4_available():
        # --int4-activations auto (q/k/v on bf16), int8 and bf16: three arithmetics
        acts = {a: engine(tiny_q4, int4_activations=a).engine.fingerprint
                for a in ("auto", "int8", "bf16")}
        assert len(set(acts.values())) == 3


def test_method_choice(tiny_hf, tiny_q4):
    cpu = torch.device("cpu")
    gguf_cfg = load_model_config(tiny_q4)
    hf_cfg = load_model_config(tiny_hf)
    bf16, fp32 = torch.bfloat16, torch.float32
    assert isinstance(select_linear_method("auto", 32, gguf_cfg, bf16, cpu), GGUFLinearMethod)
    # float32 dequantizes, except on the avx2 tier (its int8-activation kernels, no native bf16)
    fp32_packed = cpu_tier() == "avx2" and native_int4_a8_available()
    assert isinstance(select_linear_method("auto", 32, gguf_cfg, fp32, cpu),
                      GGUFLinearMethod if fp32_packed else DenseLinearMethod)
    assert isinstance(select_linear_method("auto", 32, hf_cfg, bf16, cpu), DenseLinearMethod)
    assert isinstance(select_linear_method("none", 32, gguf_cfg, bf16, cpu), DenseLinearMethod)
    assert isinstance(select_linear_method("int8", 32, hf_cfg, fp32, cpu), Int8LinearMethod)
    assert isinstance(select_linear_method("int4", 128, gguf_cfg, bf16, cpu), Int4LinearMethod)
    with pytest.raises(ValueError, match="CPU int4/int8 kernels"):
        select_linear_method("int4", 32, hf_cfg, bf16, torch.device("cuda"))
    assert isinstance(select_linear_method("auto", 32, gguf_cfg, bf16, torch.device("cuda")),
                      DenseLinearMethod)


def test_raw_gguf_iteration_keeps_dense_paths(tiny_q4):
    src = open_checkpoint(tiny_q4)
    raw = dict(src.iter_weights(raw_gguf=True))
    dense = dict(src.iter_weights())
    assert set(raw) == set(dense)
    q = raw["model.layers.0.self_attn.q_proj.weight"]
    assert q.qtype == gguf.GGMLQuantizationType.Q4_1
    deq = torch.from_numpy(q.dequantize())
    torch.testing.assert_close(deq, dense["model.layers.0.self_attn.q_proj.weight"])
    assert isinstance(raw["model.norm.weight"], torch.Tensor)


def test_prequantized_hf_checkpoint_error_names_what_is_supported(tiny_hf, tmp_path):
    import shutil

    path = str(tmp_path / "bnb")
    shutil.copytree(tiny_hf, path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match=r"bitsandbytes.*GPTQ and AWQ.*--quantization "
                                         r"int8\|int4.*GGUF"):
        load_model_config(path)


def test_model_config_type_is_unchanged():
    assert "quantization" in ModelConfig.__dataclass_fields__


def test_stats_and_metrics_state_weight_and_kv_bytes(tiny_q4):
    from llmserve.server.metrics.prometheus import EngineStatsCollector

    llm = engine(tiny_q4, quantization="auto", kv_cache_dtype="int8")
    stats = llm.engine.get_stats()
    runner = llm.engine.runner
    assert stats.weight_bytes == runner.weight_bytes > 0
    mc = llm.engine.model_config
    assert stats.kv_bytes_per_token == 2 * mc.num_hidden_layers * mc.num_key_value_heads * (
        mc.head_dim + 4)
    samples = {name: value for _, name, _, value in EngineStatsCollector._samples(stats)}
    assert samples["llmserve_model_weight_bytes"] == stats.weight_bytes
    assert samples["llmserve_kv_cache_bytes_per_token"] == stats.kv_bytes_per_token

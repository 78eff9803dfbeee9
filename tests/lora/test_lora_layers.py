"""LoraLinear over dense and packed bases; PEFT configs and files that are refused."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from llmserve.lora.layers import LoraLinear, LoraStepState
from llmserve.lora.registry import LoraError, LoraNotFound, parse_peft_config
from llmserve.model.layers.linear import DenseLinearMethod, Linear
from llmserve.model.quant.methods import Int4LinearMethod, Int8LinearMethod
from tests.lora.lora_helpers import edit_config, make_adapter, make_base

IN, OUTS, R = 64, [48, 16, 16], 4


def fused_layer(method) -> Linear:
    gen = torch.Generator().manual_seed(0)
    layer = Linear(IN, OUTS, bias=False, method=method, dtype=torch.float32,
                   device=torch.device("cpu"))
    for shard, rows in enumerate(OUTS):
        layer.load("weight", torch.randn(rows, IN, generator=gen) * 0.1, shard)
    layer.finish_loading()
    return layer


@pytest.mark.parametrize("products", ["native", "padded"])
@pytest.mark.parametrize("method", [DenseLinearMethod(prepack=False), Int8LinearMethod(),
                                    Int4LinearMethod(32)], ids=["dense", "int8", "int4"])
def test_delta_is_added_per_token_slot_over_any_base(method, products, monkeypatch):
    """Each slot's rows get its delta, base rows none, and every row the bits it has
    alone: through ``f32_mm`` where the tier has it, else PyTorch's padded GEMMs (the none
    tier)."""
    import llmserve.lora.layers as lora_layers

    if products == "padded":
        monkeypatch.setattr(lora_layers, "native_f32_available", lambda: False)
    elif not lora_layers.native_f32_available():
        pytest.skip("no f32_mm on this CPU tier")
    base = fused_layer(method)
    state = LoraStepState(2)
    lora = LoraLinear(base, state, num_slots=2, max_rank=8, dtype=torch.float32,
                      device=torch.device("cpu"))
    assert lora.native == (products == "native") and (lora.granule > 1) == (products == "padded")
    gen = torch.Generator().manual_seed(1)
    # slot 0: q and v shards (rank 4); slot 1: the k shard only (rank 8)
    a_q, b_q = torch.randn(R, IN, generator=gen), torch.randn(OUTS[0], R, generator=gen)
    a_v, b_v = torch.randn(R, IN, generator=gen), torch.randn(OUTS[2], R, generator=gen)
    a_k, b_k = torch.randn(8, IN, generator=gen), torch.randn(OUTS[1], 8, generator=gen)
    lora.set_shard(0, 0, a_q, b_q, 0.5)
    lora.set_shard(0, 2, a_v, b_v, 0.5)
    lora.set_shard(1, 1, a_k, b_k, 2.0)
    x = torch.randn(5, IN, generator=gen)
    slots = [0, 1, 2, 1, 0]                        # 0: base, 1: slot 0, 2: slot 1
    state.set(slots, [1] * 5, torch.device("cpu"))
    got = lora(x)
    want = base(x).clone()
    q, k, v = OUTS[0], OUTS[0] + OUTS[1], sum(OUTS)
    for t in (1, 3):
        want[t, :q] += 0.5 * (x[t] @ a_q.T @ b_q.T)
        want[t, k:v] += 0.5 * (x[t] @ a_v.T @ b_v.T)
    want[2, q:k] += 2.0 * (x[2] @ a_k.T @ b_k.T)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert [(slot, rows.tolist()) for slot, rows in state.groups] == [(0, [1, 3]), (1, [2])]
    # each token's row is the bits it has alone (one sequence of one token)
    for t, index in enumerate(slots):
        state.set([index], [1], torch.device("cpu"))
        assert torch.equal(lora(x[t:t + 1])[0], got[t]), t
    state.set([2, 2], [3, 2], torch.device("cpu"))   # slot 1 only
    assert [(slot, rows.tolist()) for slot, rows in state.groups] == [(1, [0, 1, 2, 3, 4])]
    want_k = base(x).clone()
    want_k[:, q:k] += 2.0 * (x @ a_k.T @ b_k.T)
    torch.testing.assert_close(lora(x), want_k, atol=1e-4, rtol=1e-4)
    state.set([0, 0], [3, 2], torch.device("cpu"))   # base only
    assert not state.active
    torch.testing.assert_close(lora(x), base(x))
    lora.clear_slot(0)
    state.set(slots, [1] * 5, torch.device("cpu"))
    torch.testing.assert_close(lora(x)[1], base(x)[1])


@pytest.mark.parametrize("change, message", [
    ({"use_dora": True}, "DoRA"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"peft_type": "IA3"}, "peft_type"),
    ({"target_modules": ["embed_tokens"]}, "not supported"),
    ({"target_modules": ".*proj"}, "regular expression"),
    ({"r": 0}, "positive integer"),
    ({"bias": "all"}, "biases"),
    ({"rank_pattern": {"q_proj": 8}}, "rank_pattern"),
])
def test_unsupported_peft_configs_are_refused(change, message):
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    cfg.update(change)
    with pytest.raises(LoraError, match=message):
        parse_peft_config(cfg)


def test_scaling_plain_and_rslora():
    cfg = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    assert parse_peft_config(cfg) == (4, 2.0, ("q_proj", "v_proj"))
    assert parse_peft_config({**cfg, "use_rslora": True})[1] == 4.0


def test_bad_adapter_folders_fail_clearly(tmp_path):
    from llmserve import LLM

    pytest.importorskip("peft")

    base = make_base(str(tmp_path / "base"))
    good = make_adapter(base, str(tmp_path / "good"), targets=["q_proj"])
    llm = LLM(base, num_kv_blocks=16, dtype="float32", max_loras=1, max_lora_rank=4)
    loras = llm.engine.loras
    with pytest.raises(LoraNotFound, match="does not exist"):
        loras.add("x", str(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(LoraNotFound, match="adapter_config.json"):
        loras.add("x", str(empty))
    big = make_adapter(base, str(tmp_path / "big"), r=8, targets=["q_proj"])
    with pytest.raises(LoraError, match="max-lora-rank"):
        loras.add("x", big)
    dora = str(tmp_path / "dora")
    shutil.copytree(good, dora)
    edit_config(dora, use_dora=True)
    with pytest.raises(LoraError, match="DoRA"):
        loras.add("x", dora)
    # an adapter for a model of another shape
    with pytest.raises(LoraError, match="the model's"):
        loras.add("x", _shrunk_adapter(good, str(tmp_path / "shrunk")))
    with pytest.raises(LoraError, match="base model's name"):
        loras.add(llm.engine.model_name, good)
    loras.add("good", good)
    with pytest.raises(LoraError, match="already loaded"):
        loras.add("good", good)


def _shrunk_adapter(src: str, dst: str) -> str:
    """A copy of ``src`` whose A matrices lost half their input columns."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    path = os.path.join(dst, "adapter_model.safetensors")
    tensors = {k: (v[:, : v.shape[1] // 2].contiguous() if "lora_A" in k else v)
               for k, v in load_file(path).items()}
    save_file(tensors, path)
    return dst


def test_config_needs_slots_for_start_up_adapters():
    from llmserve.config import EngineConfig

    with pytest.raises(ValueError, match="max_loras"):
        EngineConfig.from_kwargs(lora_modules=(("a", "/x"),))
    with pytest.raises(ValueError, match="max_lora_rank"):
        EngineConfig.from_kwargs(max_loras=1, max_lora_rank=0)
    with pytest.raises(ValueError, match="tensor-parallel-size"):
        EngineConfig.from_kwargs(max_loras=2, tensor_parallel_size=2)

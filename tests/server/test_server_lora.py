"""LoRA adapters over HTTP with the official openai client: served names, /v1/models,
load / unload (admin key under a gateway), tenants' allow-lists and clear errors."""
from __future__ import annotations

import os
import shutil
import uuid
from typing import Any, Iterator

import httpx
import openai
import pytest

from llmserve.gateway import hash_api_key
from tests.gateway.gateway_server_helpers import write_config
from tests.server.server_helpers import assert_openai_error, metric_value

pytest.importorskip("peft")

KEYS = {name: f"sk-{name}-" + uuid.uuid4().hex for name in ("alpha", "beta")}
ADMIN = "sk-admin-" + uuid.uuid4().hex
PROMPT = [5, 17, 300, 42, 9, 1000, 77]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.lora.lora_helpers import make_adapter_set

    root = tmp_path_factory.mktemp("srv_lora")
    base, a, b = make_adapter_set(str(root))
    dora = str(root / "dora")
    shutil.copytree(b, dora)
    from tests.lora.lora_helpers import edit_config
    edit_config(dora, use_dora=True)
    return base, a, b, dora


@pytest.fixture(scope="module")
def broken_adapters(tiny, tmp_path_factory) -> dict[str, str]:
    """Copies of adapter b that must be refused at load: a NaN or huge lora_alpha, NaN or
    infinite weights."""
    import safetensors.torch

    from tests.lora.lora_helpers import edit_config

    root = tmp_path_factory.mktemp("broken_lora")
    out = {}
    for name, alpha in (("alpha_nan", float("nan")), ("alpha_huge", 1e308)):
        out[name] = str(root / name)
        shutil.copytree(tiny[2], out[name])
        edit_config(out[name], lora_alpha=alpha)
    for name, bad in (("weights_nan", float("nan")), ("weights_inf", float("inf"))):
        out[name] = str(root / name)
        shutil.copytree(tiny[2], out[name])
        file = os.path.join(out[name], "adapter_model.safetensors")
        tensors = safetensors.torch.load_file(file)
        key = sorted(tensors)[0]
        tensors[key] = tensors[key].clone()
        tensors[key].view(-1)[3] = bad
        safetensors.torch.save_file(tensors, file)
    return out


@pytest.fixture(scope="module")
def engine(tiny) -> Iterator[Any]:
    from llmserve.async_llm import AsyncLLM
    from llmserve.config import EngineConfig

    config = EngineConfig.from_kwargs(model=tiny[0], dtype="float32", num_kv_blocks=64, max_num_seqs=8,
                          max_loras=2, lora_modules=(("a", tiny[1]),))
    eng = AsyncLLM.from_config(config)
    yield eng
    eng.shutdown()


def complete(client: openai.OpenAI, model: str, max_tokens: int = 6, **kw: Any) -> Any:
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens,
                                     temperature=0, **kw)


def test_adapters_are_served_model_names(engine, tiny, start_server):
    live = start_server(engine, served_model_names=["base"])
    client = openai.OpenAI(base_url=live.url("/v1"), api_key="unused", max_retries=0)
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"base", "a"}
    assert cards["a"].parent == "base" and cards["a"].root == cards["base"].root
    base_out, a_out = complete(client, "base"), complete(client, "a")
    assert a_out.model == "a" and base_out.model == "base"
    assert a_out.system_fingerprint != base_out.system_fingerprint
    assert a_out.choices[0].text != base_out.choices[0].text
    # load b at run time, use it, unload it
    r = httpx.post(live.url("/v1/load_lora_adapter"), json={"lora_name": "b",
                                                             "lora_path": tiny[2]}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["content_hash"] and r.json()["rank"] == 8
    assert "b" in {m.id for m in client.models.list().data}
    assert complete(client, "b").model == "b"
    r = httpx.post(live.url("/v1/unload_lora_adapter"), json={"lora_name": "b"}, timeout=60)
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError):
        complete(client, "b")
    assert "b" not in {m.id for m in client.models.list().data}


def test_bad_requests_get_openai_errors(engine, tiny, start_server):
    live = start_server(engine, served_model_names=["base"])
    client = openai.OpenAI(base_url=live.url("/v1"), api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        complete(client, "no-such-model")

    def load(body: dict) -> httpx.Response:
        return httpx.post(live.url("/v1/load_lora_adapter"), json=body, timeout=60)

    assert_openai_error(load({"lora_name": "x", "lora_path": tiny[0] + "/nowhere"}), 404,
                        param="lora_path", code="lora_not_found")
    err = assert_openai_error(load({"lora_name": "x", "lora_path": tiny[0]}), 404,
                              code="lora_not_found")
    assert "adapter_config.json" in err["message"]
    err = assert_openai_error(load({"lora_name": "x", "lora_path": tiny[3]}), 400,
                              code="invalid_lora")
    assert "DoRA" in err["message"]
    assert_openai_error(load({"lora_name": "x"}), 400, param="lora_path")
    for bad_name in ("bad\nname", "x y", "", "-dash", "n" * 129, "café"):
        assert_openai_error(load({"lora_name": bad_name, "lora_path": tiny[2]}), 400,
                            param="lora_name")
    assert_openai_error(load({"lora_name": "a", "lora_path": tiny[1]}), 400,
                        code="lora_name_taken")
    assert_openai_error(httpx.post(live.url("/v1/unload_lora_adapter"),
                                   json={"lora_name": "base"}, timeout=60), 404,
                        code="lora_not_found")


def test_broken_adapters_are_refused_at_load_and_nothing_changes(engine, tiny, broken_adapters,
                                                                 start_server):
    """NaN/huge alpha and NaN/inf weights: 400 invalid_lora with the reason, the adapter is
    not served, and the server keeps answering its other models."""
    live = start_server(engine, served_model_names=["base"])
    client = openai.OpenAI(base_url=live.url("/v1"), api_key="unused", max_retries=0)
    before = complete(client, "a").choices[0].text
    reasons = {"alpha_nan": "finite", "alpha_huge": "scaling", "weights_nan": "NaN or infinite",
               "weights_inf": "NaN or infinite"}
    for name, path in broken_adapters.items():
        r = httpx.post(live.url("/v1/load_lora_adapter"),
                       json={"lora_name": name, "lora_path": path}, timeout=60)
        err = assert_openai_error(r, 400, code="invalid_lora")
        assert reasons[name] in err["message"], (name, err)
        with pytest.raises(openai.NotFoundError):
            complete(client, name)
    assert complete(client, "a").choices[0].text == before


def test_unloading_an_adapter_in_use_is_refused(engine, tiny, start_server):
    live = start_server(engine, served_model_names=["base"])
    client = openai.OpenAI(base_url=live.url("/v1"), api_key="unused", max_retries=0)
    stream = client.completions.create(model="a", prompt=PROMPT, max_tokens=400,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))   # the request is running under "a"
    r = httpx.post(live.url("/v1/unload_lora_adapter"), json={"lora_name": "a"}, timeout=60)
    stream.close()
    assert_openai_error(r, 409, code="lora_in_use")
    assert complete(client, "a").model == "a"


def test_gateway_admin_key_and_tenant_allow_lists(engine, tiny, start_server, tmp_path):
    from llmserve.gateway.build import build_gateway

    config = write_config(tmp_path, {"alpha": {"models": ["base", "a", "alpha-*"]},
                                     "beta": {"models": ["base"]}}, KEYS,
                          admin={"keys": [hash_api_key(ADMIN)]})
    gateway = build_gateway(str(config), engine, served_model_names=["base"])
    live = start_server(engine, served_model_names=["base"], gateway=gateway)
    alpha = openai.OpenAI(base_url=live.url("/v1"), api_key=KEYS["alpha"], max_retries=0)
    beta = openai.OpenAI(base_url=live.url("/v1"), api_key=KEYS["beta"], max_retries=0)
    assert complete(alpha, "a").model == "a"
    with pytest.raises(openai.PermissionDeniedError):
        complete(beta, "a")
    body = {"lora_name": "alpha-b", "lora_path": tiny[2]}
    url = live.url("/v1/load_lora_adapter")
    assert_openai_error(httpx.post(url, json=body, timeout=60), 401)
    assert_openai_error(httpx.post(url, json=body, timeout=60,
                                   headers={"Authorization": f"Bearer {KEYS['alpha']}"}),
                        403, code="admin_key_required")
    r = httpx.post(url, json=body, timeout=60, headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200, r.text
    assert complete(alpha, "alpha-b").model == "alpha-b"
    with pytest.raises(openai.PermissionDeniedError):
        complete(beta, "alpha-b")
    r = httpx.post(live.url("/v1/unload_lora_adapter"), json={"lora_name": "alpha-b"},
                   timeout=60, headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError):
        complete(alpha, "alpha-b")


def test_an_engine_without_lora_says_how_to_enable_it(tiny, start_server):
    from llmserve.async_llm import AsyncLLM
    from llmserve.config import EngineConfig

    plain = AsyncLLM.from_config(EngineConfig.from_kwargs(model=tiny[0], dtype="float32", num_kv_blocks=16))
    try:
        live = start_server(plain, served_model_names=["base"])
        r = httpx.post(live.url("/v1/load_lora_adapter"),
                       json={"lora_name": "a", "lora_path": tiny[1]}, timeout=60)
        err = assert_openai_error(r, 400, code="invalid_lora")
        assert "--max-loras" in err["message"]
        client = openai.OpenAI(base_url=live.url("/v1"), api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["base"]
    finally:
        plain.shutdown()


def test_a_release_canary_can_be_an_adapter(engine, tiny, start_server, tmp_path):
    """Releases point at served names, adapters included: a canary on an adapter loaded at
    run time carries the adapter's content hash in its identity, and the split reaches both."""
    from llmserve.gateway.build import build_gateway

    config = write_config(tmp_path, {"alpha": {"models": ["*"]}}, KEYS | {"beta": "x"},
                          admin={"keys": [hash_api_key(ADMIN)]},
                          releases={"tuned": {
                              "stable": "v1", "canary": {"release": "v2", "share": 0.5},
                              "versions": {"v1": {"target": "base"},
                                           "v2": {"target": "late"}}}})
    gateway = build_gateway(str(config), engine, served_model_names=["base"])
    live = start_server(engine, served_model_names=["base"], gateway=gateway)
    admin = {"Authorization": f"Bearer {ADMIN}"}
    r = httpx.post(live.url("/v1/load_lora_adapter"), json={"lora_name": "late",
                                                             "lora_path": tiny[2]},
                   headers=admin, timeout=60)
    assert r.status_code == 200, r.text
    content_hash = r.json()["content_hash"]
    client = openai.OpenAI(base_url=live.url("/v1"), api_key=KEYS["alpha"], max_retries=0)
    seen: dict[str, set] = {}
    try:
        for _ in range(8):
            raw = client.completions.with_raw_response.create(
                model="tuned", prompt=PROMPT, max_tokens=4, temperature=0)
            out = raw.parse()
            seen.setdefault(raw.headers["x-llmserve-release"], set()).add(
                (out.model, raw.headers["x-llmserve-release-fingerprint"], out.choices[0].text))
        assert set(seen) == {"v1", "v2"}
        assert {m for m, _, _ in seen["v1"]} == {"base"}
        assert {m for m, _, _ in seen["v2"]} == {"late"}
        assert len(seen["v1"]) == len(seen["v2"]) == 1   # one identity, one greedy answer each
        assert next(iter(seen["v1"]))[1:] != next(iter(seen["v2"]))[1:]
        status = httpx.get(live.url("/admin/releases"), headers=admin, timeout=30)
        assert status.status_code == 200, status.text
        releases = {rid: rel for model in status.json()["data"]
                    for rid, rel in model["releases"].items()}
        assert releases["v2"]["identity"]["adapter"] == content_hash
        assert releases["v1"]["identity"]["adapter"] is None
    finally:
        httpx.post(live.url("/v1/unload_lora_adapter"), json={"lora_name": "late"},
                   headers=admin, timeout=60)


@pytest.fixture(scope="module")
def overflowing_adapter(tiny, tmp_path_factory) -> str:
    """Adapter a with finite but huge weights: it passes the load checks, and its delta
    overflows to inf (then NaN) at run time."""
    import safetensors.torch

    path = str(tmp_path_factory.mktemp("overflow_lora") / "overflow")
    shutil.copytree(tiny[1], path)
    file = os.path.join(path, "adapter_model.safetensors")
    tensors = {k: v.sign() * 1e30 for k, v in safetensors.torch.load_file(file).items()}
    safetensors.torch.save_file(tensors, file)
    return path


def test_nan_at_run_time_fails_only_its_request_with_one_rerun(engine, tiny, overflowing_adapter,
                                                               start_server):
    """An adapter whose output overflows loads (its weights are finite), then each request
    to it fails alone with a 500 that says why; requests sharing its steps keep their
    tokens, and each failed step is re-run once, not bisected."""
    import threading

    live = start_server(engine, served_model_names=["base"])
    client = openai.OpenAI(base_url=live.url("/v1"), api_key="unused", max_retries=0)
    r = httpx.post(live.url("/v1/load_lora_adapter"),
                   json={"lora_name": "overflow", "lora_path": overflowing_adapter}, timeout=60)
    assert r.status_code == 200, r.text
    try:
        long = {"max_tokens": 40, "extra_body": {"ignore_eos": True}}
        alone = {m: complete(client, m, **long).choices[0].text for m in ("base", "a")}
        metrics0 = httpx.get(live.url("/metrics"), timeout=30).text
        texts: dict[str, str] = {}
        started = threading.Barrier(3)

        def stream(model: str) -> None:
            chunks = complete(client, model, stream=True, **long)
            parts = []
            for i, chunk in enumerate(chunks):
                if i == 1:
                    started.wait(timeout=60)
                parts.append(chunk.choices[0].text)
            texts[model] = "".join(parts)

        threads = [threading.Thread(target=stream, args=(m,)) for m in ("base", "a")]
        for t in threads:
            t.start()
        started.wait(timeout=60)   # both streams are decoding: the bad request joins them
        with pytest.raises(openai.InternalServerError) as info:
            complete(client, "overflow")
        for t in threads:
            t.join(timeout=120)
        assert "NaN or infinite logits" in str(info.value)
        assert texts == alone
        metrics1 = httpx.get(live.url("/metrics"), timeout=30).text
        errors = (metric_value(metrics1, "llmserve_step_errors_total")
                  - metric_value(metrics0, "llmserve_step_errors_total"))
        reruns = (metric_value(metrics1, "llmserve_step_reruns_total")
                  - metric_value(metrics0, "llmserve_step_reruns_total"))
        assert errors >= 1 and reruns == errors
    finally:
        httpx.post(live.url("/v1/unload_lora_adapter"), json={"lora_name": "overflow"}, timeout=60)

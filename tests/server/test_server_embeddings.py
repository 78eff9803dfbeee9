"""POST /v1/embeddings on a live server over real engines (a tiny random Llama built here),
driven with the official ``openai`` client: vectors equal transformers' pooling of the
same weights (last / mean / cls, normalized), token-id inputs, base64, ``dimensions``,
the errors, the gateway hooks and billing, and embeddings mixed with generation in one
engine leaving its greedy tokens unchanged and no KV block behind."""
from __future__ import annotations

import base64
import struct
import threading
from typing import Any

import httpx
import openai
import pytest
import torch

from llmserve.async_llm import AsyncLLM
from llmserve.config import EngineConfig
from llmserve.contract.errors import OpenAIError
from llmserve.contract.gateway_hook import Gateway, RequestContext, RequestOutcome
from tests.model.tiny_checkpoints import make_tiny_checkpoint
from tests.server.server_helpers import assert_openai_error, metric_value, wait_idle

HIDDEN = 64
MAX_LEN = 64
TEXTS = ["The quick brown fox jumps over the lazy dog, again and again and again, until "
         "the dog finally gets up and walks away from the fox.", "hello", "Embeddings!"]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("embed")), arch="llama",
                                hidden=HIDDEN, num_heads=4, num_kv_heads=2, seed=11)


@pytest.fixture(scope="module")
def engines(tiny_path):
    """One engine per pooling method; small prefill chunks so long inputs span steps."""
    built = {}
    for method in ("last", "mean", "cls"):
        built[method] = AsyncLLM.from_config(EngineConfig.from_kwargs(
            model=tiny_path, dtype="float32", num_kv_blocks=64, block_size=4, device="cpu",
            max_model_len=MAX_LEN, max_num_batched_tokens=32, max_prefill_tokens_per_step=12,
            pooling=method))
    yield built
    for eng in built.values():
        eng.shutdown()


@pytest.fixture(scope="module")
def server(engines):
    from tests.server.conftest import LiveServer

    live = LiveServer(engines["last"], served_model_names=["tiny-last"],
                      engines={"tiny-mean": engines["mean"], "tiny-cls": engines["cls"]}).start()
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(tiny_path):
    """transformers' final hidden states (after the final norm) of some token ids."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(tiny_path, dtype=torch.float32).eval()

    def hidden(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).last_hidden_state[0]
    return hidden


def pooled(hidden: torch.Tensor, method: str, normalize: bool = True) -> torch.Tensor:
    vec = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[method]
    return torch.nn.functional.normalize(vec, dim=0) if normalize else vec


def close(got: Any, want: torch.Tensor, tol: float = 1e-4) -> bool:
    return torch.allclose(torch.tensor(got, dtype=torch.float32), want, atol=tol, rtol=0)


@pytest.mark.parametrize("method", ["last", "mean", "cls"])
def test_vectors_equal_transformers_pooling(method, client, engines, reference):
    tok = engines[method].tokenizer
    ids = [tok.encode(t, add_special_tokens=True) for t in TEXTS]
    assert len(ids[0]) > 12   # spans several prefill chunks
    # the client asks for base64 by default and decodes it
    resp = client.embeddings.create(model=f"tiny-{method}", input=TEXTS)
    assert resp.object == "list" and resp.model == f"tiny-{method}"
    assert [d.index for d in resp.data] == [0, 1, 2]
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == sum(map(len, ids))
    for d, one in zip(resp.data, ids):
        assert len(d.embedding) == HIDDEN
        assert close(d.embedding, pooled(reference(one), method))


def test_token_ids_float_and_base64_agree(client, reference):
    ids = [[5, 600, 7000, 42], [9, 9, 9]]
    floats = client.embeddings.create(model="tiny-mean", input=ids, encoding_format="float")
    one = client.embeddings.create(model="tiny-mean", input=ids[1], encoding_format="float")
    for d, i in zip(floats.data, ids):
        assert close(d.embedding, pooled(reference(i), "mean"))
    # alone or batched: equal up to float rounding (the matmuls' row count differs)
    assert close(one.data[0].embedding, torch.tensor(floats.data[1].embedding), 1e-5)
    raw = client.embeddings.with_raw_response.create(
        model="tiny-mean", input=ids, encoding_format="base64").http_response.json()
    for d, f in zip(raw["data"], floats.data):
        data = base64.b64decode(d["embedding"])
        assert struct.unpack(f"<{len(data) // 4}f", data) == tuple(
            struct.unpack(f"<{HIDDEN}f", struct.pack(f"<{HIDDEN}f", *f.embedding)))


def test_dimensions_cut_then_renormalize(client, engines, reference):
    ids = engines["last"].tokenizer.encode(TEXTS[0], add_special_tokens=True)
    resp = client.embeddings.create(model="tiny-last", input=TEXTS[0], dimensions=8,
                                    encoding_format="float")
    vec = torch.tensor(resp.data[0].embedding)
    assert vec.shape == (8,) and abs(float(vec.norm()) - 1) < 1e-5
    want = torch.nn.functional.normalize(reference(ids)[-1][:8], dim=0)
    assert close(resp.data[0].embedding, want)


def test_vllm_extensions_normalize_and_truncate(client, reference):
    ids = list(range(100, 140))
    raw = client.embeddings.create(model="tiny-cls", input=ids, encoding_format="float",
                                   extra_body={"normalize": False})
    assert close(raw.data[0].embedding, pooled(reference(ids), "cls", normalize=False))
    cut = client.embeddings.create(model="tiny-mean", input=[ids], encoding_format="float",
                                   extra_body={"truncate_prompt_tokens": 10})
    assert cut.usage.prompt_tokens == 10
    assert close(cut.data[0].embedding, pooled(reference(ids[-10:]), "mean"))


@pytest.mark.parametrize("body, status, param, code", [
    ({"input": ""}, 400, "input", None),
    ({"input": []}, 400, "input", None),
    ({"input": ["ok", ""]}, 400, "input", None),
    ({"input": [[1, 2], []]}, 400, "input", None),
    ({"input": [1, 10**6]}, 400, "input", None),
    ({"input": [-1]}, 400, "input", None),
    ({"input": ["x"] * 2049}, 400, "input", "too_many_items"),
    ({"input": list(range(1, MAX_LEN + 2))}, 400, "input", "context_length_exceeded"),
    ({"input": "x", "dimensions": 0}, 400, "dimensions", None),
    ({"input": "x", "dimensions": HIDDEN + 1}, 400, "dimensions", None),
    ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format", None),
    ({"input": 5}, 400, "input", None),
    ({"input": "x", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens", None),
    ({"input": "x", "model": "nope"}, 404, "model", "model_not_found"),
])
def test_errors(server, body, status, param, code):
    resp = httpx.post(server.url("/v1/embeddings"), json=body, timeout=30)
    assert_openai_error(resp, status, param=param, code=code)


def test_a_full_context_input_is_accepted(client):
    resp = client.embeddings.create(model="tiny-last", input=list(range(1, MAX_LEN + 1)))
    assert resp.usage.prompt_tokens == MAX_LEN


def test_the_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model="tiny-last", input="")
    assert err.value.body["param"] == "input"


def test_embeddings_beside_generation_change_no_token_and_leak_no_block(server, client,
                                                                         engines):
    def generate(prompt: str) -> list[str]:
        out = client.completions.create(model="tiny-last", prompt=prompt, max_tokens=12,
                                        temperature=0, extra_body={"ignore_eos": True})
        return [c.text for c in out.choices]

    prompts = ["one two three", "a b c d e f g h i j k"]
    alone = [generate(p) for p in prompts]
    results: dict[str, Any] = {}

    def gen_worker(i: int) -> None:
        results[f"g{i}"] = generate(prompts[i])

    def embed_worker(i: int) -> None:
        results[f"e{i}"] = client.embeddings.create(model="tiny-last", input=TEXTS * 2)

    threads = [threading.Thread(target=gen_worker, args=(i,)) for i in range(2)]
    threads += [threading.Thread(target=embed_worker, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [results["g0"], results["g1"]] == alone
    first = torch.tensor([d.embedding for d in results["e0"].data])
    assert all(close([d.embedding for d in results[f"e{i}"].data], first, 1e-5)
               for i in (1, 2))
    engine = engines["last"]
    wait_idle(engine)
    core = engine.engine
    assert core.kv.num_used_blocks == 0 and not core.scheduler.requests
    assert core.runner.pooler.num_pending == 0
    core.check_invariants()
    metrics = server.metrics_text()
    assert metric_value(metrics, "llmserve_embedding_inputs_total") >= 18
    assert metric_value(metrics, "llmserve_http_requests_total", endpoint="embeddings",
                        status_class="2xx") >= 3


class RecordingGateway(Gateway):
    """Records the hooks an embeddings request calls; refuses the key "bad"."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.outcomes: list[RequestOutcome] = []
        self.admitted: list[RequestContext] = []

    async def authenticate(self, ctx: RequestContext) -> None:
        self.calls.append(f"authenticate:{ctx.endpoint}")
        if ctx.headers.get("authorization") == "Bearer bad":
            raise OpenAIError(401, "bad key", code="invalid_api_key")
        ctx.tenant = "t"

    async def preadmit(self, ctx: RequestContext) -> None:
        self.calls.append("preadmit")

    async def prepare(self, ctx: RequestContext) -> None:
        self.calls.append("prepare")

    async def admit(self, ctx: RequestContext) -> None:
        self.calls.append("admit")
        self.admitted.append(ctx)

    async def on_complete(self, ctx: RequestContext, outcome: RequestOutcome) -> None:
        self.calls.append("on_complete")
        self.outcomes.append(outcome)

    async def on_reject(self, ctx: RequestContext, error: BaseException) -> None:
        self.calls.append("on_reject")


def test_gateway_hooks_and_billing(engines, start_server):
    gateway = RecordingGateway()
    live = start_server(engines["last"], gateway=gateway)
    name = engines["last"].model_name
    client = openai.OpenAI(base_url=live.url("/v1"), api_key="good", max_retries=0, timeout=60)
    resp = client.embeddings.create(model=name, input=["hello", "world peace"])
    assert gateway.calls == ["authenticate:embeddings", "preadmit", "prepare", "admit",
                             "on_complete"]
    ctx = gateway.admitted[0]
    assert ctx.max_tokens == 0 and ctx.num_choices == 2
    assert ctx.prompt_tokens == resp.usage.prompt_tokens
    usage = gateway.outcomes[0].usage
    assert usage.prompt_tokens == resp.usage.prompt_tokens and usage.completion_tokens == 0
    assert gateway.outcomes[0].status == "completed" and gateway.outcomes[0].started
    gateway.calls.clear()
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=name, input="x", dimensions=10**4)
    assert gateway.calls == ["authenticate:embeddings", "preadmit", "prepare", "on_reject"]
    bad = openai.OpenAI(base_url=live.url("/v1"), api_key="bad", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError):
        bad.embeddings.create(model=name, input="x")


def test_an_engine_without_embeddings_answers_400(fake_server):
    resp = httpx.post(fake_server.url("/v1/embeddings"), json={"input": "hi"}, timeout=30)
    assert_openai_error(resp, 400, param="model", code="embeddings_not_supported")


def test_a_lora_adapter_view_does_not_offer_the_base_models_embeddings(engines):
    from llmserve.contract.engine_client import EmbeddingEngine
    from llmserve.server.lora_adapters import LoraModelView

    base = engines["last"]
    view = LoraModelView(base, base.model_name, {"name": "a", "system_fingerprint": "fp"})
    assert isinstance(base, EmbeddingEngine) and not isinstance(view, EmbeddingEngine)

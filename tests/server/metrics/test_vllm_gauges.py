"""/metrics carries vLLM's gauge names (the inference-gateway contract) with the values of
llmserve's own series, scraped from a real server on a tiny random checkpoint."""
from __future__ import annotations

import threading
from typing import Iterator

import httpx
import pytest

from llmserve.protocol import EngineStats
from llmserve.server.metrics.vllm_names import VllmFamilies
from tests.server.conftest import LiveServer
from tests.server.server_helpers import metric_samples, metric_value, wait_until

PAIRS = [("vllm:num_requests_waiting", "llmserve_num_requests_waiting"),
         ("vllm:num_requests_running", "llmserve_num_requests_running"),
         ("vllm:kv_cache_usage_perc", "llmserve_kv_cache_usage_ratio")]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    from llmserve.async_llm import AsyncLLM
    from llmserve.config import EngineConfig
    from tests.model.tiny_checkpoints import make_tiny_checkpoint

    path = make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny") / "m"))
    engine = AsyncLLM.from_config(EngineConfig.from_kwargs(
        model=path, device="cpu", num_kv_blocks=64, block_size=8, max_num_seqs=1,
        max_model_len=256, enforce_eager=True, num_threads=1))
    server = LiveServer(engine, served_model_names=["tiny"]).start()
    yield server
    server.stop()
    engine.shutdown()


def _same_values(text: str) -> None:
    for vllm_name, own in PAIRS:
        assert metric_value(text, vllm_name, model_name="tiny") == metric_value(text, own), vllm_name


def test_vllm_gauges_equal_llmserve_gauges_while_requests_run_and_queue(live: LiveServer) -> None:
    body = {"model": "tiny", "prompt": [5, 6, 7, 8, 9], "max_tokens": 120, "ignore_eos": True}
    threads = [threading.Thread(target=httpx.post, args=(live.url("/v1/completions"),),
                                kwargs={"json": body, "timeout": 120}) for _ in range(3)]
    for t in threads:
        t.start()
    busy: list[str] = []

    def one_waits() -> bool:   # max_num_seqs=1: one runs, the others queue
        text = live.metrics_text()
        if metric_value(text, "llmserve_num_requests_waiting") >= 1:
            busy.append(text)
            return True
        return False

    assert wait_until(one_waits, 60)
    text = busy[-1]
    _same_values(text)
    assert metric_value(text, "vllm:num_requests_running", model_name="tiny") == 1
    assert metric_value(text, "vllm:num_requests_waiting", model_name="tiny") >= 1
    assert 0 < metric_value(text, "vllm:kv_cache_usage_perc", model_name="tiny") <= 1
    for t in threads:
        t.join(120)
    _same_values(live.metrics_text())


def test_cache_config_info_names_the_pool(live: LiveServer) -> None:
    samples = metric_samples(live.metrics_text())
    info = [(dict(lbls), v) for (name, lbls), v in samples.items()
            if name == "vllm:cache_config_info"]
    assert info == [({"model_name": "tiny", "block_size": "8", "num_gpu_blocks": "64"}, 1.0)]
    assert metric_value(live.metrics_text(), "llmserve_kv_cache_blocks_total") == 64
    # no LoRA slots: no LoRA info series
    assert not any(name == "vllm:lora_requests_info" for name, _ in samples)


def test_lora_info_labels_running_and_waiting_adapters() -> None:
    fams = VllmFamilies()
    fams.add(EngineStats(max_loras=4, lora_running=["a", "b"], lora_waiting=["c"],
                         kv_blocks_total=10, kv_blocks_used=5), "m", now=123.0)
    lora = [f for f in fams if f.name == "vllm:lora_requests_info"][0]
    (sample,) = lora.samples
    assert sample.labels == {"model_name": "m", "max_lora": "4",
                             "running_lora_adapters": "a,b", "waiting_lora_adapters": "c"}
    assert sample.value == 123.0
    usage = [f for f in fams if f.name == "vllm:kv_cache_usage_perc"][0]
    assert usage.samples[0].value == 0.5

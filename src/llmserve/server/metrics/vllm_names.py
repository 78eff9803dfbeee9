"""vLLM-named engine gauges, for the Kubernetes Gateway API Inference Extension (no torch).

The inference gateway's endpoint picker (llm-d, KServe, AIBrix) scrapes model-server pods
for gauges with vLLM's names. These read the same ``EngineStats`` snapshot as llmserve's
own series (so their values are equal at any scrape), one series per served engine, with
vLLM's ``model_name`` label::

    vllm:num_requests_waiting          = llmserve_num_requests_waiting
    vllm:num_requests_running          = llmserve_num_requests_running
    vllm:kv_cache_usage_perc  (0..1)   = llmserve_kv_cache_usage_ratio
    vllm:cache_config_info{block_size,num_gpu_blocks} = 1
    vllm:lora_requests_info{max_lora,running_lora_adapters,waiting_lora_adapters}
                                       = the scrape's Unix time (as vLLM: the newest wins)

The table with sources is in docs/METRICS.md ("vLLM-named gauges").
"""
from __future__ import annotations

import time
from typing import Any, Iterator, Optional

from prometheus_client.core import GaugeMetricFamily

MODEL_LABEL = "model_name"

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"
CACHE_CONFIG = "vllm:cache_config_info"
LORA_INFO = "vllm:lora_requests_info"

_CACHE_LABELS = [MODEL_LABEL, "block_size", "num_gpu_blocks"]
_LORA_LABELS = [MODEL_LABEL, "max_lora", "running_lora_adapters", "waiting_lora_adapters"]


class VllmFamilies:
    """The vLLM-named families of one scrape; :meth:`add` one engine's stats at a time."""

    def __init__(self) -> None:
        self.waiting = GaugeMetricFamily(
            WAITING, "Requests queued in the engine (= llmserve_num_requests_waiting)",
            labels=[MODEL_LABEL])
        self.running = GaugeMetricFamily(
            RUNNING, "Requests in the running batch (= llmserve_num_requests_running)",
            labels=[MODEL_LABEL])
        self.kv_usage = GaugeMetricFamily(
            KV_USAGE, "KV-cache usage, 0-1 (= llmserve_kv_cache_usage_ratio)",
            labels=[MODEL_LABEL])
        self.cache_config = GaugeMetricFamily(
            CACHE_CONFIG, "KV-cache configuration in labels (value 1)", labels=_CACHE_LABELS)
        self.lora = GaugeMetricFamily(
            LORA_INFO, "LoRA slots and the adapters of running / queued requests in labels "
            "(value: the scrape's Unix time)", labels=_LORA_LABELS)

    def add(self, stats: Any, model_name: str, now: Optional[float] = None) -> None:
        """One engine's series from its ``EngineStats`` snapshot."""
        total = stats.kv_blocks_total
        self.waiting.add_metric([model_name], stats.num_waiting)
        self.running.add_metric([model_name], stats.num_running)
        self.kv_usage.add_metric([model_name], (stats.kv_blocks_used / total) if total else 0.0)
        block_size = getattr(stats, "block_size", 0)
        self.cache_config.add_metric([model_name, str(block_size), str(total)], 1.0)
        max_loras = getattr(stats, "max_loras", 0)
        if max_loras:
            self.lora.add_metric(
                [model_name, str(max_loras), ",".join(getattr(stats, "lora_running", ())),
                 ",".join(getattr(stats, "lora_waiting", ()))],
                time.time() if now is None else now)

    def __iter__(self) -> Iterator[GaugeMetricFamily]:
        yield from (self.waiting, self.running, self.kv_usage, self.cache_config)
        if self.lora.samples:
            yield self.lora

"""What this machine offers: device, native bf16, and the dtype choices that follow.

CPU features are read at run time (never assumed): the machines this runs on range from
AVX2-only to AVX-512 with bf16 and AMX.
"""
from __future__ import annotations

import functools
import logging
import os
import threading
import time

import torch

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of /proc/cpuinfo (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_native_bf16() -> bool:
    """AVX512_BF16 or AMX-BF16: bf16 matrix products run natively (false where
    ``LLMSERVE_CPU_ISA`` forces a tier below bf16, so a forced ``avx2`` run resolves
    ``--dtype auto`` as an AVX2-only CPU does)."""
    forced = os.environ.get("LLMSERVE_CPU_ISA", "auto").strip().lower().replace("-", "_")
    if forced in ("avx2", "none"):
        return False
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return dev


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bf16 on CUDA and on CPUs with native bf16, float32 otherwise."""
    if name == "auto":
        if device.type == "cuda" or cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of float32, bfloat16, float16")
    return _DTYPES[name]


def resolve_kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """``auto``: the model's dtype; ``int8`` / ``fp8_e4m3``: a quantized cache
    (llmserve.model.quant.kv)."""
    if name == "auto":
        return model_dtype
    if name in ("int8", "fp8_e4m3"):
        from llmserve.model.quant.kv import KV_QUANT_DTYPES

        if name not in KV_QUANT_DTYPES:
            raise ValueError(f"kv cache dtype {name} needs a torch with float8_e4m3fn")
        return KV_QUANT_DTYPES[name]
    return resolve_dtype(name, torch.device("cpu"))


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(8 * 2**30)


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def exit_with_parent(parent_pid: int, code: int = 1) -> None:
    """End this process (exit ``code``) once the process that started it is gone: a
    spawned helper (a tensor-parallel rank, a background compile) never outlives it."""
    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(code)
            time.sleep(1.0)

    threading.Thread(target=watch, name="llmserve-parent-watch", daemon=True).start()

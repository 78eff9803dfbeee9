import pytest

from llmserve.engine.core import EngineCore
from llmserve.engine.kv.kv_cache_manager import KVCacheManager
from llmserve.engine.output.processor import OutputProcessor
from llmserve.engine.scheduler import Scheduler, SchedulerConfig
from tests.engine.fake_runner import CharTokenizer, FakeRunner

BLOCK = 4


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make_core(num_blocks=64, caching=True, clock=None, **sched_kwargs) -> EngineCore:
    """An engine core on a fake runner; ``core.schedules`` records every SchedulerOutput."""
    kv = KVCacheManager(num_blocks, BLOCK, enable_prefix_caching=caching, fingerprint="test")
    extra = {k: sched_kwargs.pop(k) for k in ("max_loras", "admission_watermark_blocks")
             if k in sched_kwargs}   # the scheduler's own arguments, not config
    sched = Scheduler(SchedulerConfig(**sched_kwargs), kv, clock=clock or Clock(), **extra)
    core = EngineCore(sched, FakeRunner(block_size=BLOCK), OutputProcessor(CharTokenizer()),
                      check_invariants=True)
    core.schedules = []
    inner = sched.schedule

    def schedule():
        out = inner()
        core.schedules.append(out)
        return out

    sched.schedule = schedule
    return core


@pytest.fixture
def clock():
    return Clock()

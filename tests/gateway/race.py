"""Running one worker on several threads at once, for the gateway's concurrency tests."""
from __future__ import annotations

import threading
from typing import Callable


def run_racing(num_threads: int, worker: Callable[[int], None]) -> None:
    """Call ``worker(i)`` for i in 0..num_threads-1, each on its own thread, all released
    together by a barrier; returns when every thread has finished."""
    barrier = threading.Barrier(num_threads)

    def start_together(i: int) -> None:
        barrier.wait()
        worker(i)

    threads = [threading.Thread(target=start_together, args=(i,)) for i in range(num_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

"""The server process freezes what it holds at start (server/launch.py): a full garbage
collection then scans only objects made later, and garbage made before is collected first,
not frozen. Run in a child interpreter: freezing is process-wide."""
from __future__ import annotations

import subprocess
import sys

_CHILD = """
import gc, weakref
from llmserve.server.launch import freeze_long_lived_objects

class Node:
    pass

kept = [Node() for _ in range(1000)]     # long-lived: the engine, its model, ...
cycle = Node(); cycle.self = cycle       # garbage in a reference cycle, not yet collected
dead = weakref.ref(cycle); del cycle
gc.disable()                             # only the call under test may collect
freeze_long_lived_objects()
assert dead() is None, "garbage made before the freeze was frozen, not collected"
assert gc.get_freeze_count() >= 1000, gc.get_freeze_count()
tracked = len(gc.get_objects())
assert tracked < gc.get_freeze_count() // 10, (tracked, gc.get_freeze_count())
print("ok", gc.get_freeze_count(), tracked)
"""


def test_freezing_keeps_live_objects_out_of_full_collections_and_collects_garbage_first():
    done = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok")

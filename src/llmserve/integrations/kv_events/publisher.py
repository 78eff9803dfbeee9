"""Publish KV events over ZMQ PUB as vLLM's msgpack ``KVEventBatch`` (off the engine thread).

The engine thread only appends a step's events to a queue (`publish`); a daemon thread
encodes and sends them. Every message is three frames, as vLLM's ``ZmqEventPublisher``::

    [topic (utf-8), sequence number (8 bytes, big-endian, from 0), msgpack payload]

The payload is vLLM's ``array_like`` msgspec encoding::

    KVEventBatch      [ts (float, Unix seconds), [event, ...], data_parallel_rank]
    BlockStored       ["BlockStored", [hash, ...], parent hash | nil, [token id, ...],
                       block_size, lora_id | nil, medium, lora_name | nil]
    BlockRemoved      ["BlockRemoved", [hash, ...], medium]
    AllBlocksCleared  ["AllBlocksCleared"]

With ``replay_endpoint``, a ROUTER socket answers a request frame holding a start
sequence number (8 bytes, big-endian) with every kept batch from there on, each as
``[seq, payload]``, then ``[-1 (8 bytes, signed), b""]``.

pyzmq and msgpack are optional (``pip install llmserve[kv-events]``); asking for events
without them is a clear error at start-up.
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from typing import Any, Optional

from llmserve.engine.kv.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from llmserve.integrations.kv_events.config import KVEventsConfig

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def event_array(event: Any) -> list[Any]:
    """One event as vLLM's tagged array."""
    if isinstance(event, BlockStored):
        return ["BlockStored", event.block_hashes, event.parent_block_hash, event.token_ids,
                event.block_size, event.lora_id, event.medium, event.lora_name]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", event.block_hashes, event.medium]
    if isinstance(event, AllBlocksCleared):
        return ["AllBlocksCleared"]
    raise TypeError(f"not a KV event: {event!r}")


def _import_deps() -> tuple[Any, Any]:
    try:
        import msgpack
        import zmq
    except ImportError as exc:
        raise ValueError("--kv-events-config asks for KV events, which need pyzmq and msgpack: "
                         "pip install 'llmserve[kv-events]'") from exc
    return zmq, msgpack


class ZmqKVEventPublisher:
    """A PUB socket fed by a queue and a daemon thread (see the module docstring)."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        zmq, msgpack = _import_deps()
        self.config = config
        self.hashing = config.hashing
        self.data_parallel_rank = data_parallel_rank
        self._pack = msgpack.Packer(use_bin_type=True)
        self._queue: queue.Queue[Optional[tuple[float, list[Any]]]] = queue.Queue(
            maxsize=config.max_queue_size)
        self._kept: collections.deque[tuple[int, bytes]] = collections.deque(
            maxlen=config.buffer_steps)
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        ep = config.endpoint
        if "*" in ep or "::" in ep or ep.startswith(("ipc://", "inproc://")):
            self._pub.bind(ep)
        else:
            self._pub.connect(ep)
        self._replay = None
        if config.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(config.replay_endpoint)
        self.num_dropped = 0
        self._topic = config.topic.encode()
        self._thread = threading.Thread(target=self._run, name="llmserve-kv-events", daemon=True)
        self._thread.start()
        logger.info("KV events: publishing on %s (topic %r, block hashes: %s)", ep, config.topic,
                    config.block_hash)

    def publish(self, events: list[Any]) -> None:
        """Queue one step's events (never blocks: a full queue drops the batch, logged)."""
        if not events:
            return
        try:
            self._queue.put_nowait((time.time(), events))
        except queue.Full:
            self.num_dropped += 1
            logger.warning("KV events: publisher queue full, %d batch(es) dropped", self.num_dropped)

    def _run(self) -> None:
        seq = 0
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                return
            ts, events = item
            try:
                payload = self._pack.pack(
                    [ts, [event_array(e) for e in events], self.data_parallel_rank])
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._kept.append((seq, payload))
                seq += 1
            except Exception:  # noqa: BLE001 - a bad batch must not stop the thread
                logger.exception("KV events: could not publish a batch")

    def _serve_replay(self) -> None:
        if self._replay is None:
            return
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("KV events: malformed replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._kept):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

    def shutdown(self, timeout: float = 2.0) -> None:
        """Send what is queued (up to ``timeout``), then close the sockets."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        self._pub.close(linger=int(timeout * 1000))
        if self._replay is not None:
            self._replay.close(linger=0)


def build_publisher(config_text: Optional[str], data_parallel_rank: int = 0
                    ) -> Optional[ZmqKVEventPublisher]:
    """The publisher of ``--kv-events-config`` (None when the config leaves events off)."""
    if not config_text:
        return None
    config = KVEventsConfig.parse(config_text)
    if not config.enabled:
        return None
    return ZmqKVEventPublisher(config, data_parallel_rank)

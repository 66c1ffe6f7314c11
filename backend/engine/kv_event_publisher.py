"""Publishes KV-cache events on ZMQ in vLLM's wire format (docs/scaling.md, "KV-cache events").

The engine thread only puts event objects on ``queue`` (backend/core/kv_events.py). A thread
of this module takes everything queued so far as one batch, encodes it and sends it as three
frames: the topic, an 8-byte big-endian sequence number (per batch, from 0, without gaps),
and the msgpack batch ``[ts, [event, ...], data_parallel_rank]``.

The last ``buffer_steps`` batches are kept for replay: a subscriber that missed some sends
the first sequence number it wants (8 bytes, big-endian) to the replay socket, a ROUTER,
and gets back ``[seq, payload]`` for every kept batch from there on, then ``[-1, b""]``.
A second thread serves replays, so that the publisher thread sleeps on the queue alone and
an idle engine wakes neither (but for the first seconds below).

Until the engine has stored its first block, every subscription that reaches the PUB socket
(an XPUB, which reports them) is answered with an ``AllBlocksCleared`` batch: a replica that
restarted on the same endpoint tells a router that kept its blocks from before the restart
(Dynamo's relay reconnects by itself) that it holds none of them. Sent at start it would be
lost, as no subscriber is connected yet; once blocks are stored it would be wrong. Meanwhile
the publisher thread looks for subscriptions every ``SUBSCRIPTION_POLL_S``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import msgpack
import zmq

from backend.config import EngineConfig
from backend.core.kv_cache_manager import KVCacheManager
from backend.core.kv_events import AllBlocksCleared, BlockStored, KVCacheEvent, KVEventsConfig, Publisher, record_events

logger = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
_STOP = object()          # closes the publisher thread once everything before it is sent
SUBSCRIPTION_POLL_S = 0.1   # how often, before the first stored block, subscriptions are looked for


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        """Opens the sockets here, so that a bad or busy endpoint fails the engine's start."""
        self.queue: queue.SimpleQueue[KVCacheEvent | object] = queue.SimpleQueue()
        self.data_parallel_rank = data_parallel_rank
        self.num_batches = 0                  # batches sent = the next sequence number
        self.stored_any = False               # whether a BlockStored was sent (module docstring)
        self._topic = config.topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._buffer_lock = threading.Lock()  # the replay thread copies what the publisher appends
        self._context = zmq.Context()
        self._replay: zmq.Socket | None = None
        try:
            self._pub = self._context.socket(zmq.XPUB)   # a PUB that reports subscriptions
            self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)       # every one, not just a topic's first
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.setsockopt(zmq.SNDHWM, config.hwm)
            (self._pub.bind if config.binds else self._pub.connect)(config.endpoint)
            self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)   # the port a "*" got
            self.replay_endpoint: str | None = None
            if config.replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self._context.destroy(linger=0)
            raise RuntimeError(f"KV-cache events: cannot open {config.endpoint} / {config.replay_endpoint}: {exc}") \
                from exc
        self._closed = False
        self._thread = threading.Thread(target=self._publish_loop, name="kv-events-publisher", daemon=True)
        self._thread.start()
        self._replay_thread: threading.Thread | None = None
        if self._replay is not None:
            self._replay_thread = threading.Thread(target=self._replay_loop, name="kv-events-replay", daemon=True)
            self._replay_thread.start()
        logger.info("KV-cache events: %s %s, replay %s, topic %r", "bound at" if config.binds else "connected to",
                    self.endpoint, self.replay_endpoint or "off", config.topic)

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued, then close the sockets and end both threads."""
        if self._closed:
            return
        self._closed = True
        self.queue.put(_STOP)
        self._thread.join(timeout)
        if self._thread.is_alive():     # term() would wait for its socket forever; the daemon dies with us
            logger.warning("KV-cache events: the publisher thread did not stop within %.1f s", timeout)
            return
        # Ends the replay thread's wait (ETERM) once the publisher's socket is closed.
        self._context.term()
        if self._replay_thread is not None:
            self._replay_thread.join(timeout)

    # ---- the publisher thread ------------------------------------------------------------------
    def _publish_loop(self) -> None:
        try:
            stopping = False
            while not stopping:
                events: list[KVCacheEvent] = []
                if self.stored_any:
                    item = self.queue.get()
                else:
                    try:
                        item = self.queue.get(timeout=SUBSCRIPTION_POLL_S)
                    except queue.Empty:
                        self._answer_subscriptions()
                        continue
                    self._answer_subscriptions()
                while True:
                    if item is _STOP:
                        stopping = True
                        break
                    events.append(item)       # type: ignore[arg-type]
                    try:
                        item = self.queue.get_nowait()
                    except queue.Empty:
                        break
                if events:
                    self._send(events)
        finally:
            self._pub.close(linger=0)

    def _answer_subscriptions(self) -> None:
        """An ``AllBlocksCleared`` batch if a subscription arrived since the last look (called
        only before the first stored block: the module docstring says why)."""
        subscribed = False
        while self._pub.poll(0):
            frame = self._pub.recv()
            subscribed |= frame[:1] == b"\x01"      # 1 + topic: subscribe; 0 + topic: unsubscribe
        if subscribed:
            self._send([AllBlocksCleared()])

    def _send(self, events: list[KVCacheEvent]) -> None:
        try:
            payload = msgpack.packb([time.time(), [event.to_wire() for event in events], self.data_parallel_rank])
        except Exception:  # noqa: BLE001 - a batch that cannot be encoded is lost, not the thread
            logger.exception("KV-cache events: could not encode a batch of %d events", len(events))
            return
        seq = self.num_batches
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        except zmq.ZMQError:
            # The sequence number is spent: subscribers see the gap and can ask for a replay.
            logger.exception("KV-cache events: sending batch %d failed", seq)
        with self._buffer_lock:
            self._buffer.append((seq, payload))
        self.num_batches = seq + 1
        self.stored_any = self.stored_any or any(isinstance(event, BlockStored) for event in events)

    # ---- the replay thread ---------------------------------------------------------------------
    def _replay_loop(self) -> None:
        assert self._replay is not None
        try:
            while True:
                try:
                    frames = self._replay.recv_multipart()
                except zmq.ContextTerminated:
                    return
                if len(frames) != 3 or len(frames[2]) != 8:
                    logger.warning("KV-cache events: ignoring a malformed replay request (%d frames)", len(frames))
                    continue
                client, delimiter, start = frames
                first = int.from_bytes(start, "big")
                with self._buffer_lock:
                    kept = [(seq, payload) for seq, payload in self._buffer if seq >= first]
                for seq, payload in kept:
                    self._replay.send_multipart((client, delimiter, seq.to_bytes(8, "big"), payload))
                self._replay.send_multipart((client, delimiter, END_OF_REPLAY, b""))
        except zmq.ContextTerminated:
            return
        finally:
            self._replay.close(linger=0)


def start_kv_events(config: EngineConfig, kv_cache: KVCacheManager) -> ZmqEventPublisher | None:
    """The publisher of ``kv_cache``'s events, or None when events are off or go nowhere."""
    events = KVEventsConfig.from_engine_config(config)
    if not events.enable_kv_cache_events or events.publisher is Publisher.NULL:
        return None
    publisher = ZmqEventPublisher(events)
    record_events(kv_cache, publisher.queue.put)
    return publisher

"""KV-cache events (backend/core/kv_events.py, backend/engine/kv_event_publisher.py) against a
ZMQ subscriber, and fed to NVIDIA Dynamo's own indexer (docs/scaling.md, "KV-cache events").

The engine publishes on 127.0.0.1 ports ZMQ picks ("*"). A subscriber's subscription takes
a moment to reach the publisher, and what is published before that is not delivered (ZMQ's
"slow joiner"): each subscriber first resets the prefix cache until it sees the
AllBlocksCleared that the reset publishes, and counts from there.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import hypothesis.strategies as st
import msgpack
import pytest
import zmq
from hypothesis import settings
from hypothesis.stateful import initialize, rule

from backend import Engine, EngineConfig, SamplingParams
from backend.core.kv_cache_utils import hash_block, request_block_hashes
from backend.core.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, KVEventsConfig,
                                    external_hash, record_events)
from backend.core.request import Request
from backend.lora.synthetic import model_with_adapters
from server.launch import free_ports
from tests.conftest import FIXED_BUDGET, REPO_ROOT
from tests.test_kv_cache_properties import VOCAB, KVCacheMachine

BLOCK = 16
TOPIC = "kv@127.0.0.1:8001@llm"        # llm-d's convention: kv@<pod>@<model>
QUIET_S = 0.5                          # a stream silent this long has delivered what was published
EVENTS = dict(enable_kv_cache_events=True, kv_events_endpoint="tcp://127.0.0.1:*",
              kv_events_replay_endpoint="tcp://127.0.0.1:*", kv_events_topic=TOPIC)
GREEDY_ONE = SamplingParams(max_tokens=1, temperature=0.0)
ADAPTER = "tenant-adapter"


@dataclass
class Message:
    topic: bytes
    seq: int
    ts: float
    events: list[list[Any]]
    rank: int

    @classmethod
    def decode(cls, frames: list[bytes]) -> "Message":
        topic, seq, payload = frames
        ts, events, rank = msgpack.unpackb(payload)     # a positional batch, or this fails
        assert all(isinstance(event, list) for event in events), "events must be positional arrays"
        return cls(topic, int.from_bytes(seq, "big"), ts, events, rank)


class Subscriber:
    def __init__(self, endpoint: str, topic: bytes = b"") -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)
        self.socket.setsockopt(zmq.SUBSCRIBE, topic)

    def receive(self, quiet: float = QUIET_S) -> list[Message]:
        """Every message until none arrives for ``quiet`` seconds."""
        messages = []
        while self.socket.poll(int(quiet * 1000)):
            messages.append(Message.decode(self.socket.recv_multipart()))
        return messages

    def close(self) -> None:
        self.context.destroy(linger=0)


def subscribe(engine: Engine) -> tuple[Subscriber, list[Message]]:
    """A subscriber that receives everything from now on, and the messages of its handshake."""
    subscriber = Subscriber(engine.kv_events.endpoint)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        engine.kv_cache.reset_prefix_cache()
        handshake = subscriber.receive(quiet=0.2)
        if any(event[0] == "AllBlocksCleared" for m in handshake for event in m.events):
            return subscriber, handshake
    pytest.fail("the subscriber never received the engine's events")


def events_of(messages: list[Message], tag: str | None = None) -> list[list[Any]]:
    return [event for m in messages for event in m.events if tag is None or event[0] == tag]


def wire_hashes(prompt: list[int], salt: str | None = None) -> list[int]:
    """The published hashes of the prompt's full blocks: the engine's own chained sha256 block
    hashes (backend/core/kv_cache_utils.py), each reduced to its last 8 bytes."""
    request = Request(request_id="expected", prompt_token_ids=prompt, sampling_params=SamplingParams(cache_salt=salt),
                      arrival_seq=0, arrival_time=0.0, max_tokens=1, eos_token_ids=frozenset())
    return [external_hash(h) for h in request_block_hashes(request, BLOCK)]


def cached_wire_hashes(engine: Engine) -> set[int]:
    return {external_hash(b.block_hash) for b in engine.kv_cache.pool.blocks if b.block_hash is not None}


def assert_gap_free(messages: list[Message]) -> None:
    seqs = [m.seq for m in messages]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs


def replay(endpoint: str, first: int) -> list[tuple[int, bytes]]:
    """Ask the replay socket for every kept batch from ``first`` on (as vLLM's clients do)."""
    context = zmq.Context()
    try:
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint)
        dealer.send_multipart([b"", first.to_bytes(8, "big")])
        batches = []
        while True:
            assert dealer.poll(10_000), "no answer from the replay socket"
            delimiter, seq, payload = dealer.recv_multipart()
            assert delimiter == b""
            if int.from_bytes(seq, "big", signed=True) == -1:
                assert payload == b""
                return batches
            batches.append((int.from_bytes(seq, "big"), payload))
    finally:
        context.destroy(linger=0)


# ---- the recorder under random interleavings, without a model or a socket --------------------

class KVCacheEventsMachine(KVCacheMachine):
    """tests/test_kv_cache_properties.py's machine (admission with prefix hits, chunked
    prefill, decodes, preemption, finishing), with a recorder attached, and with resets and
    requests freed between their step's scheduling and its forward pass added. After every
    operation the events so far, applied in order, hold exactly the hashes the pool caches;
    no block is stored twice or removed unheld; and every stored block's hash is the chain of
    its published tokens on its published parent."""

    @initialize(block_size=st.integers(1, 4), num_blocks=st.integers(1, 12),
                enable_caching=st.sampled_from([True, True, True, False]))
    def setup(self, block_size: int, num_blocks: int, enable_caching: bool) -> None:
        super().setup(block_size, num_blocks, enable_caching)
        self.events: list[KVCacheEvent] = []
        self.applied = 0
        self.held: set[bytes] = set()
        record_events(self.kv, self.events.append)

    @rule()
    def reset(self) -> None:
        self.kv.reset_prefix_cache()
        self._check_all()

    @rule(data=st.data())
    def preempt_before_its_step(self, data: st.DataObject) -> None:
        """Preempted (or failed) once its step was scheduled, before the step ran: the blocks
        that step was to fill are freed unwritten, and their prefix-cache entries dropped."""
        if not self.live:
            return self.add_request(data)
        request = self.live[data.draw(st.sampled_from(list(self.live)), label="running")]
        if request.num_computed_tokens == request.num_tokens:
            request.append_token(data.draw(VOCAB, label="sampled"))
        num_new = data.draw(st.integers(1, request.num_tokens - request.num_computed_tokens), label="num_new")
        if self._allocate(request, num_new, []):
            del self.live[request.request_id]
            self._free(request)
            request.num_computed_tokens = 0
            self.waiting[request.request_id] = request
        self._check_all()

    def _check_all(self, settled: bool = True) -> None:
        super()._check_all(settled)
        size = self.kv.block_size
        for event in self.events[self.applied:]:
            if isinstance(event, BlockStored):
                assert event.block_size == size and len(event.token_ids) == size * len(event.block_hashes)
                assert not self.held & set(event.block_hashes), "a block was stored twice"
                parent = event.parent_block_hash
                for i, block_hash in enumerate(event.block_hashes):
                    parent = hash_block(parent, event.token_ids[i * size:(i + 1) * size])
                    assert parent == block_hash, "a stored hash is not the chain of its tokens"
                self.held |= set(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= self.held, "a removal names a block not held"
                self.held -= set(event.block_hashes)
            else:
                assert isinstance(event, AllBlocksCleared)
                self.held.clear()
            msgpack.packb(event.to_wire())
        self.applied = len(self.events)
        assert self.held == {b.block_hash for b in self.kv.pool.blocks if b.block_hash is not None}


TestKVCacheEventsMachine = KVCacheEventsMachine.TestCase
TestKVCacheEventsMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


# ---- one engine with events on, and subscribers ------------------------------------------------

@pytest.fixture(scope="module")
def engine(model_dir: Path, tmp_path_factory) -> Iterator[Engine]:
    """One replica with events on, 16 KV blocks of 16 tokens (two 100-token prompts fill it),
    and one LoRA adapter."""
    folder = model_with_adapters(model_dir, tmp_path_factory.mktemp("kv-events-model"),
                                 {ADAPTER: (8, 16, ("q_proj", "v_proj"), 1)})
    engine = Engine(EngineConfig(model=str(folder), **FIXED_BUDGET, num_kv_blocks=16, **EVENTS))
    yield engine
    engine.kv_events.close()


@pytest.fixture
def subscriber(engine: Engine) -> Iterator[Subscriber]:
    subscriber, _ = subscribe(engine)
    yield subscriber
    subscriber.close()


def test_a_prompt_and_a_second_sharing_its_prefix(engine: Engine, subscriber: Subscriber,
                                                  prose_ids: list[int]) -> None:
    """A 100-token prompt's six full blocks arrive in order, chained; a second prompt sharing
    its first 64 tokens adds only its own two blocks, parented on the fourth shared block."""
    first = prose_ids[:100]
    engine.generate([first], GREEDY_ONE)
    messages = subscriber.receive()
    stored = events_of(messages)
    assert [event[0] for event in stored] == ["BlockStored"], stored
    tag, hashes, parent, token_ids, block_size, lora_id, medium, lora_name = stored[0]
    assert (parent, block_size, lora_id, medium, lora_name) == (None, BLOCK, None, "GPU", None)
    assert token_ids == first[:96]
    assert hashes == wire_hashes(first)[:6]
    assert all(0 <= h < 2 ** 64 for h in hashes)
    assert set(hashes) == cached_wire_hashes(engine)
    assert all(m.topic == TOPIC.encode() and m.rank == 0 for m in messages)

    second = first[:64] + prose_ids[300:336]
    assert second[64:80] != first[64:80]
    output = engine.generate([second], GREEDY_ONE)[0]
    assert output.num_cached_tokens == 64
    later = subscriber.receive()
    assert events_of(later) == [["BlockStored", wire_hashes(second)[4:6], hashes[3], second[64:96], BLOCK,
                                 None, "GPU", None]]
    assert_gap_free(messages + later)


def test_generated_tokens_fill_blocks_that_are_published(engine: Engine, subscriber: Subscriber,
                                                         prose_ids: list[int]) -> None:
    prompt = prose_ids[500:530]
    output = engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    tokens = prompt + output.token_ids
    stored = events_of(subscriber.receive())
    assert [event[0] for event in stored] == ["BlockStored", "BlockStored"]
    assert stored[0][3] == tokens[:16] and stored[0][2] is None
    # The second block holds two generated tokens: stored once its last token's K/V was written.
    assert stored[1][3] == tokens[16:32] and stored[1][2] == stored[0][1][-1]
    assert stored[1][1] == wire_hashes(tokens)[1:2]


def test_evictions_are_removals_and_the_stream_mirrors_the_cache(engine: Engine, subscriber: Subscriber,
                                                                 prose_ids: list[int]) -> None:
    """Prompts enough to evict each other: every removal names a block the stream had stored,
    and at the end what the stream says is cached is exactly what the pool caches, minus the
    salted request's blocks, which are never published, stored or removed (docs/scaling.md).
    The salted prompt repeats an unsalted one: same tokens, other blocks."""
    prompts = [prose_ids[100 * i + 1:100 * i + 101] for i in range(4)]
    salted = prompts[0]
    engine.generate([prompts[0], prompts[1]], GREEDY_ONE)
    output = engine.generate([salted], SamplingParams(max_tokens=1, temperature=0.0, cache_salt="tenant-a"))[0]
    assert output.num_cached_tokens == 0
    engine.generate([prompts[2]], GREEDY_ONE)
    engine.generate([prompts[3]], GREEDY_ONE)
    messages = subscriber.receive()
    assert_gap_free(messages)

    held: set[int] = set()
    removed = 0
    for event in events_of(messages):
        if event[0] == "BlockStored":
            assert not held & set(event[1]), "a block was stored twice"
            assert event[2] is None or event[2] in held, "a stored block's parent is not held"
            held |= set(event[1])
        else:
            assert event[0] == "BlockRemoved" and event[2] == "GPU", event
            assert set(event[1]) <= held, "a removal names a block never stored"
            held -= set(event[1])
            removed += len(event[1])
    assert removed >= 8, "16 blocks cannot hold five 100-token prompts: some must have been evicted"
    salted_hashes = set(wire_hashes(salted, salt="tenant-a"))
    assert not salted_hashes & set(wire_hashes(salted)), "the salt must change the hashes"
    assert not salted_hashes & held
    cached = cached_wire_hashes(engine)
    assert held == cached - salted_hashes
    assert held, "the last prompt's blocks are cached"


def test_reset_clears_all_and_blocks_are_stored_again(engine: Engine, subscriber: Subscriber,
                                                      prose_ids: list[int]) -> None:
    prompt = prose_ids[700:740]
    engine.generate([prompt], GREEDY_ONE)
    engine.kv_cache.reset_prefix_cache()
    engine.generate([prompt], GREEDY_ONE)
    events = events_of(subscriber.receive())
    stored = ["BlockStored", wire_hashes(prompt), None, prompt[:32], BLOCK, None, "GPU", None]
    assert events == [stored, ["AllBlocksCleared"], stored]


def test_lora_blocks_name_their_adapter(engine: Engine, subscriber: Subscriber, prose_ids: list[int]) -> None:
    prompt = prose_ids[800:834]
    params = SamplingParams(max_tokens=1, temperature=0.0, lora_name=ADAPTER)
    engine.generate([prompt], params)
    engine.generate([prompt], GREEDY_ONE)
    adapter, base = events_of(subscriber.receive())
    assert adapter[0] == base[0] == "BlockStored" and adapter[3] == base[3] == prompt[:32]
    assert adapter[7] == ADAPTER and adapter[5] == engine.loras.resolve(ADAPTER).lora_id
    assert base[5] is None and base[7] is None
    assert not set(adapter[1]) & set(base[1]), "an adapter's blocks are other blocks than the base model's"


def test_replay_returns_what_a_subscriber_missed(engine: Engine, subscriber: Subscriber,
                                                 prose_ids: list[int]) -> None:
    engine.generate([prose_ids[900:940]], GREEDY_ONE)
    seen = subscriber.receive()
    last_seen = seen[-1].seq
    subscriber.close()                        # gone for a while; another one stays
    other, _ = subscribe(engine)
    try:
        engine.generate([prose_ids[950:990]], GREEDY_ONE)
        engine.generate([prose_ids[1200:1240]], GREEDY_ONE)
        missed = other.receive()
    finally:
        other.close()
    assert len(events_of(missed, "BlockStored")) == 2
    replayed = replay(engine.kv_events.replay_endpoint, last_seen + 1)
    # Everything after the last seen batch, the other subscriber's handshake resets included.
    assert [seq for seq, _ in replayed] == list(range(last_seen + 1, engine.kv_events.num_batches))
    by_seq = {seq: Message.decode([TOPIC.encode(), seq.to_bytes(8, "big"), payload]) for seq, payload in replayed}
    for message in missed:
        assert by_seq[message.seq].events == message.events
    # From 0: the batches published before any subscriber had joined are kept too.
    assert [seq for seq, _ in replay(engine.kv_events.replay_endpoint, 0)][:1] == [0]


def test_replay_keeps_the_last_buffer_steps_batches() -> None:
    from backend.engine.kv_event_publisher import ZmqEventPublisher

    publisher = ZmqEventPublisher(KVEventsConfig(True, endpoint="tcp://127.0.0.1:*",
                                                 replay_endpoint="tcp://127.0.0.1:*", buffer_steps=3))
    try:
        for i in range(5):
            publisher.queue.put(BlockRemoved((i.to_bytes(32, "big"),)))
            deadline = time.monotonic() + 10
            while publisher.num_batches <= i and time.monotonic() < deadline:
                time.sleep(0.01)
        replayed = replay(publisher.replay_endpoint, 0)
    finally:
        publisher.close()
    assert [seq for seq, _ in replayed] == [2, 3, 4]
    assert [msgpack.unpackb(payload)[1] for _, payload in replayed] == \
        [[["BlockRemoved", [i], "GPU"]] for i in (2, 3, 4)]


def test_until_a_block_is_stored_each_subscription_gets_a_clear() -> None:
    """A replica that (re)started on an endpoint answers each subscription with AllBlocksCleared
    until it stores its first block, so a subscriber that kept the blocks of its previous life
    (libzmq reconnects a SUB by itself) drops them; afterwards a new subscription gets nothing
    (the replica holds blocks: a clear would be wrong)."""
    from backend.engine.kv_event_publisher import ZmqEventPublisher

    stored = BlockStored((b"\x01" * 32,), None, list(range(BLOCK)), BLOCK, None, None)
    publisher = ZmqEventPublisher(KVEventsConfig(True, endpoint="tcp://127.0.0.1:*"))
    port = publisher.endpoint.rsplit(":", 1)[1]
    first = second = None
    try:
        first = Subscriber(publisher.endpoint)
        assert [(m.seq, m.events) for m in first.receive()] == [(0, [["AllBlocksCleared"]])]
        publisher.queue.put(stored)
        assert [(m.seq, m.events[0][0]) for m in first.receive()] == [(1, "BlockStored")]
        second = Subscriber(publisher.endpoint)
        assert second.receive() == [] and first.receive() == []
        # The replica restarts on the same port; the first subscriber reconnects by itself.
        publisher.close()
        publisher = ZmqEventPublisher(KVEventsConfig(True, endpoint=f"tcp://*:{port}"))
        received = first.receive(quiet=2.0)
        assert received and all(m.events == [["AllBlocksCleared"]] for m in received)
        assert received[0].seq == 0
        assert_gap_free(received)
    finally:
        publisher.close()
        for subscriber in (first, second):
            if subscriber is not None:
                subscriber.close()


def test_off_by_default_starts_nothing(model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                       prose_ids: list[int]) -> None:
    import backend.engine.kv_event_publisher as publisher_module

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a publisher was started with events off")

    monkeypatch.setattr(publisher_module, "ZmqEventPublisher", refuse)
    assert EngineConfig().enable_kv_cache_events is False
    before = set(threading.enumerate())      # other tests' engines may publish
    engine = Engine(EngineConfig(model=str(model_dir), **FIXED_BUDGET, num_kv_blocks=16))
    engine.generate([prose_ids[:40]], GREEDY_ONE)
    assert engine.kv_events is None and engine.kv_cache.pool.events is None
    assert not [t.name for t in set(threading.enumerate()) - before if t.name.startswith("kv-events")]


def test_published_hashes_are_the_last_8_bytes_of_the_chain_hash() -> None:
    digest = bytes(range(1, 33))
    assert external_hash(digest) == int.from_bytes(digest[24:], "big") == 0x191A1B1C1D1E1F20
    assert external_hash(b"\xff" * 32) == 2 ** 64 - 1        # unsigned: msgpack's uint64


def test_config_takes_vllm_spelling_as_engine_parameters() -> None:
    config = EngineConfig.from_dict({"enable_kv_cache_events": "true", "kv_events_endpoint": "tcp://10.0.0.9:5557",
                                     "kv_events_replay_endpoint": "tcp://*:5558", "kv_events_buffer_steps": "64",
                                     "kv_events_hwm": "1000", "kv_events_topic": TOPIC})
    events = KVEventsConfig.from_engine_config(config)
    assert (events.endpoint, events.replay_endpoint, events.buffer_steps, events.hwm, events.topic) == \
        ("tcp://10.0.0.9:5557", "tcp://*:5558", 64, 1000, TOPIC)
    assert not events.binds           # a concrete host: connect to a subscriber that binds (llm-d)
    assert KVEventsConfig(True, endpoint="tcp://*:5557").binds and KVEventsConfig(True, endpoint="ipc:///tmp/kv").binds
    for bad in ({"kv_events_endpoint": "localhost:5557"}, {"kv_events_publisher": "nats"},
                {"enable_kv_cache_events": "true", "enable_prefix_caching": "false"}):
        with pytest.raises(ValueError, match="kv_events|enable_kv_cache_events"):
            EngineConfig.from_dict(bad)


# ---- NVIDIA Dynamo's indexer, in its own virtual environment (make setup-dynamo) ---------------

DYNAMO_PYTHON = REPO_ROOT / ".venv-dynamo" / "bin" / "python"


def dynamo_python() -> Path:
    """Dynamo's runtime is a peer of ours, not a dependency: a missing or broken virtual
    environment is a failure that names the target that builds it (make test runs it)."""
    if not DYNAMO_PYTHON.is_file():
        pytest.fail(f"{DYNAMO_PYTHON} is missing: run `make setup-dynamo` (make test does it)")
    check = subprocess.run([str(DYNAMO_PYTHON), "-c", "import dynamo.llm"], capture_output=True, text=True)
    if check.returncode != 0:
        pytest.fail(f"{DYNAMO_PYTHON} cannot import dynamo.llm ({check.stderr.strip()[-300:]}): "
                    "run `make setup-dynamo` again")
    return DYNAMO_PYTHON


class DynamoIndexer:
    """``python -m dynamo.indexer``: subscribes to the ZMQ stream of each worker registered
    with it (POST /register, with the replay socket it asks for missed batches), and answers
    POST /query with each worker's overlap, in tokens (matched blocks x block size)."""

    def __init__(self, log: Path) -> None:
        self.port = free_ports(1)[0]   # below the ephemeral range (server/launch.py)
        self.log = log.open("w")
        self.process = subprocess.Popen(
            [str(dynamo_python()), "-m", "dynamo.indexer", "--port", str(self.port), "--threads", "1"],
            stdout=self.log, stderr=subprocess.STDOUT)

    def post(self, path: str, body: dict[str, Any]) -> Any:
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    def register(self, worker: int, replica: Engine) -> None:
        deadline = time.monotonic() + 30
        while True:
            try:
                self.post("/register", {"instance_id": worker, "endpoint": replica.kv_events.endpoint,
                                        "replay_endpoint": replica.kv_events.replay_endpoint,
                                        "model_name": "default", "block_size": BLOCK})
                return
            except (urllib.error.URLError, ConnectionError):      # not listening yet
                assert self.process.poll() is None and time.monotonic() < deadline, \
                    f"the indexer did not start: {self.log.name}"
                time.sleep(0.2)

    def overlap_blocks(self, token_ids: list[int]) -> dict[int, int]:
        """Matched blocks per worker (workers without any left out)."""
        scores = self.post("/query", {"token_ids": token_ids, "model_name": "default"})["scores"]
        out = {}
        for worker, by_rank in scores.items():
            tokens = sum(by_rank.values())
            assert tokens % BLOCK == 0, scores
            out[int(worker)] = tokens // BLOCK
        return out

    def wait_for(self, token_ids: list[int], expected: dict[int, int], timeout: float = 30) -> dict[int, int]:
        deadline = time.monotonic() + timeout
        while True:
            assert self.process.poll() is None, f"the indexer exited: {self.log.name}"
            scores = self.overlap_blocks(token_ids)
            if scores == expected or time.monotonic() > deadline:
                return scores
            time.sleep(0.1)

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


def test_dynamo_indexer_scores_the_replica_that_holds_the_prefix(engine: Engine, model_dir: Path,
                                                                 prose_ids: list[int], tmp_path: Path) -> None:
    """Two replicas' streams into Dynamo 1.6.1's standalone indexer, which recomputes its block
    keys from our events' token ids: for a prompt sharing a 64-token prefix with what replica
    1 served, replica 1 scores 4 blocks and replica 2, which served something else, 0. Both
    were served before the indexer started: only our replay socket can have told it."""
    dynamo_python()
    other = Engine(EngineConfig(model=str(model_dir), **FIXED_BUDGET, num_kv_blocks=16, **EVENTS))
    indexer = None
    try:
        engine.kv_cache.reset_prefix_cache()
        shared, elsewhere = prose_ids[1300:1364], prose_ids[1600:1700]
        engine.generate([shared + prose_ids[1500:1536]], GREEDY_ONE)      # replica 1: the prefix
        other.generate([elsewhere], GREEDY_ONE)                           # replica 2: another prompt

        indexer = DynamoIndexer(tmp_path / "indexer.log")
        indexer.register(1, engine)
        indexer.register(2, other)
        # Its subscriptions take a moment, and what is published meanwhile does not reach it.
        # The first batch that does shows it a gap since sequence 0, which it asks our replay
        # socket for: serve a fresh one-block probe on each replica until it has seen both.
        for attempt in range(20):
            probes = {worker: [40000 + 100 * attempt + 50 * worker + i for i in range(BLOCK + 1)] for worker in (1, 2)}
            engine.generate([probes[1]], GREEDY_ONE)
            other.generate([probes[2]], GREEDY_ONE)
            if all(indexer.wait_for(probe, {worker: 1}, timeout=2) == {worker: 1} for worker, probe in probes.items()):
                break
        else:
            pytest.fail(f"the indexer never saw both replicas' events ({indexer.log.name})")

        assert indexer.wait_for(shared + prose_ids[1700:1740], {1: 4}) == {1: 4}
        assert indexer.wait_for(elsewhere, {2: 6}) == {2: 6}
        # Clears are read too: replica 1 resets, and holds nothing of the prefix any more.
        engine.kv_cache.reset_prefix_cache()
        assert indexer.wait_for(shared + prose_ids[1700:1740], {}) == {}
    finally:
        if indexer is not None:
            indexer.close()
        other.kv_events.close()

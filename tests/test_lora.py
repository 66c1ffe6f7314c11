"""Multi-LoRA (backend/lora/): adapters in PEFT's format, made here with random weights, on the
converted SmolLM2 and on a tiny random Llama. Greedy tokens through our engine equal
transformers + peft's for each adapter, token for token in float32, with requests of three
adapters and the base model mixed in one batch, chunked prefill, prefix hits and a
preemption; a prefix cached under one adapter is never served to another."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from backend import Engine, EngineConfig, InvalidRequestError, SamplingParams
from backend.lora.adapter import LoRAAdapter
from backend.lora.batch import add_lora, add_lora_per_row, lora_batch
from backend.lora.registry import MULTI_LORA_FILE
from backend.lora.slots import LoRABackend, LoRASlots, batch_for_rows
from backend.lora.synthetic import MODULES, model_with_adapters
from backend.model.architecture import ModelArchitecture
from tests.conftest import FIXED_BUDGET_PARAMS, hf_greedy
from tests.test_tiny_architectures import make_tiny_model

MAX_NEW_TOKENS = 16
# float32 (the oracle's dtype); a fixed token budget: no start-up calibration of the step cost
# model (2 s per engine), which these tests do not exercise.
FAST = dict(dtype="float32", itl_target_ms=0)
# name -> (rank, alpha, target modules, seed)
ADAPTERS = {"all-r8": (8, 16, MODULES, 1), "attn-r4": (4, 8, ("q_proj", "v_proj", "o_proj"), 2),
            "mlp-r16-rslora": (16, 8, ("gate_proj", "up_proj", "down_proj"), 3)}


def peft_references(hf_model, folder: Path, prompts_by_adapter: dict[str | None, list[list[int]]],
                    max_new_tokens: int = MAX_NEW_TOKENS) -> dict[str | None, list[list[int]]]:
    """transformers + peft greedy tokens, per adapter (None: the base model)."""
    import copy

    from peft import PeftModel

    out = {}
    if None in prompts_by_adapter:
        out[None] = hf_greedy(hf_model, prompts_by_adapter[None], max_new_tokens)
    names = [n for n in prompts_by_adapter if n is not None]
    if names:
        model = PeftModel.from_pretrained(copy.deepcopy(hf_model), folder / "adapters" / names[0],
                                          adapter_name=names[0]).eval()
        for name in names[1:]:
            model.load_adapter(folder / "adapters" / name, adapter_name=name)
        for name in names:
            model.set_adapter(name)
            out[name] = hf_greedy(model, prompts_by_adapter[name], max_new_tokens)
    return out


def run_mixed(engine: Engine, requests: list[tuple[str | None, list[int]]], max_new_tokens: int = MAX_NEW_TOKENS,
              ) -> list[list[int]]:
    """All submitted at once, stepped to completion; token ids in submission order."""
    ids = []
    for i, (adapter, prompt) in enumerate(requests):
        request_id = f"r{i}-{adapter}"
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=max_new_tokens, temperature=0.0,
                                                              ignore_eos=True, lora_name=adapter))
        ids.append(request_id)
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    engine.check_invariants()
    return [finals[r].token_ids for r in ids]


@pytest.fixture(scope="module")
def lora_model(model_dir: Path, tmp_path_factory) -> Path:
    return model_with_adapters(model_dir, tmp_path_factory.mktemp("lora-model"), ADAPTERS)


@pytest.fixture(scope="module")
def mixed_prompts(prose_ids: list[int]) -> list[tuple[str | None, list[int]]]:
    names = [None, *ADAPTERS]
    return [(names[i % 4], prose_ids[7 * i: 7 * i + length]) for i, length in enumerate([33, 90, 17, 130, 61, 5, 75, 48])]


@pytest.fixture(scope="module")
def references(hf_model, lora_model: Path, mixed_prompts) -> dict:
    by_adapter: dict[str | None, list[list[int]]] = {}
    for adapter, prompt in mixed_prompts:
        by_adapter.setdefault(adapter, []).append(prompt)
    return peft_references(hf_model, lora_model, by_adapter)


def expected_in_order(mixed_prompts, references: dict) -> list[list[int]]:
    seen: dict[str | None, int] = {}
    out = []
    for adapter, _ in mixed_prompts:
        out.append(references[adapter][seen.get(adapter, 0)])
        seen[adapter] = seen.get(adapter, 0) + 1
    return out


def test_adapters_change_the_output(references: dict) -> None:
    """Otherwise the equality tests below would prove nothing."""
    base = references[None]
    for name in ADAPTERS:
        assert references[name] != base[:len(references[name])], name


@pytest.mark.parametrize("shape", [dict(max_num_batched_tokens=512, max_num_seqs=8),
                                   dict(max_num_batched_tokens=40, max_num_seqs=8),       # chunked prefill
                                   dict(max_num_batched_tokens=64, max_num_seqs=8, num_kv_blocks=28)])  # preemption
def test_mixed_adapters_in_one_batch_match_peft(lora_model: Path, mixed_prompts, references: dict,
                                                shape: dict) -> None:
    engine = Engine(EngineConfig(model=str(lora_model), **FAST, block_size=16,
                                 **{"num_kv_blocks": 256, **shape}))
    tokens = run_mixed(engine, mixed_prompts)
    assert tokens == expected_in_order(mixed_prompts, references)
    if "num_kv_blocks" in shape:
        assert engine.stats().num_preemptions > 0
    stats = engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total


def test_a_shared_prefix_is_cached_once_per_adapter_and_never_crosses(lora_model: Path, hf_model,
                                                                       prose_ids: list[int]) -> None:
    system = prose_ids[:64]                       # four full blocks
    questions = [prose_ids[300 + 9 * i: 309 + 9 * i] for i in range(4)]
    plan = [("all-r8", 0), ("all-r8", 1), ("attn-r4", 1), (None, 2), ("attn-r4", 3), (None, 3)]
    by_adapter: dict[str | None, list[list[int]]] = {}
    for adapter, q in plan:
        by_adapter.setdefault(adapter, []).append(system + questions[q])
    references = peft_references(hf_model, lora_model, by_adapter)
    engine = Engine(EngineConfig(model=str(lora_model), **FAST, block_size=16, num_kv_blocks=256))
    cached, seen = [], {}
    for adapter, q in plan:   # one at a time: each sees what the earlier ones cached
        tokens = run_mixed(engine, [(adapter, system + questions[q])])[0]
        index = seen.get(adapter, 0)
        seen[adapter] = index + 1
        assert tokens == references[adapter][index], (adapter, q)
        cached.append(engine.stats().prefix_cache_hit_tokens)
    hits = [b - a for a, b in zip([0] + cached, cached)]
    # The first request of each adapter (and of the base model) computes the system prompt.
    assert hits == [0, 64, 0, 0, 64, 64], hits


@pytest.fixture(scope="module")
def tiny_llama_with_adapters(tmp_path_factory, tokenizer_dir: Path, prose_ids: list[int]):
    """A tiny random Llama with two adapters, four mixed requests and peft's tokens for them."""
    base = tmp_path_factory.mktemp("tiny-llama")
    hf_model = make_tiny_model("llama", base, tokenizer_dir)
    folder = model_with_adapters(base, tmp_path_factory.mktemp("with-adapters"),
                                 {"tiny-a": (8, 16, MODULES, 4), "tiny-b": (4, 4, ("q_proj", "down_proj"), 5)})
    requests = [("tiny-a", prose_ids[:40]), (None, prose_ids[5:30]), ("tiny-b", prose_ids[50:110]),
                ("tiny-a", prose_ids[200:215])]
    return folder, requests, peft_in_order(hf_model, folder, requests), hf_model


def peft_in_order(hf_model, folder: Path, requests: list[tuple[str | None, list[int]]],
                  max_new_tokens: int = MAX_NEW_TOKENS) -> list[list[int]]:
    by_adapter: dict[str | None, list[list[int]]] = {}
    for adapter, prompt in requests:
        by_adapter.setdefault(adapter, []).append(prompt)
    return expected_in_order(requests, peft_references(hf_model, folder, by_adapter, max_new_tokens))


def test_tiny_llama_adapter_matches_peft(tiny_llama_with_adapters) -> None:
    folder, requests, expected, _ = tiny_llama_with_adapters
    engine = Engine(EngineConfig(model=str(folder), **FAST, block_size=16, num_kv_blocks=128,
                                 max_num_batched_tokens=32, max_num_seqs=8))
    assert run_mixed(engine, requests) == expected


def test_triton_kernels_and_decode_graphs_match_peft(tiny_llama_with_adapters) -> None:
    """The CUDA path on CPU: Triton attention and LoRA kernels (interpreter) over the slot
    stacks, and decode steps through the CUDA-graph runner (eager here, padded to its batch
    sizes), which reads every row's adapter slot from the step buffers."""
    from backend.worker.cuda_graphs import DecodeGraphs, capture_sizes

    folder, requests, _, hf_model = tiny_llama_with_adapters
    # The interpreter runs a LoRA program per token and rank block in every projection (~3 s a
    # 32-token step on a 2-core AVX2 CPU): the prompts' first 20 tokens (75 in all: prompts split
    # over three 32-token steps, the last beside decodes) and 6 new tokens.
    requests = [(adapter, prompt[:20]) for adapter, prompt in requests]
    expected = peft_in_order(hf_model, folder, requests, max_new_tokens=6)
    # max_lora_rank 8 (the adapters' largest): the interpreter runs a program per rank block.
    engine = Engine(EngineConfig(model=str(folder), **FAST, attention_backend="triton", block_size=16,
                                 num_kv_blocks=128, max_num_batched_tokens=32, max_num_seqs=8, max_lora_rank=8))
    runner = engine.runner
    assert runner.lora_slots is not None and runner.lora_slots.backend == LoRABackend.TRITON
    # Captured on CUDA (the real decode path there), eager on CPU.
    runner.decode_graphs = DecodeGraphs(runner.model, runner.buffers, runner.kv_caches, capture_sizes(8),
                                        runner.max_model_len, capture=runner.device.type == "cuda",
                                        lora=runner.lora_slots)
    graph_steps = 0
    original_run = runner.decode_graphs.run

    def counting_run(num_seqs: int):
        nonlocal graph_steps
        graph_steps += 1
        return original_run(num_seqs)

    runner.decode_graphs.run = counting_run
    assert run_mixed(engine, requests, max_new_tokens=6) == expected
    assert graph_steps > 0, "no decode step went through the graph runner"


def load_adapters(lora_model: Path, dtype: torch.dtype) -> tuple[ModelArchitecture, list[LoRAAdapter]]:
    """The model's architecture and its ADAPTERS loaded on CPU, outside an engine."""
    arch = ModelArchitecture.from_folder(str(lora_model))
    return arch, [LoRAAdapter.load(name, i + 1, lora_model / "adapters" / name, arch, dtype, torch.device("cpu"))
                  for i, name in enumerate(ADAPTERS)]


@pytest.mark.parametrize("backend", list(LoRABackend), ids=lambda b: b.value)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_batched_delta_equals_the_per_row_reference(lora_model: Path, backend: LoRABackend,
                                                    dtype: torch.dtype) -> None:
    """Every backend of the slots (C kernel, Triton kernels, torch) against the per-row reference,
    with the three adapters' different ranks and target modules and rows of the base model."""
    arch, adapters = load_adapters(lora_model, dtype)
    # Rows of one adapter in two separate ranges and in one range.
    layout = [(adapters[0], 3), (None, 2), (adapters[1], 4), (adapters[0], 1), (adapters[2], 6)]
    row_adapters = [adapter for adapter, rows in layout for _ in range(rows)]
    slots = LoRASlots(4, 16, 16, arch, dtype, torch.device("cpu"), backend)
    batch = batch_for_rows(slots, row_adapters)
    generator = torch.Generator().manual_seed(0)
    qkv_width = (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim
    for projection, (fan_in, fan_out) in {"qkv": (arch.hidden_size, qkv_width), "o": (arch.hidden_size, arch.hidden_size),
                                          "down": (arch.intermediate_size, arch.hidden_size)}.items():
        x = torch.randn(16, fan_in, generator=generator).to(dtype)
        base = torch.randn(16, fan_out, generator=generator).to(dtype)
        fast, slow = base.clone(), base.clone()
        with lora_batch(batch):
            add_lora(fast, x, 3, projection)
        add_lora_per_row(slow, x, 3, projection, row_adapters)
        tolerance = 1e-4 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(fast, slow, rtol=tolerance, atol=tolerance)
        assert not torch.equal(fast, base)
        torch.testing.assert_close(fast[3:5], base[3:5], rtol=0, atol=0)   # base-model rows untouched


def test_slots_are_reused_least_recently_used_first(lora_model: Path) -> None:
    arch, adapters = load_adapters(lora_model, torch.float32)
    slots = LoRASlots(2, 16, 8, arch, torch.float32, torch.device("cpu"), LoRABackend.TRITON)
    first = slots.assign(adapters[:2])
    assert sorted(first.values()) == [0, 1]
    slots.assign([adapters[1]])
    # adapters[0] was used longest ago: its slot takes adapters[2]; adapters[1] stays in place.
    third = slots.assign([adapters[2], adapters[1]])
    assert third == {adapters[2].lora_id: first[adapters[0].lora_id], adapters[1].lora_id: first[adapters[1].lora_id]}
    slot = third[adapters[2].lora_id]
    width = adapters[2].layers[0]["gate_up"].a.shape[0]
    torch.testing.assert_close(slots.a_stacks[0]["gate_up"][slot, :width], adapters[2].layers[0]["gate_up"].a)
    assert not slots.a_stacks[0]["qkv"][slot].any(), "the evicted adapter's qkv weights were left behind"
    # The evicted adapter comes back, into the slot least recently used (adapters[2]'s).
    slots.assign([adapters[1]])
    back = slots.assign([adapters[0]])
    assert back == {adapters[0].lora_id: slot}
    width = adapters[0].layers[0]["qkv"].a.shape[0]
    torch.testing.assert_close(slots.a_stacks[0]["qkv"][back[adapters[0].lora_id], :width],
                               adapters[0].layers[0]["qkv"].a)
    with pytest.raises(RuntimeError, match="3 adapters"):
        slots.assign(adapters)


def test_adapters_above_max_lora_rank_are_refused(lora_model: Path) -> None:
    engine = Engine(EngineConfig(model=str(lora_model), **FAST, num_kv_blocks=32, max_lora_rank=4))
    with pytest.raises(InvalidRequestError, match=r"rank 8 is outside \[1, 4\] \(max_lora_rank\)"):
        engine.add_request("big", [1, 2, 3], SamplingParams(max_tokens=2, lora_name="all-r8"))
    engine.add_request("small", [1, 2, 3], SamplingParams(max_tokens=2, lora_name="attn-r4"))
    assert len(engine.loras.load_seconds) == 1, "only the adapter that loaded is timed"


def test_adapter_names_are_checked_and_the_list_is_live(lora_model: Path, prose_ids: list[int]) -> None:
    engine = Engine(EngineConfig(model=str(lora_model), **FAST, num_kv_blocks=64))
    with pytest.raises(InvalidRequestError, match="lora_name: unknown adapter 'nope' .*all-r8"):
        engine.add_request("unknown", prose_ids[:8], SamplingParams(max_tokens=2, lora_name="nope"))
    with pytest.raises(InvalidRequestError, match="lora_name"):
        SamplingParams.from_dict({"lora_name": 5})
    # Added while serving: usable at once. Removed: refused from then on.
    entries = json.loads((lora_model / MULTI_LORA_FILE).read_text())
    try:
        (lora_model / MULTI_LORA_FILE).write_text(json.dumps({**entries, "late": entries["attn-r4"]}))
        assert run_mixed(engine, [("late", prose_ids[:20])])[0] == run_mixed(engine, [("attn-r4", prose_ids[:20])])[0]
        (lora_model / MULTI_LORA_FILE).write_text(json.dumps({k: v for k, v in entries.items() if k != "all-r8"}))
        with pytest.raises(InvalidRequestError, match="unknown adapter 'all-r8'"):
            engine.add_request("removed", prose_ids[:8], SamplingParams(max_tokens=2, lora_name="all-r8"))
    finally:
        (lora_model / MULTI_LORA_FILE).write_text(json.dumps(entries))


@pytest.mark.server
def test_lora_name_through_the_real_server(lora_model: Path, prose_ids: list[int], tokenizer, tmp_path: Path) -> None:
    """``lora_name`` in sampling_parameters over gRPC and HTTP; an adapter added to
    multi_lora.json while a stream runs is used at once; an unknown name is INVALID_ARG."""
    import time
    import urllib.error
    import urllib.request

    from client import NO_RETRY, LLMClient, LLMError, http_generate_stream
    from loadtest.server_metrics import scrape, value
    from server.launch import TritonServer, free_ports

    prompt = tokenizer.decode(prose_ids[:40])
    engine = Engine(EngineConfig(model=str(lora_model), **FAST, num_kv_blocks=128))
    expected = {name: engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                               lora_name=name))[0].text
                for name in ("all-r8", "attn-r4")}
    assert expected["all-r8"] != expected["attn-r4"]
    entries = json.loads((lora_model / MULTI_LORA_FILE).read_text())
    with TritonServer(*free_ports(3), params={"model": str(lora_model), "dtype": "float32", **FIXED_BUDGET_PARAMS},
                      log_file=tmp_path / "server.log") as server:
        client = LLMClient(server.grpc_url, retry=NO_RETRY)
        greedy = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
        assert client.generate(prompt, lora_name="all-r8", **greedy).text == expected["all-r8"]
        http_text = "".join(c.text for c in http_generate_stream(prompt, url=server.http_url, lora_name="attn-r4",
                                                                 retry=NO_RETRY, **greedy))
        assert http_text == expected["attn-r4"]
        with pytest.raises(LLMError, match="lora_name: unknown adapter 'missing'"):
            client.generate(prompt, lora_name="missing", **greedy)
        body = {"text_input": prompt, "sampling_parameters": json.dumps({"max_tokens": 2, "lora_name": "missing"})}
        request = urllib.request.Request(f"http://{server.http_url}/v2/models/llm/generate", data=json.dumps(body).encode())
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 400   # INVALID_ARG

        # A stream runs; meanwhile an adapter is added and used at once.
        running = client.stream("A long story:", max_tokens=150, ignore_eos=True, lora_name="attn-r4")
        chunks = iter(running)
        next(chunks)
        deadline = time.monotonic() + 1.0     # published within 0.5 s (test_server.py checks the bound)
        while (value(metrics := scrape(server.metrics_url), "llm_lora_requests_running", lora_name="attn-r4") != 1
               and time.monotonic() < deadline):
            time.sleep(0.05)
        assert value(metrics, "llm_lora_requests_running", lora_name="attn-r4") == 1
        with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
            text = response.read().decode()
        info = [line for line in text.splitlines()
                if line.startswith("vllm:lora_requests_info{") and float(line.rsplit(" ", 1)[1]) > 0]
        assert len(info) == 1 and 'running_lora_adapters="attn-r4"' in info[0] and 'max_lora="4"' in info[0], info
        assert value(metrics, "llm_lora_adapter_load_seconds_count") == 2
        try:
            (lora_model / MULTI_LORA_FILE).write_text(json.dumps({**entries, "added-live": entries["all-r8"]}))
            assert client.generate(prompt, lora_name="added-live", **greedy).text == expected["all-r8"]
            rest = list(chunks)
            assert rest and rest[-1].final and rest[-1].finish_reason == "length"
        finally:
            (lora_model / MULTI_LORA_FILE).write_text(json.dumps(entries))


def test_max_loras_makes_other_adapters_wait_without_preempting(lora_model: Path, mixed_prompts,
                                                               references: dict) -> None:
    engine = Engine(EngineConfig(model=str(lora_model), **FAST, num_kv_blocks=256, max_loras=1))
    for i, (adapter, prompt) in enumerate(mixed_prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0,
                                                           ignore_eos=True, lora_name=adapter))
    finals, together = {}, []
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output.token_ids
        running = {r.lora.name for r in engine.scheduler.running if r.lora is not None}
        together.append(len(running))
        assert engine.stats().max_loras == 1
    assert max(together) == 1 and engine.stats().num_preemptions == 0
    assert [finals[f"r{i}"] for i in range(len(mixed_prompts))] == expected_in_order(mixed_prompts, references)


def test_removing_an_adapter_lets_its_running_requests_finish(lora_model: Path, prose_ids: list[int]) -> None:
    """Unloading an adapter in use never corrupts its requests: they finish with it, exactly
    as without the removal, and new requests for it are refused."""
    prompt = prose_ids[:30]
    expected = run_mixed(Engine(EngineConfig(model=str(lora_model), **FAST, num_kv_blocks=64)),
                         [("all-r8", prompt)], max_new_tokens=24)[0]
    engine = Engine(EngineConfig(model=str(lora_model), **FAST, num_kv_blocks=64))
    engine.add_request("running", prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                         lora_name="all-r8"))
    tokens = []
    for output in engine.step() + engine.step():
        tokens += output.new_token_ids
    entries = json.loads((lora_model / MULTI_LORA_FILE).read_text())
    try:
        (lora_model / MULTI_LORA_FILE).write_text(json.dumps({k: v for k, v in entries.items() if k != "all-r8"}))
        with pytest.raises(InvalidRequestError, match="unknown adapter 'all-r8'"):
            engine.add_request("late", prompt, SamplingParams(max_tokens=2, lora_name="all-r8"))
        while engine.has_unfinished_requests():
            for output in engine.step():
                tokens += output.new_token_ids
    finally:
        (lora_model / MULTI_LORA_FILE).write_text(json.dumps(entries))
    assert tokens == expected
    engine.check_invariants()

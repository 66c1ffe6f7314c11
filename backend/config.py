"""Engine configuration: the one source of truth for every default.

The Triton model's config.pbtxt parameters map onto these fields by name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

DEFAULT_MODEL = "models/smollm2-135m-instruct"
# KV budget on CPU when neither num_kv_blocks nor kv_cache_memory_bytes is given.
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
# CPU linear layers (backend/model/cpu_linear.py resolves "auto").
CPU_LINEAR_CHOICES = ("auto", "native", "onednn", "torch", "measure")
# The kernel for prompts' attention on CPU (backend/model/prefill_attention_choice.py resolves "auto").
CPU_PREFILL_ATTENTION_CHOICES = ("auto", "native", "sdpa", "measure")
# cpu_prefill_bf16_kernel: timed at start-up, or one of our bfloat16 prefill functions
# (kernels/cpu_native.PREFILL_BF16_KERNELS names the same four).
CPU_PREFILL_BF16_KERNEL_CHOICES = ("auto", "dp", "fma", "fp16", "dp-pv")


# Where KV-cache events may go (kv_events_endpoint, kv_events_replay_endpoint).
ZMQ_TRANSPORTS = ("tcp://", "ipc://", "inproc://")


# Keys an earlier release took, and their names now: a deployed config.pbtxt keeps working.
RENAMED_KEYS = {"cpu_fused_ops": "fused_layer_ops"}


@dataclass
class EngineConfig:
    model: str = DEFAULT_MODEL                 # Hugging Face folder (config.json + safetensors)
    dtype: str = "auto"                        # auto = bfloat16 on CUDA and on CPUs with native bf16, else float32
    device: str = "auto"                       # auto = cuda when available, else cpu
    block_size: int = 16                       # tokens per KV block
    num_kv_blocks: int | None = None           # None: sized from kv_cache_memory_bytes / GPU memory
    kv_cache_memory_bytes: int | None = None   # KV budget when num_kv_blocks is None
    gpu_memory_utilization: float = 0.9        # CUDA: fraction of the memory free after loading the weights
                                               # that activations + KV may take (KV gets the rest)
    max_num_seqs: int = 64                     # running requests per step
    max_num_batched_tokens: int = 512          # token budget per step (prefill chunks + decodes)
    itl_target_ms: float = 150.0               # prefill chunks sized so each step's predicted time stays
                                               # under this (backend/core/step_cost.py); 0 = fixed token budget
    itl_target_decode_multiple: float = 4.0    # ... but at least this many times the step's decodes' own
                                               # predicted time, so prefill keeps ~3/4 of a step on a CPU
                                               # where decodes take half the target; 0 = itl_target_ms alone
    calibration_cache: bool = True             # reuse the step cost calibration an earlier start timed on this
                                               # machine, model and code (backend/worker/timing_cache.py)
    min_prefill_chunk_tokens: int = 32         # an unfinished prefill advances at least this much per step
    long_prefill_token_threshold: int = 0      # prompts longer than this are "long" (after shorter ones in a
                                               # step); 0 = what one step can prefill: the token budget, or
                                               # under the ITL target what fits beside the step's decodes
    max_num_partial_prefills: int = 4          # requests mid-prefill at a time (continuous batching)
    max_long_partial_prefills: int = 1         # ... of which long ones
    # LoRA adapters (multi_lora.json in the model folder) whose requests may run at once; a
    # request of another adapter waits, never preempting a running one (vLLM's max_loras).
    max_loras: int = 4
    max_lora_rank: int = 64                    # the largest adapter rank served (the CUDA slots are sized for it)
    max_model_len: int | None = None           # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    batching: Literal["continuous", "static"] = "continuous"
    max_waiting_requests: int = 1024           # admission control: refuse beyond this queue depth
    load_format: Literal["auto", "dummy"] = "auto"  # dummy: random weights from config.json
    attention_backend: Literal["auto", "triton", "cpu", "reference"] = "auto"  # auto: triton on CUDA, cpu on CPU
    cpu_threads: int | None = None             # CPU: torch / OpenMP threads of the engine; None = every core
                                               # this process may run on (os.sched_getaffinity)
    quantization: Literal["none", "int8"] = "none"  # int8: weight-only int8 decoder projections (CPU opt-in)
    cpu_linear: Literal["auto", "native", "onednn", "torch", "measure"] = "auto"  # CPU linear layers: our C
                                               # kernel (float32: AVX2 + FMA; bfloat16: AVX512_BF16 or AVX2 + FMA),
                                               # prepacked oneDNN (float32, bfloat16) or plain
                                               # F.linear; auto: by CPU features and dtype, the measured
                                               # rule in backend/model/cpu_linear.resolve_cpu_linear, timed
                                               # at start-up where it has no figures; measure: always timed
                                               # (backend/model/cpu_linear_tuning.py)
    cpu_prefill_attention: Literal["auto", "native", "sdpa", "measure"] = "auto"  # CPU attention of prompts:
                                               # our C kernel or torch's SDPA in the cache's dtype (oneDNN,
                                               # AMX tiles where present); auto: ours without AVX-512 (measured),
                                               # timed at start-up elsewhere (SDPA from the prompt length where
                                               # it wins); measure: always timed
                                               # (backend/model/prefill_attention_choice.py)
    cpu_linear_fma_rows: int | None = None     # CPU bfloat16, our kernel: calls of at least this many rows run
                                               # float32 FMAs over the bfloat16 weights instead of bf16 dot
                                               # products (AVX-512F builds); None: timed at start-up, 0: never
                                               # (backend/model/cpu_linear_tuning.choose_fma_rows)
    cpu_linear_fp16_rows: int | None = None    # CPU bfloat16, our kernel: calls of at least this many rows run
                                               # float16 FMAs (AVX512-FP16 builds: twice float32's products per
                                               # instruction; rows scaled, sums in float16 over 32 pairs of k,
                                               # then float32); None: timed at start-up, on where 10% faster
                                               # and every weight under 1024; 0: never
                                               # (backend/model/cpu_linear_tuning.choose_fp16_rows)
    cpu_prefill_bf16_kernel: Literal["auto", "dp", "fma", "fp16", "dp-pv"] = "auto"  # CPU bfloat16 prompt
                                               # attention, ours: the build's own function (dp), the
                                               # float32-FMA one (fma, AVX-512F), the float16 one (fp16,
                                               # AVX512-FP16) or dp with P x V in dot products (dp-pv,
                                               # AVX512_BF16; probabilities rounded to bfloat16);
                                               # auto: timed at start-up
                                               # (backend/model/prefill_attention_choice.py)
    fused_layer_ops: bool = True               # residual add + RMSNorm, RoPE + KV write, SiLU x up fused: in C on CPU
                                               # (kernels/csrc/layer_ops.c), in Triton with the triton attention
                                               # backend (kernels/triton_layer_ops.py); false: torch ops
    enforce_eager: bool = False                # CUDA: never replay CUDA graphs for decode steps
    async_scheduling: bool = False             # schedule and launch step n+1 before reading step n's tokens, so the
                                               # host's work overlaps the device's (vLLM's --async-scheduling;
                                               # backend/engine/overlap.py); steps with requests that need their
                                               # last token on the host first (seeds, logprobs, penalties, grammars)
                                               # run as before
    cuda_graph_mixed_steps: bool = True        # CUDA: also replay graphs for steps with prefill chunks or drafts
                                               # (one per power-of-two token count up to the budget;
                                               # backend/worker/cuda_graphs.py)
    step_trace_path: str | None = None         # served engine: one JSON line per step (which requests, how many
                                               # tokens, prefill or decode, time) appended here; None = off
    # Speculative decoding (backend/sample/speculative.py): drafts verified in the same packed step.
    speculative_method: Literal["none", "ngram"] = "none"  # ngram: prompt lookup over the request's tokens
    num_speculative_tokens: int = 5            # drafts per request and step, at most
    prompt_lookup_min: int = 2                 # n-gram lengths matched against the request's own tokens:
    prompt_lookup_max: int = 4                 # the longest match from max down to min wins
    speculative_max_batch_size: int = 4        # no drafts in a step whose running batch is larger: a full
                                               # batch is bound by compute, not by reading the weights
    seed: int = 0                              # engine-wide RNG for requests without a seed
    stream_interval: int = 1                   # serving: a running stream's new tokens are handed out once this
                                               # many have gathered (its first token and its end at once), so a
                                               # server under many streams makes fewer response round trips;
                                               # 1 = every step (vLLM's stream_interval)
    drain_timeout_s: float = 20.0              # serving: on shutdown or unload, how long requests in flight
                                               # may finish before they are aborted (the launcher sets
                                               # Triton's exit timeout above it)
    # KV-cache events for routers that track what each replica holds (Dynamo's KV router,
    # llm-d's indexer): BlockStored / BlockRemoved / AllBlocksCleared in vLLM's wire format
    # on a ZMQ PUB socket (docs/scaling.md, "KV-cache events"). The names are vLLM's
    # kv_events_config keys, prefixed. Off: no socket, no thread, nothing recorded.
    enable_kv_cache_events: bool = False
    kv_events_publisher: Literal["zmq", "null"] = "zmq"   # null: nothing is published (vLLM's spelling)
    kv_events_endpoint: str = "tcp://*:5557"   # bound when its host is a wildcard ("*", "::") or it is
                                               # ipc:// or inproc://, else connected to (vLLM's rule):
                                               # Dynamo's indexer connects, llm-d's binds
    kv_events_replay_endpoint: str | None = None  # a ROUTER socket (bound) that resends kept batches
                                               # from a sequence number; None = no replay
    kv_events_buffer_steps: int = 10000        # batches kept for replay
    kv_events_hwm: int = 100000                # ZMQ high-water mark: messages queued per subscriber
                                               # before ZMQ drops for that subscriber
    kv_events_topic: str = ""                  # first frame of every message; llm-d reads
                                               # kv@<host:port>@<model> from it

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "EngineConfig":
        """Build from string-or-typed values (e.g. Triton model parameters)."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values = {RENAMED_KEYS.get(name, name): raw for name, raw in values.items()}
        unknown = sorted(set(values) - set(fields))
        if unknown:
            raise ValueError(f"unknown engine config key(s): {unknown}")
        kwargs: dict[str, Any] = {}
        for name, raw in values.items():
            kwargs[name] = _coerce(name, raw, str(fields[name].type))
        return cls(**kwargs)

    def validate(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(f"EngineConfig: {message}")

        for f in dataclasses.fields(self):
            value, annotation = getattr(self, f.name), str(f.type)
            if value is None:
                check("None" in annotation, f"{f.name} must not be None")
            elif annotation.startswith(("int", "bool")):
                expected = bool if annotation.startswith("bool") else int
                check(isinstance(value, expected) and (expected is bool or not isinstance(value, bool)),
                      f"{f.name} must be {expected.__name__}, got {value!r}")
            elif annotation.startswith("float"):
                check(isinstance(value, (int, float)) and not isinstance(value, bool),
                      f"{f.name} must be a number, got {value!r}")
            else:
                check(isinstance(value, str), f"{f.name} must be a string, got {value!r}")

        check(self.dtype in ("auto", "float32", "float16", "bfloat16"),
              f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}")
        check(self.block_size >= 1, "block_size must be >= 1")
        check(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks must be >= 1")
        check(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
              "kv_cache_memory_bytes must be > 0")
        check(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization must be in (0, 1]")
        check(self.max_num_seqs >= 1, "max_num_seqs must be >= 1")
        check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1")
        check(self.max_num_batched_tokens >= self.max_num_seqs,
              "max_num_batched_tokens must be >= max_num_seqs (one decode token per running request)")
        check(self.itl_target_ms >= 0, "itl_target_ms must be >= 0 (0 = fixed token budget)")
        check(self.itl_target_decode_multiple >= 0, "itl_target_decode_multiple must be >= 0 (0 = itl_target_ms alone)")
        check(self.min_prefill_chunk_tokens >= 1, "min_prefill_chunk_tokens must be >= 1")
        check(self.long_prefill_token_threshold >= 0, "long_prefill_token_threshold must be >= 0")
        check(self.max_loras >= 1, "max_loras must be >= 1")
        check(1 <= self.max_lora_rank <= 64, "max_lora_rank must be in [1, 64]")
        check(1 <= self.max_long_partial_prefills <= self.max_num_partial_prefills,
              "need 1 <= max_long_partial_prefills <= max_num_partial_prefills")
        check(self.quantization in ("none", "int8"), "quantization must be none or int8")
        check(self.cpu_linear in CPU_LINEAR_CHOICES, f"cpu_linear must be one of {CPU_LINEAR_CHOICES}")
        check(self.cpu_prefill_attention in CPU_PREFILL_ATTENTION_CHOICES,
              f"cpu_prefill_attention must be one of {CPU_PREFILL_ATTENTION_CHOICES}")
        check(self.cpu_threads is None or self.cpu_threads >= 1, "cpu_threads must be >= 1")
        check(self.cpu_linear_fma_rows is None or self.cpu_linear_fma_rows >= 0, "cpu_linear_fma_rows must be >= 0")
        check(self.cpu_linear_fp16_rows is None or self.cpu_linear_fp16_rows >= 0,
              "cpu_linear_fp16_rows must be >= 0")
        check(self.cpu_prefill_bf16_kernel in CPU_PREFILL_BF16_KERNEL_CHOICES,
              f"cpu_prefill_bf16_kernel must be one of {CPU_PREFILL_BF16_KERNEL_CHOICES}")
        check(self.max_model_len is None or self.max_model_len >= 1, "max_model_len must be >= 1")
        check(self.scheduling_policy in ("fcfs", "priority"), "scheduling_policy must be fcfs or priority")
        check(self.batching in ("continuous", "static"), "batching must be continuous or static")
        check(self.max_waiting_requests >= 1, "max_waiting_requests must be >= 1")
        check(self.stream_interval >= 1, "stream_interval must be >= 1 (1 = every token as it comes)")
        check(0 <= self.drain_timeout_s <= 3600, "drain_timeout_s must be in [0, 3600]")
        check(self.load_format in ("auto", "dummy"), "load_format must be auto or dummy")
        check(self.attention_backend in ("auto", "triton", "cpu", "reference"),
              "attention_backend must be auto, triton, cpu or reference")
        check(self.speculative_method in ("none", "ngram"), "speculative_method must be none or ngram")
        check(not (self.async_scheduling and self.speculative_method != "none"),
              "async_scheduling does not combine with speculative decoding (drafts are proposed from the last token)")
        check(1 <= self.num_speculative_tokens <= 16, "num_speculative_tokens must be in [1, 16]")
        check(1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
              "prompt_lookup_min must be >= 1 and <= prompt_lookup_max")
        check(self.speculative_max_batch_size >= 1, "speculative_max_batch_size must be >= 1")
        check(self.kv_events_publisher in ("zmq", "null"), "kv_events_publisher must be zmq or null")
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            endpoint = getattr(self, name)
            check(endpoint is None or endpoint.startswith(ZMQ_TRANSPORTS),
                  f"{name} must be a ZMQ address ({', '.join(ZMQ_TRANSPORTS)}...), got {endpoint!r}")
        check(self.kv_events_buffer_steps >= 1, "kv_events_buffer_steps must be >= 1")
        check(self.kv_events_hwm >= 0, "kv_events_hwm must be >= 0 (0 = no limit)")
        check(not self.enable_kv_cache_events or self.enable_prefix_caching,
              "enable_kv_cache_events needs enable_prefix_caching (without it no block is hashed or cached)")


def _coerce(name: str, raw: Any, annotation: str) -> Any:
    """Turn Triton's string parameters into the field's type; typed values pass through."""
    if not isinstance(raw, str):
        return raw
    text = raw.strip()
    optional = "None" in annotation
    if optional and text.lower() in ("", "none", "null"):
        return None
    if annotation.startswith("bool"):
        if text.lower() in ("true", "1", "yes", "on"):
            return True
        if text.lower() in ("false", "0", "no", "off"):
            return False
        raise ValueError(f"EngineConfig: {name} must be true or false, got {raw!r}")
    try:
        if annotation.startswith("int"):
            return int(text)
        if annotation.startswith("float"):
            return float(text)
    except ValueError as exc:
        raise ValueError(f"EngineConfig: {name} must be a number, got {raw!r}") from exc
    return text

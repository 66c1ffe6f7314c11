"""Turns a scheduled step into one packed forward pass and returns next-token logits.

Owns the model weights, the per-layer KV tensors ``[num_blocks, block_size, num_kv_heads,
head_dim]`` (sized by backend/worker/kv_cache_sizing.py; block ids come from the KV-cache
manager), the step's input buffers and, on CUDA, the captured decode graphs.

Per-step host work is kept small: the step's ids, positions, slots and block tables are
written with numpy into preallocated (pinned, on CUDA) host buffers and copied to
preallocated device buffers once per step; nothing loops over tokens or layers in Python.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from backend.config import EngineConfig
from backend.core.kv_cache_utils import cdiv
from backend.core.request import Request
from backend.lora.registry import MULTI_LORA_FILE
from backend.lora.slots import NO_SLOT, LoRABackend, LoRABatch, LoRASlots
from backend.model.architecture import ModelArchitecture
from backend.model.cpu_features import CpuFeatures, detect
from backend.model.cpu_linear import FP16_WEIGHT_MAX, largest_packed_bf16_weight, use_bf16_fp16_rows
from backend.model.cpu_linear_tuning import choose_cpu_linear, fp16_unavailable
from backend.model.llama import AttentionMetadata
from backend.model.loader import load_model
from backend.model.prefill_attention_choice import choose_prefill_attention
from backend.sample.prompt_logprobs import PromptLogprobRows
from backend.worker.cuda_graphs import DecodeGraphs, MixedGraphs, capture_sizes, mixed_token_sizes
from backend.worker import timing_cache
from backend.worker.kv_cache_sizing import KVCacheLayout, blocks_from_budget
from backend.worker.step_buffers import PendingTokens, StepBuffers
from kernels import cpu_native
from kernels.attention_backend import AttentionBackendKind, attention_backend_for

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(config: EngineConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.device)


def configure_cpu_threads(config: EngineConfig) -> int:
    """One intra-op thread per core the process may use (the engine thread is one of them):
    measured on 2 cores, a 16-sequence decode step is much faster on 2 threads than on 1.
    Triton's own threads and the adapter's sender need little CPU (a small fraction of a core
    each at 16 streams), so they get no core of their own."""
    threads = config.cpu_threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    return threads


def auto_dtype(device: torch.device, features: CpuFeatures | None = None) -> tuple[torch.dtype, str]:
    """``dtype=auto``: the weights' and KV cache's dtype on this device, and why.

    On CPU the rule is measured (docs/benchmarks.md, "dtype=auto on CPU"): bfloat16 where the
    CPU computes it natively (AVX512_BF16 or AMX-BF16), where it served clearly more output
    tokens/s than float32; float32 elsewhere, where bfloat16 has no arithmetic of its own: our
    kernels widen it to float32 (with AVX2 only that served slightly more than float32, still a
    choice, not the default: float32 is the oracle). Greedy
    tokens in bfloat16 differ from transformers' float32 after a while (the precision table);
    ``dtype=float32`` keeps the token-for-token oracle. ``features``: tests fake machines."""
    if device.type == "cuda":
        return torch.bfloat16, "CUDA"
    features = features or detect()
    if features.native_bf16:
        return torch.bfloat16, f"the CPU computes bfloat16 natively ({features.describe()})"
    return torch.float32, (f"no bfloat16 arithmetic on this CPU ({features.describe()}); dtype=bfloat16 runs "
                           "through kernels that widen it to float32")


def resolve_dtype(config: EngineConfig, device: torch.device) -> tuple[torch.dtype, str]:
    """The dtype to run in, and a line for the start-up log saying why."""
    if config.dtype == "auto":
        dtype, why = auto_dtype(device)
        return dtype, f"{str(dtype)[6:]} (dtype=auto: {why})"
    return _DTYPES[config.dtype], f"{config.dtype} (dtype={config.dtype})"


def resolve_max_model_len(config: EngineConfig, arch: ModelArchitecture) -> int:
    return min(config.max_model_len or arch.max_position_embeddings, arch.max_position_embeddings)


class ModelRunner:
    def __init__(self, config: EngineConfig, arch: ModelArchitecture) -> None:
        self.config = config
        self.prompt_logprob_rows: list[PromptLogprobRows] = []   # the last prepared step's (prepare)
        self.arch = arch
        self.device = resolve_device(config)
        self.dtype, self.dtype_choice = resolve_dtype(config, self.device)
        logger.info("weights and KV cache in %s", self.dtype_choice)
        if self.device.type == "cpu":
            logger.info("CPU engine: %d threads", configure_cpu_threads(config))
        self.block_size = config.block_size
        self.max_model_len = resolve_max_model_len(config, arch)
        self.attention = attention_backend_for(config.attention_backend, self.device)
        linear_choice = choose_cpu_linear(config.cpu_linear, self.dtype, arch, self.device.type == "cpu",
                                          config.max_num_seqs, config.quantization,
                                          fma_rows=config.cpu_linear_fma_rows, fp16_rows=config.cpu_linear_fp16_rows)
        self.cpu_linear = linear_choice.path
        self.bf16_fma_rows = linear_choice.fma_min_rows     # our bf16 kernel's float32 FMAs from these rows
        self.bf16_fp16_rows = 0                             # ... and float16 FMAs (set once the weights are seen)
        self.onednn_batch_hint = linear_choice.onednn_batch_hint
        # What the start-up chose and why, a line each: logged here, printed by the served model.
        self.startup_notes: list[str] = [f"weights and KV cache in {self.dtype_choice}"]
        if self.device.type == "cpu":
            bf16_kernel = self.cpu_linear == "native" and self.dtype == torch.bfloat16
            # Our bfloat16 kernel's AMX tiles run only where cpu_linear chose our kernel (it also
            # serves the LM head of a model whose projections go to oneDNN).
            amx = cpu_native.use_amx(bf16_kernel) if self.dtype == torch.bfloat16 else False
            version = "amx-bf16 (AMX tiles on)" if amx else cpu_native.linear_bf16_version()
            probe = cpu_native.amx_probe_result() if bf16_kernel and not amx else None
            if probe is not None and not probe.passed:
                version = f"{version}, AMX tiles off: {probe.describe()}"
            # Process-wide, like the AMX switch: cleared by every engine, set below once the weights are seen.
            use_bf16_fp16_rows(0)
            self.startup_notes.append(
                f"CPU {detect().describe()}, {str(self.dtype)[6:]} weights: linear layers {self.cpu_linear}"
                f"{f' ({version} kernel)' if bf16_kernel else ''}"
                f"{f' packed for {self.onednn_batch_hint} rows' if self.onednn_batch_hint else ''}"
                f" ({linear_choice.why})")
            logger.info("%s", self.startup_notes[-1])
        self.model = load_model(config.model, arch, self.dtype, self.device, config.load_format, config.seed,
                                self.attention, self.cpu_linear, config.quantization, config.fused_layer_ops,
                                self.onednn_batch_hint)
        # Timed on, or asked for (cpu_linear_fp16_rows): a user who asked learns why they are off.
        if self.device.type == "cpu" and (linear_choice.fp16_min_rows or config.cpu_linear_fp16_rows):
            self.startup_notes.append(self._use_fp16_matmuls(linear_choice.fp16_min_rows))
            logger.info("%s", self.startup_notes[-1])
        self.prefill_attention = choose_prefill_attention(
            config.cpu_prefill_attention, self.dtype, arch, self.block_size,
            self.device.type == "cpu" and self.attention.honours_sdpa_choice,
            bf16_kernel=config.cpu_prefill_bf16_kernel)
        self.model.sdpa_prompt_min_tokens = self.prefill_attention.sdpa_min_tokens
        if self.device.type == "cpu":
            self.startup_notes.append(f"prompt attention: {self.prefill_attention.describe()}")
            logger.info("%s", self.startup_notes[-1])
        self.startup_notes.append(f"fused layer ops (RMSNorm + residual, RoPE + KV write, SiLU x up): "
                                  f"{self.model.fused_layer_ops or 'off (torch ops)'}{self._cpu_decoder_note()}")
        logger.info("%s", self.startup_notes[-1])

        # Step buffers: at most max_num_batched_tokens tokens and max_num_seqs sequences per step.
        self.max_tokens = config.max_num_batched_tokens
        self.max_seqs = config.max_num_seqs
        self.max_blocks_per_seq = cdiv(self.max_model_len, self.block_size)
        on_cuda = self.device.type == "cuda"
        self.host = StepBuffers.allocate(self.max_tokens, self.max_seqs, self.max_blocks_per_seq,
                                         torch.device("cpu"), pin_memory=on_cuda)
        self.buffers = (StepBuffers.allocate(self.max_tokens, self.max_seqs, self.max_blocks_per_seq, self.device)
                        if on_cuda else self.host)
        self._host_np = self.host.numpy()
        # Per row of the host block tables, the block-id list written there (block_ids_of hands
        # out the same list while a request's blocks are unchanged): such a row is not rewritten.
        self._tables_written: list[list[int] | None] = [None] * self.max_seqs
        # Set when the last host->device copy of the step buffers has been queued: the host
        # side must not be rewritten before it completes (a step without sampling never
        # waits for the GPU, so the next prepare() could otherwise race the copy).
        self._inputs_copied: torch.cuda.Event | None = None

        # LoRA slots: made at start when the model folder lists adapters (on CUDA their weights
        # are then counted before the KV cache takes the rest, and the decode graphs include
        # LoRA), else at the first adapter request.
        self.lora_slots: LoRASlots | None = None
        if (Path(config.model) / MULTI_LORA_FILE).exists():
            self._make_lora_slots()

        self.kv_layout = KVCacheLayout(arch, self.block_size, self.dtype, self.device)
        self.num_blocks, kv_source = ((config.num_kv_blocks, "num_kv_blocks") if config.num_kv_blocks
                                      else blocks_from_budget(config, self.kv_layout, self.model,
                                                              min(self.max_tokens, self.max_model_len),
                                                              self.max_logits_rows()))
        self.kv_caches = self.kv_layout.allocate(self.num_blocks)
        self.startup_notes.append(
            f"KV cache: {self.num_blocks} blocks of {self.block_size} tokens "
            f"({self.num_blocks * self.kv_layout.bytes_per_block / 2**30:.2f} GiB, {kv_source})")
        logger.info("%s", self.startup_notes[-1])

        # Test hook: called with the requests of every batch about to be packed; raising in
        # it simulates a step that fails (tests/test_step_failures.py).
        self.fault_hook: Callable[[list[Request]], None] | None = None

        self.decode_graphs: DecodeGraphs | None = None
        # Only a forward that never syncs with the host can be captured: the attention backend's
        # (AttentionBackend.supports_cuda_graphs; the reference loops over sequences) and the
        # model's own layers (CausalLM.graph_unsafe_reason: e.g. MoE routing reads its experts).
        graph_unsafe = self.model.graph_unsafe_reason()
        if on_cuda and not config.enforce_eager and self.attention.supports_cuda_graphs and graph_unsafe is None:
            start = time.perf_counter()
            self.decode_graphs = DecodeGraphs(self.model, self.buffers, self.kv_caches, capture_sizes(self.max_seqs),
                                              self.max_model_len, capture=True, lora=self.lora_slots)
            self.startup_notes.append(f"decode steps replay CUDA graphs captured for batch sizes "
                                      f"{capture_sizes(self.max_seqs)} in {time.perf_counter() - start:.1f} s")
        elif on_cuda:
            self.startup_notes.append("decode steps run eagerly ("
                                      + ("enforce_eager=true" if config.enforce_eager else
                                         graph_unsafe if graph_unsafe is not None else
                                         f"attention backend {self.attention.name}: no graphs") + ")")
        if on_cuda:
            logger.info("%s", self.startup_notes[-1])
        self.mixed_graphs: MixedGraphs | None = None
        if self.decode_graphs is not None and config.cuda_graph_mixed_steps:
            start = time.perf_counter()
            sizes = mixed_token_sizes(self.max_tokens)
            self.mixed_graphs = MixedGraphs(self.model, self.buffers, self.kv_caches, sizes, self.max_logits_rows(),
                                            self.max_model_len, capture=True, lora=self.lora_slots)
            self.startup_notes.append(f"steps with prefill chunks or drafts replay CUDA graphs captured for token "
                                      f"counts {sizes} in {time.perf_counter() - start:.1f} s")
            logger.info("%s", self.startup_notes[-1])

    @property
    def attention_backend(self) -> AttentionBackendKind:
        """The resolved attention backend's kind (a str enum: equal to its config string)."""
        return self.attention.name

    def _cpu_decoder_note(self) -> str:
        """The start-up log's word on the C layer loop: whether it runs, and which projections
        it calls back (backend/model/cpu_decoder.py)."""
        decoder = self.model.cpu_decoder
        if decoder is None:
            return ""
        called_back = decoder.external_projections
        return ("; the decoder layers run as one C call a step"
                + (f" ({called_back} projections called back to their modules)" if called_back else ""))

    def _make_lora_slots(self) -> LoRASlots:
        backend = LoRABackend.for_attention_backend(self.attention.name)
        self.lora_slots = LoRASlots(self.config.max_loras, self.config.max_lora_rank, self.max_tokens, self.arch,
                                    self.dtype, self.device, backend)
        logger.info("LoRA: %d adapter slots, %s backend", self.config.max_loras, backend.value)
        return self.lora_slots

    def _use_fp16_matmuls(self, min_rows: int) -> str:
        """Turn on our bfloat16 kernel's float16 version from ``min_rows`` rows (the start-up timing's
        or EngineConfig.cpu_linear_fp16_rows) where every packed weight is in its range; says what
        was done."""
        if self.cpu_linear != "native" or self.dtype != torch.bfloat16:
            return "float16 matmuls: off (they need bfloat16 weights on our kernel)"
        if not min_rows:   # asked for, but choose_fp16_rows found no float16 version to run
            return f"float16 matmuls: off ({fp16_unavailable(self.cpu_linear, self.config.quantization)})"
        largest = largest_packed_bf16_weight(self.model)
        if largest > FP16_WEIGHT_MAX:
            return f"float16 matmuls: off (a weight of magnitude {largest:.3g} > {FP16_WEIGHT_MAX:g})"
        self.bf16_fp16_rows = use_bf16_fp16_rows(min_rows)
        if not self.bf16_fp16_rows:
            return "float16 matmuls: off (this build has no AVX512-FP16 version)"
        return f"float16 matmuls from {self.bf16_fp16_rows} rows (weights up to {largest:.3g})"

    def timing_signature(self) -> dict[str, object]:
        """What decides how long a step takes here, beside the step's shape: the key of the
        calibration cache (backend/worker/timing_cache.py) with the calibration shapes."""
        on_cuda = self.device.type == "cuda"
        return {
            "machine": torch.cuda.get_device_name(self.device) if on_cuda else cpu_native.cpu_identity(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "source": timing_cache.source_digest(),
            "model_config": hashlib.sha256((Path(self.config.model) / "config.json").read_bytes()).hexdigest(),
            "dtype": str(self.dtype),
            "attention_backend": self.attention.name.value,
            "cpu_linear": self.cpu_linear,
            "sdpa_prompt_min_tokens": self.model.sdpa_prompt_min_tokens,
            # which of our bfloat16 kernels run (start-up timings or the engine parameters)
            "bf16_fma_rows": self.bf16_fma_rows,
            "bf16_fp16_rows": self.bf16_fp16_rows,
            "prefill_bf16_kernel": (None if self.prefill_attention.bf16_kernel is None
                                    else self.prefill_attention.bf16_kernel.kernel),
            "onednn_batch_hint": self.onednn_batch_hint,
            "fused_layer_ops": self.model.fused_layer_ops,
            # on or off by the start-up probe (kernels/amx_probe.py): the same build can run either
            "amx_tiles": self.device.type == "cpu" and cpu_native.amx_in_use(),
            "quantization": self.config.quantization,
            "decode_graphs": self.decode_graphs is not None,
            "mixed_graphs": self.mixed_graphs is not None,
            "lora_slots": None if self.lora_slots is None else [self.config.max_loras, self.config.max_lora_rank],
            "block_size": self.block_size,
            "max_tokens": self.max_tokens,
            "max_seqs": self.max_seqs,
        }

    # ---- step limits -------------------------------------------------------------------------
    def max_logits_rows(self) -> int:
        """The most logits rows a step can have: one per sequence, plus one per draft when
        speculation is on."""
        drafts = (self.config.num_speculative_tokens * min(self.max_seqs, self.config.speculative_max_batch_size)
                  if self.config.speculative_method != "none" else 0)
        return min(self.max_seqs + drafts, self.max_tokens)

    # ---- one step ----------------------------------------------------------------------------
    def prepare(self, requests: list[Request], num_scheduled: dict[str, int], block_ids: dict[str, list[int]],
                spec_token_ids: dict[str, list[int]] | None = None, pending: PendingTokens | None = None,
                ) -> tuple[torch.Tensor, AttentionMetadata, list[Request]]:
        """Pack the step. Returns input ids, metadata and the requests that sample this step
        (those whose counter reaches the end of their token list), in logits-row order. A
        request with k drafts (``spec_token_ids``) takes them as inputs after its last token
        and gets k + 1 logits rows, one per position to verify. A decode whose input token the
        step before sampled and the host has not read (async_scheduling) takes it from
        ``pending`` on the device."""
        spec_token_ids = spec_token_ids or {}
        if self.fault_hook is not None:
            self.fault_hook(requests)
        bs = self.block_size
        host = self._host_np
        if self._inputs_copied is not None:
            self._inputs_copied.synchronize()
        num_seqs = len(requests)
        sampling: list[Request] = []
        pending_inputs: list[tuple[int, int]] = []   # (input row, row of pending.tokens)
        token = num_logits = 0
        max_query_len = max_seq_len = 0
        host["query_start_loc"][0] = 0
        for row, request in enumerate(requests):
            start = request.num_computed_tokens
            num_new = num_scheduled[request.request_id]
            end = start + num_new
            blocks = block_ids[request.request_id]
            drafts = spec_token_ids.get(request.request_id, ())
            if num_new == 1 and not drafts:
                # One token (every decode): scalar writes. numpy's per-call overhead was most of a
                # decode step's prepare.
                if start < len(request.token_ids):
                    host["input_ids"][token] = request.token_ids[start]
                else:   # sampled by the step before, not read by the host yet
                    if pending is None or request.request_id not in pending.rows:
                        raise RuntimeError(f"{request.request_id}: its input token was never sampled")
                    pending_inputs.append((token, pending.rows[request.request_id]))
                host["positions"][token] = start
                host["slot_mapping"][token] = blocks[start // bs] * bs + start % bs
            else:
                positions = np.arange(start, end)
                known = num_new - len(drafts)
                host["input_ids"][token:token + known] = request.token_ids[start:start + known]
                host["input_ids"][token + known:token + num_new] = drafts
                host["positions"][token:token + num_new] = positions
                table = np.asarray(blocks, dtype=np.int64)
                host["slot_mapping"][token:token + num_new] = table[positions // bs] * bs + positions % bs
            if self._tables_written[row] is not blocks:
                host["block_tables"][row, :len(blocks)] = blocks
                self._tables_written[row] = blocks
            token += num_new
            host["query_start_loc"][row + 1] = token
            host["seq_lens"][row] = end
            max_query_len, max_seq_len = max(max_query_len, num_new), max(max_seq_len, end)
            num_tokens = request.num_tokens + request.num_pending_tokens
            if end >= num_tokens:
                rows = end - num_tokens + 1      # 1, or 1 + drafts
                if rows == 1:
                    host["logits_indices"][num_logits] = token - 1
                else:
                    host["logits_indices"][num_logits:num_logits + rows] = np.arange(token - rows, token)
                num_logits += rows
                sampling.append(request)
        num_logits = self._prompt_logprob_rows(requests, num_scheduled, num_logits)
        lora = self._lora_batch(requests, token)
        separate = self.buffers is not self.host
        if separate:
            self.buffers.copy_rows_from(self.host, token, num_seqs, num_logits, cdiv(max_seq_len, bs),
                                        token if self.lora_slots is not None else 0)
        if pending_inputs:
            self._take_pending_inputs(pending_inputs, pending)
        if separate and self.device.type == "cuda":
            if self._inputs_copied is None:
                self._inputs_copied = torch.cuda.Event()
            self._inputs_copied.record()
        buf = self.buffers
        meta = AttentionMetadata(
            positions=buf.positions[:token], slot_mapping=buf.slot_mapping[:token],
            query_start_loc=buf.query_start_loc[:num_seqs + 1], seq_lens=buf.seq_lens[:num_seqs],
            block_tables=buf.block_tables[:num_seqs], logits_indices=buf.logits_indices[:num_logits],
            max_query_len=max_query_len, max_seq_len=max_seq_len, lora=lora)
        return buf.input_ids[:token], meta, sampling

    def _take_pending_inputs(self, pending_inputs: list[tuple[int, int]], pending: PendingTokens) -> None:
        """Write the pending tokens into their input rows on the device: the indices go over
        with the step's other inputs, the tokens never leave the device."""
        n = len(pending_inputs)
        rows, sources = zip(*pending_inputs)
        self._host_np["pending_rows"][:n] = rows
        self._host_np["pending_sources"][:n] = sources
        buf = self.buffers
        if buf is not self.host:
            buf.pending_rows[:n].copy_(self.host.pending_rows[:n], non_blocking=True)
            buf.pending_sources[:n].copy_(self.host.pending_sources[:n], non_blocking=True)
        buf.input_ids.index_copy_(0, buf.pending_rows[:n], pending.tokens.index_select(0, buf.pending_sources[:n]))

    def _prompt_logprob_rows(self, requests: list[Request], num_scheduled: dict[str, int], num_logits: int) -> int:
        """Logits rows after the sampling ones for the prompt positions this step computes of
        requests that asked for prompt logprobs: position p predicts prompt token p + 1, so the
        rows are positions [start, min(end, num_prompt_tokens - 1)) (the last prompt position is
        the sampling row). ``self.prompt_logprob_rows`` says whose they are, in order. Returns the
        logits row count."""
        self.prompt_logprob_rows = []
        host = self._host_np
        for row, request in enumerate(requests):
            if not request.wants_prompt_logprobs:
                continue
            start = request.num_computed_tokens
            stop = min(start + num_scheduled[request.request_id], request.num_prompt_tokens - 1)
            if stop <= start:
                continue
            token = host["query_start_loc"][row]
            host["logits_indices"][num_logits:num_logits + stop - start] = np.arange(token, token + stop - start)
            self.prompt_logprob_rows.append(PromptLogprobRows(request, start, stop - start))
            num_logits += stop - start
        return num_logits

    def _lora_batch(self, requests: list[Request], num_tokens: int) -> LoRABatch | None:
        """Each token row's adapter slot, written to the step buffers from the packed layout
        (query_start_loc) just written; None for a step of the base model alone. Once slots
        exist every step writes its rows (-1 for the base model): a decode graph that
        includes LoRA reads them whatever the step holds."""
        ids = self._host_np["lora_slots"]
        if all(r.lora is None for r in requests):
            if self.lora_slots is not None:
                ids[:num_tokens] = NO_SLOT
            return None
        slots = self.lora_slots or self._make_lora_slots()
        slot_of = slots.assign([r.lora for r in requests if r.lora is not None])
        starts = self._host_np["query_start_loc"]
        for row, request in enumerate(requests):
            ids[starts[row]:starts[row + 1]] = NO_SLOT if request.lora is None else slot_of[request.lora.lora_id]
        return LoRABatch(slots, self.buffers.lora_slots[:num_tokens])

    def synchronize(self) -> None:
        """Wait for the device to finish what was queued (a no-op on CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def execute(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Float32 logits, one row per sampling request. Decode-only steps (one token per
        sequence, every sequence samples) replay a captured CUDA graph when there is one."""
        num_seqs = meta.seq_lens.shape[0]
        decode_only = meta.max_query_len == 1 and meta.logits_indices.shape[0] == input_ids.shape[0] == num_seqs
        graphs = self.decode_graphs
        if decode_only and graphs is not None and graphs.covers(num_seqs) and (meta.lora is None or graphs.lora):
            return graphs.run(num_seqs)
        mixed, num_logits = self.mixed_graphs, meta.logits_indices.shape[0]
        if (not decode_only and mixed is not None and mixed.covers(input_ids.shape[0], num_seqs, num_logits)
                and (meta.lora is None or mixed.lora)):
            return mixed.run(input_ids.shape[0], num_seqs, num_logits)
        return self.model(input_ids, meta, self.kv_caches)

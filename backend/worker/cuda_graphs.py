"""CUDA graphs for decode-only steps, and (``cuda_graph_mixed_steps``) for the others.

A decode step launches hundreds of small kernels (a few per layer) whose launch cost, not
the GPU, bounds small batches. Capturing the whole forward once per batch size and
replaying it removes that cost. A step with ``n`` sequences replays the smallest captured
size ``>= n``; the padding rows decode a dummy token that writes no KV (slot -1) and whose
logits are dropped.

Served, most steps are mixed: in a closed loop a new prompt joins every few steps, and an
eager mixed step costs several decode steps of host launches. ``MixedGraphs`` captures the
forward once per token count (powers of two up to the token budget) for the whole sequence
capacity: the Triton attention kernel finds each query's sequence on the device (binary
search over ``query_start_loc``) and sizes its grid by tokens and sequences alone, so one
launch shape serves any mix of prefill chunks, decodes and drafts. The padding tokens form
one extra sequence that attends to block 0 and writes no KV; the sequences after it are
empty.

The graphs are handed what they need (the model, the step buffers they read in place, the
KV tensors and the sizes) and never see the runner: a step only has to fill the buffers
(``ModelRunner.prepare`` already did) and call ``run``, which pads the tail.

``capture=False`` runs the same padded forward eagerly: it lets CPU tests check the
padding logic, which is everything here except the capture itself.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Callable, Iterator

import torch
from torch import nn

from backend.lora.slots import NO_SLOT, LoRABatch, LoRASlots
from backend.model.llama import AttentionMetadata
from backend.worker.step_buffers import StepBuffers

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to max_num_seqs (always included): padding
    wastes at most 15 rows and few graphs are captured."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off (after one full collection), restored on exit.

    For graph capture: an unreachable object freed mid-capture can make a CUDA call that is
    illegal while a stream captures. Seen on an H200: an earlier engine's four CUDAGraphs,
    collected during the next engine's capture, each called ``cudaGraphExecDestroy`` ("operation
    not permitted when stream is capturing (function reset)"), which invalidated that capture."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@torch.inference_mode()
def capture_graphs(sizes: list[int], pad: Callable[[int], None], forward: Callable[[int], torch.Tensor],
                   device: torch.device) -> tuple[dict[int, torch.cuda.CUDAGraph], dict[int, torch.Tensor]]:
    """One graph per size of ``forward(size)`` (the buffers ``pad(size)`` first), and its output."""
    graphs: dict[int, torch.cuda.CUDAGraph] = {}
    outputs: dict[int, torch.Tensor] = {}
    pool = None
    with collector_paused():
        # Largest first, so smaller graphs reuse the memory pool the largest one reserved.
        for size in sorted(sizes, reverse=True):
            pad(size)
            forward(size)                       # warm-up: compiles the Triton kernels outside capture
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            # thread_local: another thread's CUDA calls (an old engine's loop thread freeing
            # its graphs, say) do not invalidate this capture; this thread's still do.
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                outputs[size] = forward(size)
            pool = graph.pool()
            graphs[size] = graph
    torch.cuda.synchronize(device)
    return graphs, outputs


class DecodeGraphs:
    def __init__(self, model: nn.Module, buffers: StepBuffers, kv_caches: KVCaches, batch_sizes: list[int],
                 max_seq_len: int, capture: bool = True, lora: LoRASlots | None = None) -> None:
        """``buffers``: the step buffers on the model's device (read in place at replay);
        ``max_seq_len``: the longest sequence any replay may attend over (max_model_len);
        ``lora``: adapter slots to include (each row's slot read from ``buffers.lora_slots``,
        so one graph serves any mix of adapters and the base model)."""
        self.model = model
        self.buffers = buffers
        self.kv_caches = kv_caches
        self.lora = lora
        self.max_seq_len = max_seq_len
        self.batch_sizes = sorted(batch_sizes)
        self.capture = capture
        self.device = device = buffers.input_ids.device
        largest = self.batch_sizes[-1]
        if largest > min(buffers.seq_lens.shape[0], buffers.input_ids.shape[0]):
            raise ValueError(f"graph batch {largest} exceeds the step buffers")
        # Decode layout is fixed: sequence i owns query row i and logits row i.
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(largest, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            self._capture_all()

    def covers(self, num_seqs: int) -> bool:
        return num_seqs <= self.batch_sizes[-1]

    def _meta(self, batch_size: int) -> AttentionMetadata:
        buf = self.buffers
        # max_seq_len is the model's limit, not the step's, so the launch shape baked into
        # the graph fits every later step; the kernels read true lengths from seq_lens.
        return AttentionMetadata(
            positions=buf.positions[:batch_size], slot_mapping=buf.slot_mapping[:batch_size],
            query_start_loc=self.query_start_loc[:batch_size + 1], seq_lens=buf.seq_lens[:batch_size],
            block_tables=buf.block_tables[:batch_size], logits_indices=self.logits_indices[:batch_size],
            max_query_len=1, max_seq_len=self.max_seq_len,
            lora=None if self.lora is None else LoRABatch(self.lora, buf.lora_slots[:batch_size]))

    def _pad(self, num_seqs: int, batch_size: int) -> None:
        """Rows num_seqs..batch_size become harmless decodes: token 0 at position 0, no KV
        write, attending to one key of block 0."""
        if num_seqs == batch_size:
            return
        buf = self.buffers
        rows = slice(num_seqs, batch_size)
        buf.input_ids[rows] = 0
        buf.positions[rows] = 0
        buf.slot_mapping[rows] = -1
        buf.seq_lens[rows] = 1
        buf.block_tables[rows, 0] = 0
        buf.lora_slots[rows] = NO_SLOT

    def _forward(self, batch_size: int) -> torch.Tensor:
        return self.model(self.buffers.input_ids[:batch_size], self._meta(batch_size), self.kv_caches)

    def _capture_all(self) -> None:
        self.graphs, self.outputs = capture_graphs(self.batch_sizes, lambda size: self._pad(0, size), self._forward,
                                                   self.device)

    def run(self, num_seqs: int) -> torch.Tensor:
        """Logits of the decode step already written into the step buffers."""
        batch_size = next(s for s in self.batch_sizes if s >= num_seqs)
        self._pad(num_seqs, batch_size)
        if not self.capture:
            return self._forward(batch_size)[:num_seqs]
        self.graphs[batch_size].replay()
        return self.outputs[batch_size][:num_seqs]


def mixed_token_sizes(max_tokens: int, smallest: int = 16) -> list[int]:
    """Powers of two from ``smallest`` below ``max_tokens``, then ``max_tokens``: a step pads
    to at most twice its tokens."""
    sizes, size = [], smallest
    while size < max_tokens:
        sizes.append(size)
        size *= 2
    return sizes + [max_tokens]


class MixedGraphs:
    """Graphs for steps that are not decode-only (prefill chunks, drafts), one per token count.

    Every graph holds ``num_seqs`` sequences (the step buffers' capacity) and ``max_logits``
    logits rows; a step fits when it leaves one sequence row free for its padding tokens."""

    def __init__(self, model: nn.Module, buffers: StepBuffers, kv_caches: KVCaches, token_sizes: list[int],
                 max_logits: int, max_seq_len: int, capture: bool = True, lora: LoRASlots | None = None) -> None:
        self.model = model
        self.buffers = buffers
        self.kv_caches = kv_caches
        self.lora = lora
        self.max_seq_len = max_seq_len
        self.token_sizes = sorted(token_sizes)
        self.num_seqs = buffers.seq_lens.shape[0]
        self.max_logits = max_logits
        self.capture = capture
        if self.token_sizes[-1] > buffers.input_ids.shape[0] or max_logits > buffers.logits_indices.shape[0]:
            raise ValueError("mixed-step graphs exceed the step buffers")
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            self._capture_all()

    def _logits_rows(self, num_tokens: int) -> int:
        return min(self.max_logits, num_tokens)

    def covers(self, num_tokens: int, num_seqs: int, num_logits: int) -> bool:
        return (num_tokens <= self.token_sizes[-1] and num_seqs < self.num_seqs
                and num_logits <= self._logits_rows(self._size_for(num_tokens)))

    def _size_for(self, num_tokens: int) -> int:
        return next(s for s in self.token_sizes if s >= num_tokens)

    def _meta(self, num_tokens: int) -> AttentionMetadata:
        buf = self.buffers
        # The launch shape baked into a graph must fit every later step: the longest query
        # and sequence the step could hold; the kernels read the true ones from the buffers.
        return AttentionMetadata(
            positions=buf.positions[:num_tokens], slot_mapping=buf.slot_mapping[:num_tokens],
            query_start_loc=buf.query_start_loc[:self.num_seqs + 1], seq_lens=buf.seq_lens,
            block_tables=buf.block_tables, logits_indices=buf.logits_indices[:self._logits_rows(num_tokens)],
            max_query_len=max(2, num_tokens), max_seq_len=self.max_seq_len,
            lora=None if self.lora is None else LoRABatch(self.lora, buf.lora_slots[:num_tokens]))

    def _pad(self, num_tokens: int, num_seqs: int, num_logits: int, size: int) -> None:
        """Tokens num_tokens..size: one more sequence, at position 0 of block 0, writing no KV;
        sequences after it empty (their tiles stop before reading a block table); logits rows
        past the step's read row 0."""
        buf = self.buffers
        tokens = slice(num_tokens, size)
        buf.input_ids[tokens] = 0
        buf.positions[tokens] = 0
        buf.slot_mapping[tokens] = -1
        buf.lora_slots[tokens] = NO_SLOT
        buf.query_start_loc[num_seqs + 1:] = size
        buf.seq_lens[num_seqs:] = 1
        buf.seq_lens[num_seqs] = max(1, size - num_tokens)
        buf.block_tables[num_seqs] = 0
        buf.logits_indices[num_logits:self._logits_rows(size)] = 0

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(self.buffers.input_ids[:size], self._meta(size), self.kv_caches)

    def _capture_all(self) -> None:
        self.graphs, self.outputs = capture_graphs(self.token_sizes, lambda size: self._pad(0, 0, 0, size),
                                                   self._forward, self.buffers.input_ids.device)

    def run(self, num_tokens: int, num_seqs: int, num_logits: int) -> torch.Tensor:
        """Logits of the step already written into the step buffers."""
        size = self._size_for(num_tokens)
        self._pad(num_tokens, num_seqs, num_logits, size)
        if not self.capture:
            return self._forward(size)[:num_logits]
        self.graphs[size].replay()
        return self.outputs[size][:num_logits]

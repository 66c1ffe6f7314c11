"""A CPU model's decoder layers in one C call a step (kernels/csrc/decoder.c).

``CausalLM._decoder_fused`` runs the same C kernels from Python, one layer at a time; that loop
is the reference, and this gives its bits (tests/test_cpu_decoder.py). What it saves is the
Python between the kernels, a noticeable share of the layers' time in a 16-sequence bfloat16
decode step (docs/benchmarks.md, "The decoder layers in one C call").

It applies wherever the fused C layer ops do (the C attention, float32 or bfloat16, no q/k
norm). A projection that is our C kernel (``NativeLinear`` in float32, ``NativeBf16Linear`` in
bfloat16) runs inside the C call; any other (oneDNN's ``PackedLinear``, ``TorchLinear``,
``Int8Linear``) is called back from C: its input is in the C call's scratch, and C goes on
with the module's own output. In a step with LoRA adapters every projection they adapt is
called back, and its adapters' deltas added there.
"""

from __future__ import annotations

import ctypes
import enum
import weakref
from typing import TYPE_CHECKING

import torch
from torch import nn

from backend.lora.batch import add_lora
from backend.model.cpu_linear import NativeBf16Linear, NativeLinear
from kernels import cpu_native
from kernels.cpu_native import (EXTERNAL_PREFILL_ATTENTION, EXTERNAL_PROJECTION, DecoderLayerPointers, DecoderShape,
                                DecoderStep)
from kernels.cpu_attention import CpuAttentionPlan, sdpa_prefill_attention

if TYPE_CHECKING:
    from backend.lora.slots import LoRABatch
    from backend.model.llama import AttentionMetadata, CausalLM

# The projection module of each dtype that runs inside the C call.
LINEAR_TYPES = {torch.float32: NativeLinear, torch.bfloat16: NativeBf16Linear}


class Projection(enum.IntEnum):
    """decoder.c's projection ids; the names are add_lora's."""
    qkv = 0
    o = 1
    gate_up = 2
    down = 3


PROJECTIONS = tuple(Projection)     # by id, for the callback (indexing is cheaper than the enum's lookup)


def unsupported_reason(model: CausalLM) -> str | None:
    """Why the model's layers cannot run as one C call, or None when they can."""
    dtype = model.model.embed_tokens.weight.dtype
    if model.arch.hidden_act != "silu" or model.arch.norm_weight_offset:
        return (f"Gemma-style layers ({model.arch.hidden_act} MLP, (1 + w) RMSNorms after attention and MLP too: "
                "the C layer loop runs Llama's)")
    if model.layer_ops is not cpu_native or model.arch.qk_norm:
        return "the fused C layer ops are off (or q/k norms, which they do not cover)"
    if dtype not in LINEAR_TYPES:
        return f"no C decoder for {dtype}"
    if model.arch.moe is not None:
        return "mixture-of-experts layers (the C layer loop knows the dense MLP only)"
    if any(window is not None for window in model.arch.layer_windows):
        return "sliding-window layers (the C layer loop attends every key)"
    if any(getattr(layer.self_attn, "sinks", None) is not None for layer in model.model.layers):
        return "attention sinks (gpt-oss; the C layer loop passes none to the attention kernels)"
    if model.arch.attn_logit_softcapping is not None:
        return "attention soft-capping (the C layer loop passes no cap to the attention kernels)"
    return None


def layer_projections(layer: nn.Module) -> dict[Projection, nn.Module]:
    return {Projection.qkv: layer.self_attn.qkv_proj, Projection.o: layer.self_attn.o_proj,
            Projection.gate_up: layer.mlp.gate_up_proj, Projection.down: layer.mlp.down_proj}


class CpuDecoder:
    """Runs ``CausalLM._decoder_fused``'s work as kernels/csrc/decoder.c. Holds the tensors whose
    addresses it hands to C (the packed weights, norms and biases as the model held them when
    it was built, the caches of the last step, the scratch), so none is freed while C may read
    it."""

    @classmethod
    def for_model(cls, model: CausalLM) -> CpuDecoder | None:
        """The model's C layer loop, or None where it does not apply (``unsupported_reason``)."""
        return cls(model) if unsupported_reason(model) is None else None

    def __init__(self, model: CausalLM) -> None:
        """Use ``for_model``: this assumes the fused C layer ops apply."""
        arch, layers = model.arch, model.model.layers
        self.dtype = model.model.embed_tokens.weight.dtype
        self.is_bf16 = int(self.dtype == torch.bfloat16)
        attention = layers[0].self_attn
        self.shape = DecoderShape(arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim,
                                  arch.intermediate_size, 0, arch.rms_norm_eps, attention.scale)
        self.layers = (DecoderLayerPointers * len(layers))()
        self.projections = [layer_projections(layer) for layer in layers]
        self._held: list[torch.Tensor] = []
        self.external_projections = 0      # how many run outside C (called back) in a step without LoRA
        for entry, layer, projections in zip(self.layers, layers, self.projections):
            entry.input_norm = self._hold(layer.input_layernorm.weight.detach())
            entry.post_norm = self._hold(layer.post_attention_layernorm.weight.detach())
            for which, module in projections.items():
                if type(module) is LINEAR_TYPES[self.dtype]:
                    setattr(entry, which.name, self._hold(module.packed_weight))
                    setattr(entry, which.name + "_bias", None if module.bias is None else self._hold(module.bias))
                else:       # not our kernel: its pointer stays NULL, and C calls it back
                    self.external_projections += 1
        self._caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._scratch = torch.empty(0, dtype=torch.uint8)
        self._offsets = (ctypes.c_int64 * 7)()
        # Per step, for the callback: each projection's input view of the scratch and output
        # view (where a module's output that C cannot read as it is gets copied).
        self._views: dict[Projection, tuple[torch.Tensor, torch.Tensor]] = {}
        # The last output of each called-back projection: C reads it after the callback returns.
        self._outputs: dict[Projection, torch.Tensor] = {}
        self._gate_up_layer = -1           # the layer whose gate|up was last called back
        self._with_lora = False
        self._plan: CpuAttentionPlan | None = None   # the step's, while C runs (prefill attention callback)
        self._attention_views: tuple[torch.Tensor, torch.Tensor] | None = None   # q and attention output
        self._error: BaseException | None = None
        # Kept while C may call it. Through a weak reference: a bound method would make a cycle
        # (decoder -> callback -> decoder) that keeps a dropped decoder, and with it the KV
        # caches and weights it references, alive until a full garbage collection.
        this = weakref.ref(self)
        self._callback = EXTERNAL_PROJECTION(lambda layer, projection: this()._run_projection(layer, projection))

    def _hold(self, tensor: torch.Tensor) -> int:
        if tensor.dtype not in (self.dtype, torch.float32) or not tensor.is_contiguous():
            raise ValueError(f"the C decoder needs contiguous weights, got {tensor.dtype} {tuple(tensor.shape)}")
        self._held.append(tensor)
        return tensor.data_ptr()

    def _bind_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Point the layers at these caches (kept referenced); False where the C attention
        cannot read them (another dtype than the model's: the Python loop's attention takes
        torch's path)."""
        if len(kv_caches) == len(self._caches) and all(
                new is old for pair, bound in zip(kv_caches, self._caches) for new, old in zip(pair, bound)):
            return True
        if len(kv_caches) != len(self.layers) or any(
                cache.dtype != self.dtype or not cache.is_contiguous() or cache.device.type != "cpu"
                or cache.shape != kv_caches[0][0].shape for pair in kv_caches for cache in pair):
            return False
        for entry, (key_cache, value_cache) in zip(self.layers, kv_caches):
            entry.key_cache, entry.value_cache = key_cache.data_ptr(), value_cache.data_ptr()
        self.shape.block_size = kv_caches[0][0].shape[1]
        self._caches = [tuple(pair) for pair in kv_caches]
        return True

    def run(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
            kv_caches: list[tuple[torch.Tensor, torch.Tensor]], plan: CpuAttentionPlan | None,
            lora: LoRABatch | None = None) -> bool:
        """Every layer over the step's residual stream ``h`` [tokens, hidden] (in place), writing
        the step's K/V to the caches: what ``CausalLM._decoder_fused`` does. ``lora``: the step's
        LoRA batch (active, as ``lora_batch`` makes it, while this runs), or None. False, with
        nothing done, where this step cannot run here (caches the C attention does not read,
        tensors of another layout): the caller runs the loop."""
        slots = meta.slot_mapping
        if not isinstance(plan, CpuAttentionPlan) or not self._bind_caches(kv_caches) or any(
                tensor.dtype != dtype or not tensor.is_contiguous() or tensor.device.type != "cpu"
                for tensor, dtype in ((h, self.dtype), (cos, self.dtype), (sin, self.dtype), (slots, torch.int64))):
            return False
        # The kernels read these without bounds: checked once a step, as the Python loop's
        # attention wrapper checks them once a layer.
        cpu_native.check_tensors([(tensor, dtype) for tensor, dtype in (
            (plan.decode_rows, torch.int64), (plan.decode_seq_lens, torch.int64), (plan.decode_tables, torch.int32),
            (plan.prefill_starts, torch.int64), (plan.prefill_query_lens, torch.int64),
            (plan.prefill_seq_lens, torch.int64), (plan.prefill_tables, torch.int32)) if tensor is not None])
        step = DecoderStep(tokens=h.shape[0], cos=cos.data_ptr(), sin=sin.data_ptr(), slots=slots.data_ptr())
        if plan.decode_rows is not None:
            step.num_decodes, step.decode_table_stride = plan.decode_rows.shape[0], plan.decode_tables.shape[1]
            step.decode_rows, step.decode_seq_lens = plan.decode_rows.data_ptr(), plan.decode_seq_lens.data_ptr()
            step.decode_tables = plan.decode_tables.data_ptr()
        if plan.prefill_starts is not None:
            step.num_prefills, step.prefill_table_stride = plan.prefill_starts.shape[0], plan.prefill_tables.shape[1]
            step.prefill_starts, step.prefill_query_lens = (plan.prefill_starts.data_ptr(),
                                                            plan.prefill_query_lens.data_ptr())
            step.prefill_seq_lens, step.prefill_tables = (plan.prefill_seq_lens.data_ptr(),
                                                          plan.prefill_tables.data_ptr())
        step.external_prefill_attention = int(bool(plan.sdpa_spans))
        # A LoRA step: the projections its adapters adapt are called back, their deltas added there.
        lora_mask = 0 if lora is None else sum(1 << which for which in Projection if lora.slots.adapts(which.name))
        scratch = self._scratch_for(h.shape[0], self.external_projections > 0 or lora_mask != 0
                                    or step.external_prefill_attention != 0)
        self._with_lora, self._error, self._gate_up_layer, self._plan = lora is not None, None, -1, plan
        status = cpu_native.load().decoder_layers(self.is_bf16, self.layers, len(self.layers), ctypes.byref(self.shape),
                                                  ctypes.byref(step), h.data_ptr(), scratch.data_ptr(),
                                                  self._callback, lora_mask, torch.get_num_threads())
        self._views, self._outputs, self._plan, self._attention_views = {}, {}, None, None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        if status != 0:
            raise RuntimeError(f"decoder_layers: {cpu_native.DECODER_STATUS.get(status, status)}")
        return True

    def _scratch_for(self, tokens: int, external: bool) -> torch.Tensor:
        """The step's activations (decoder.c's decoder_scratch_layout), grown as steps need;
        with external projections, their input and output views of it (``self._views``)."""
        total = cpu_native.load().decoder_scratch_layout(self.is_bf16, ctypes.byref(self.shape), tokens,
                                                         ctypes.byref(self._offsets))
        if self._scratch.numel() < total:
            # torch's CPU allocations are 64-byte aligned. Made under the step's inference mode
            # (ModelRunner.execute), as every step's views and copies into it are.
            self._scratch = torch.empty(total, dtype=torch.uint8)
        if external:
            def region(index: int, width: int) -> torch.Tensor:
                start = self._offsets[index]
                return self._scratch[start:start + tokens * width * self.dtype.itemsize].view(self.dtype).view(
                    tokens, width)
            shape = self.shape
            q_size = shape.num_heads * shape.head_dim
            x, qkv = region(0, shape.hidden), region(1, q_size + 2 * shape.num_kv_heads * shape.head_dim)
            q, attn = region(2, q_size), region(3, q_size)
            proj, gate_up = region(4, shape.hidden), region(5, 2 * shape.intermediate)
            self._views = {Projection.qkv: (x, qkv), Projection.o: (attn, proj), Projection.gate_up: (x, gate_up),
                           Projection.down: (gate_up[:, :shape.intermediate], proj)}
            heads = (tokens, shape.num_heads, shape.head_dim)
            self._attention_views = (q.view(heads), attn.view(heads))
        return self._scratch

    def _run_projection(self, layer: int, projection: int) -> int | None:
        """decoder.c's callback: one projection through its module (+ its LoRA deltas, in place
        on the module's output, as the loop adds them), or the step's SDPA prefill attention
        (``EXTERNAL_PREFILL_ATTENTION``). Returns the output's address, kept
        referenced until the next call for this projection; an exception is kept for ``run`` to
        raise (C sees NULL)."""
        try:
            if projection == EXTERNAL_PREFILL_ATTENTION:
                return self._run_prefill_attention(layer)
            which = PROJECTIONS[projection]
            source, target = self._views[which]
            if which is Projection.down and self._gate_up_layer == layer:
                # This layer's gate|up came from a module: SiLU(gate) * up is in its output.
                source = self._outputs[Projection.gate_up][:, :self.shape.intermediate]
            # forward, not __call__: no hooks on these modules, and less overhead a call (120 a step).
            out = self.projections[layer][which].forward(source)
            if self._with_lora:
                add_lora(out, source, layer, which.name)
            if out.dtype != target.dtype or out.shape != target.shape:
                raise TypeError(f"layer {layer}'s {which.name} gave {out.dtype} {tuple(out.shape)}, "
                                f"expected {target.dtype} {tuple(target.shape)}")
            if not out.is_contiguous():
                out = target.copy_(out)
            self._outputs[which] = out
            if which is Projection.gate_up:
                self._gate_up_layer = layer
            return out.data_ptr()
        except BaseException as error:   # noqa: BLE001 - raised again by run() once C has returned
            self._error = error
            return None

    def _run_prefill_attention(self, layer: int) -> int:
        """decoder.c's callback for the step's prefills that torch's SDPA attends: reads q
        from the scratch, writes their rows of the attention output there (C has written the
        other rows). Returns a non-NULL address: success."""
        q, attn = self._attention_views
        key_cache, value_cache = self._caches[layer]
        sdpa_prefill_attention(q, key_cache, value_cache, self.shape.scale, self._plan, attn)
        return attn.data_ptr()

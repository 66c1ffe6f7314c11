"""A CPU model's decoder layers in one C call a step (kernels/csrc/decoder.c).

``CausalLM._decoder_fused`` runs the same C kernels from Python, one layer at a time; that loop
is the reference, and this gives its bits (tests/test_cpu_decoder.py). What it saves is the
Python between the kernels: ~250 us a layer, 12% of the layers' time in a 16-sequence bfloat16
decode step on the 2-core Zen 3 (docs/benchmarks.md, "The decoder layers in one C call").

It applies where every piece of a layer is one of our C kernels: the fused C layer ops, our
linear kernel for every projection (``cpu_linear=native``: ``NativeLinear`` in float32,
``NativeBf16Linear`` in bfloat16), the C attention (caches of the model's dtype), no q/k norm;
and, step by step, no LoRA adapter in the batch (``CausalLM._forward`` falls back to the loop).
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from backend.model.cpu_linear import NativeBf16Linear, NativeLinear
from kernels import cpu_native
from kernels.cpu_native import DecoderLayerPointers, DecoderShape, DecoderStep
from kernels.cpu_attention import CpuAttentionPlan

if TYPE_CHECKING:
    from backend.model.llama import AttentionMetadata, CausalLM

# The projection module each dtype's layers must hold.
LINEAR_TYPES = {torch.float32: NativeLinear, torch.bfloat16: NativeBf16Linear}


def unsupported_reason(model: CausalLM) -> str | None:
    """Why the model's layers cannot run as one C call, or None when they can."""
    dtype = model.model.embed_tokens.weight.dtype
    if model.layer_ops is not cpu_native or model.arch.qk_norm:
        return "the fused C layer ops are off (or q/k norms, which they do not cover)"
    if dtype not in LINEAR_TYPES:
        return f"no C decoder for {dtype}"
    for i, layer in enumerate(model.model.layers):
        for module, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"), (layer.mlp, "gate_up_proj"),
                             (layer.mlp, "down_proj")):
            if type(getattr(module, name)) is not LINEAR_TYPES[dtype]:
                return f"layer {i}'s {name} is {type(getattr(module, name)).__name__}, not our C kernel"
    return None


class CpuDecoder:
    """Runs ``CausalLM._decoder_fused``'s work as kernels/csrc/decoder.c. Holds the tensors whose
    addresses it hands to C (the packed weights, norms and biases as the model held them when
    it was built, the caches of the last step), so none is freed while C may read it."""

    @classmethod
    def for_model(cls, model: CausalLM) -> CpuDecoder | None:
        """The model's C layer loop, or None where it does not apply (``unsupported_reason``)."""
        return cls(model) if unsupported_reason(model) is None else None

    def __init__(self, model: CausalLM) -> None:
        """Use ``for_model``: this assumes every piece of the layers is a C kernel."""
        arch, layers = model.arch, model.model.layers
        self.dtype = model.model.embed_tokens.weight.dtype
        self.is_bf16 = int(self.dtype == torch.bfloat16)
        attention = layers[0].self_attn
        self.shape = DecoderShape(arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim,
                                  arch.intermediate_size, 0, arch.rms_norm_eps, attention.scale)
        self.layers = (DecoderLayerPointers * len(layers))()
        self._held: list[torch.Tensor] = []
        for entry, layer in zip(self.layers, layers):
            entry.input_norm = self._hold(layer.input_layernorm.weight.detach())
            entry.post_norm = self._hold(layer.post_attention_layernorm.weight.detach())
            for field, module in (("qkv", layer.self_attn.qkv_proj), ("o", layer.self_attn.o_proj),
                                  ("gate_up", layer.mlp.gate_up_proj), ("down", layer.mlp.down_proj)):
                setattr(entry, field, self._hold(module.packed_weight))
                setattr(entry, field + "_bias", None if module.bias is None else self._hold(module.bias))
        self._caches: list[tuple[torch.Tensor, torch.Tensor]] = []

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
            kv_caches: list[tuple[torch.Tensor, torch.Tensor]], plan: CpuAttentionPlan | None) -> bool:
        """Every layer over the step's residual stream ``h`` [tokens, hidden] (in place), writing
        the step's K/V to the caches: what ``CausalLM._decoder_fused`` does. False, with nothing
        done, where this step cannot run here (caches the C attention does not read, tensors of
        another layout): the caller runs the loop."""
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
        status = cpu_native.load().decoder_layers(self.is_bf16, self.layers, len(self.layers), ctypes.byref(self.shape),
                                                  ctypes.byref(step), h.data_ptr(), torch.get_num_threads())
        if status != 0:
            raise MemoryError("decoder_layers: scratch allocation failed")
        return True

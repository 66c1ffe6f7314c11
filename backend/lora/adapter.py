"""A LoRA adapter in PEFT's format (``adapter_config.json`` + ``adapter_model.safetensors``),
laid out for our fused projections.

PEFT stores, per adapted ``nn.Linear`` of the base model, ``lora_A`` ``[r, in]`` and
``lora_B`` ``[out, r]``; the layer computes ``W x + scaling * B (A x)`` with
``scaling = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA). Our q/k/v and gate/up
projections are fused (backend/model/llama.py), so an adapter's A matrices of one fused
projection are stacked (one matmul for the shrink) and each part's B writes its own slice of
the fused output. ``scaling`` is folded into B at load time.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from backend.errors import InvalidRequestError
from backend.model.architecture import ModelArchitecture

MAX_RANK = 64
# PEFT module name -> (our fused projection, part index within it)
TARGETS = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
           "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0)}
PROJECTIONS = ("qkv", "o", "gate_up", "down")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])\.weight$")


def projection_inputs(arch: ModelArchitecture) -> dict[str, int]:
    """The input width of each fused projection."""
    return {"qkv": arch.hidden_size, "o": arch.num_heads * arch.head_dim, "gate_up": arch.hidden_size,
            "down": arch.intermediate_size}


def part_slices(arch: ModelArchitecture) -> dict[str, list[tuple[int, int]]]:
    """The output columns of each part of each fused projection."""
    q, kv, inter, hidden = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, \
        arch.intermediate_size, arch.hidden_size
    return {"qkv": [(0, q), (q, q + kv), (q + kv, q + 2 * kv)], "o": [(0, hidden)],
            "gate_up": [(0, inter), (inter, 2 * inter)], "down": [(0, hidden)]}


@dataclass
class LoRAPart:
    out_start: int
    out_end: int
    rank_start: int          # this part's rows of the stacked A
    rank_end: int
    b_t: torch.Tensor        # B transposed, [rank, out_end - out_start] contiguous, scaling folded in


@dataclass
class LoRAProjection:
    """One fused projection of one layer: ``delta = sum over parts of (x @ a.T)[:, part ranks] @ b.T``,
    computed as ``(x @ a.T) @ b_t``: ``b_t`` holds every part's B (transposed) in its block,
    zeros elsewhere, so that the expand is one matmul whatever the parts."""
    a: torch.Tensor          # [sum of the parts' ranks, in]
    parts: list[LoRAPart]
    b_t: torch.Tensor        # [sum of the parts' ranks, out of the whole fused projection]


@dataclass
class LoRAAdapter:
    name: str
    lora_id: int                                   # in block hashes and step metadata; unique per load
    folder: str
    rank: int
    layers: list[dict[str, LoRAProjection]]       # per layer: projection name -> weights (absent: not adapted)

    @property
    def num_bytes(self) -> int:
        return sum(p.a.numel() * p.a.element_size() + sum(part.b_t.numel() * part.b_t.element_size() for part in p.parts)
                   for layer in self.layers for p in layer.values())

    @classmethod
    def load(cls, name: str, lora_id: int, folder: str | Path, arch: ModelArchitecture, dtype: torch.dtype,
             device: torch.device, max_rank: int = MAX_RANK) -> "LoRAAdapter":
        """Read and check a PEFT LoRA folder; ``max_rank``: the largest rank served
        (EngineConfig.max_lora_rank). Errors name the adapter and what is unsupported."""
        from safetensors.torch import load_file

        folder = Path(folder)

        def refuse(why: str) -> InvalidRequestError:
            return InvalidRequestError("lora_name", f"adapter {name!r} ({folder}): {why}")

        try:
            config = json.loads((folder / "adapter_config.json").read_text())
            tensors = load_file(str(folder / "adapter_model.safetensors"))
        except (OSError, ValueError) as exc:
            raise refuse(f"cannot be read: {exc}") from exc
        if config.get("peft_type", "LORA") != "LORA":
            raise refuse(f"peft_type {config.get('peft_type')!r} is not LORA")
        for key, unsupported in (("use_dora", True), ("fan_in_fan_out", True)):
            if config.get(key) is unsupported:
                raise refuse(f"{key} is not supported")
        if config.get("bias", "none") != "none" or config.get("rank_pattern") or config.get("alpha_pattern") \
                or config.get("layers_to_transform") is not None or config.get("modules_to_save"):
            raise refuse("bias, rank/alpha patterns, layers_to_transform and modules_to_save are not supported")
        rank = int(config["r"])
        if not 1 <= rank <= max_rank:
            raise refuse(f"rank {rank} is outside [1, {max_rank}] (max_lora_rank)")
        alpha = float(config.get("lora_alpha", rank))
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank

        weights: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for key, tensor in tensors.items():
            match = _KEY.search(key)
            if arch.moe is not None and (".experts." in key or ".block_sparse_moe." in key or ".mlp.gate." in key or (
                    match is not None and match.group(2) in MLP_MODULES and arch.is_moe_layer(int(match.group(1))))):
                raise refuse(f"tensor {key!r}: LoRA on a mixture-of-experts layer's experts or router is not "
                             "supported (adapters on the attention projections are)")
            if match is None or match.group(2) not in TARGETS:
                raise refuse(f"unexpected tensor {key!r} (only q/k/v/o and gate/up/down projections)")
            layer = int(match.group(1))
            if layer >= arch.num_layers:
                raise refuse(f"tensor {key!r} names layer {layer}; the model has {arch.num_layers}")
            weights.setdefault((layer, match.group(2)), {})[match.group(3)] = tensor

        slices = part_slices(arch)
        inputs = projection_inputs(arch)
        layers: list[dict[str, LoRAProjection]] = [{} for _ in range(arch.num_layers)]
        for layer in range(arch.num_layers):
            for projection in PROJECTIONS:
                a_parts, parts = [], []
                for module, (target, index) in TARGETS.items():
                    pair = weights.get((layer, module))
                    if target != projection or pair is None:
                        continue
                    if set(pair) != {"A", "B"}:
                        raise refuse(f"layer {layer} {module} lacks lora_A or lora_B")
                    a, b = pair["A"], pair["B"]
                    start, end = slices[projection][index]
                    if a.shape != (rank, inputs[projection]) or b.shape != (end - start, rank):
                        raise refuse(f"layer {layer} {module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do "
                                     f"not fit rank {rank} and the base model's {inputs[projection]} -> {end - start}")
                    r0 = len(a_parts) * rank
                    a_parts.append(a)
                    parts.append(LoRAPart(start, end, r0, r0 + rank,
                                          (b.float() * scaling).T.to(device=device, dtype=dtype).contiguous()))
                if parts:
                    b_t = torch.zeros(parts[-1].rank_end, slices[projection][-1][1], dtype=dtype, device=device)
                    for part in parts:
                        b_t[part.rank_start:part.rank_end, part.out_start:part.out_end] = part.b_t
                    layers[layer][projection] = LoRAProjection(
                        torch.cat(a_parts).to(device=device, dtype=dtype).contiguous(), parts, b_t)
        if not any(layers):
            raise refuse("no LoRA weights found")
        return cls(name, lora_id, str(folder), rank, layers)

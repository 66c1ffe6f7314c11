"""Random LoRA adapters in PEFT's format, for the tests (tests/test_lora.py) and the LoRA
benchmark: PEFT's own initialisation leaves B at zero, an adapter with no effect."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from backend.lora.registry import MULTI_LORA_FILE

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(folder: Path, arch_config: dict, rank: int, alpha: int, modules: tuple[str, ...], seed: int,
                  std: float = 0.05, rslora: bool = False) -> Path:
    """A PEFT LoRA folder with random A and B (normal, ``std``) for the model ``arch_config``
    (its config.json) describes."""
    hidden, inter = arch_config["hidden_size"], arch_config["intermediate_size"]
    heads, kv_heads = arch_config["num_attention_heads"], arch_config["num_key_value_heads"]
    head_dim = arch_config.get("head_dim") or hidden // heads
    shapes = {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
              "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(arch_config["num_hidden_layers"]):
        for module in modules:
            block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            fan_in, fan_out = shapes[module]
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) * std
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * std
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0,
        "target_modules": list(modules), "bias": "none", "use_rslora": rslora, "fan_in_fan_out": False}))
    return folder


def model_with_adapters(base: Path, into: Path, adapters: dict) -> Path:
    """A model folder (links to ``base``'s files) with adapters and its multi_lora.json.
    ``adapters``: name -> (rank, alpha, target modules, seed); "rslora" in a name turns it on."""
    into.mkdir(parents=True, exist_ok=True)
    for item in base.iterdir():
        if not (into / item.name).exists():
            (into / item.name).symlink_to(item)
    config = json.loads((base / "config.json").read_text())
    entries = {}
    for name, (rank, alpha, modules, seed) in adapters.items():
        write_adapter(into / "adapters" / name, config, rank, alpha, modules, seed, rslora="rslora" in name)
        entries[name] = f"adapters/{name}"
    (into / MULTI_LORA_FILE).write_text(json.dumps(entries))
    return into

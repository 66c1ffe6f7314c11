"""LoRA adapters: PEFT-format loading (adapter.py), names from multi_lora.json (registry.py), the batched delta in a packed step (batch.py)."""

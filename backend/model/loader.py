"""Model weights: a Hugging Face folder's safetensors (fused into our q/k/v and gate/up
projections), or random weights from its config.json (``load_format="dummy"``)."""

from __future__ import annotations

from pathlib import Path

import torch

from backend.model.architecture import ModelArchitecture
from backend.model.cpu_linear import Int8Linear, replace_linears
from backend.model.llama import CausalLM, rope_inverse_frequencies
from backend.model.registry import ModelFamily, family_of
from kernels.attention_backend import AttentionBackend


def _checkpoint_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return tensors


def load_model(folder: str | Path, arch: ModelArchitecture, dtype: torch.dtype, device: torch.device,
               load_format: str = "auto", seed: int = 0, attention_backend: AttentionBackend | str = "reference",
               cpu_linear: str = "torch", quantization: str = "none", fused_layer_ops: bool = False,
               onednn_batch_hint: int | None = None) -> CausalLM:
    """``cpu_linear``, ``onednn_batch_hint``: a resolved choice
    (``backend.model.cpu_linear_tuning.choose_cpu_linear``); ``fused_layer_ops``: see
    ``CausalLM.use_fused_layer_ops``."""
    folder = Path(folder)
    family = family_of(arch.model_type)
    with torch.device("meta"):
        model = family.model_class()(arch, attention_backend)
    # Parameters are created in the target dtype on the target device: an 8B model never
    # exists in float32 on the GPU.
    model = model.to_empty(device=device).to(dtype)
    if load_format == "dummy":
        # Drawn on the device (fast for large models); the same seed gives the same weights.
        generator = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.fill_(1.0 - arch.norm_weight_offset)     # each norm scales by 1 (Gemma's: 1 + 0)
                else:
                    values = torch.randn(param.shape, generator=generator, device=device)
                    param.copy_(values.mul_(arch.initializer_range))
    else:
        tensors = _checkpoint_tensors(folder)
        remap = getattr(model, "remap_checkpoint", None)    # a family's own layout first (gpt_oss.py's experts)
        _load_checkpoint(model, tensors if remap is None else remap(tensors), family)
    # RoPE frequencies stay float32 whatever the weights' dtype (as in transformers).
    model.inv_freq = rope_inverse_frequencies(arch).to(device)
    if model.long_inv_freq is not None:          # LongRoPE's second set
        model.long_inv_freq = rope_inverse_frequencies(arch, long=True).to(device)
    if getattr(model, "local_inv_freq", None) is not None:     # the windowed layers' own base (gemma.py)
        model.local_inv_freq = rope_inverse_frequencies(arch.local_rope_architecture()).to(device)
    if quantization == "int8":
        # The decoder's projections only: the LM head stays in the model dtype (its rounding
        # would move every logit), and is packed below.
        replace_linears(model.model.layers, Int8Linear)
    # float32 or bfloat16 weights (native, onednn), as choose_cpu_linear chose.
    if cpu_linear in ("native", "onednn"):
        model.pack_for_cpu(cpu_linear, onednn_batch_hint)
    model.use_fused_layer_ops(fused_layer_ops)
    return model.eval()


def _checkpoint_sources(name: str, family: ModelFamily) -> list[str]:
    """The checkpoint tensors behind one of our parameters, concatenated along dim 0 (fused
    projections)."""
    for ours, theirs in family.renamed_weights.items():
        name = name.replace(ours, theirs)
    if ".experts." in name:
        for ours, parts in family.expert_weights.items():
            if f".{ours}." in name:
                return [name.replace(f".{ours}.", f".{part}.") for part in parts]
    for fused, parts in family.fused_weights.items():
        if fused + "." in name:
            return [name.replace(fused, part) for part in parts]
    return [name]


def _load_checkpoint(model: CausalLM, tensors: dict[str, torch.Tensor], family: ModelFamily) -> None:
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, param in params.items():
        sources = _checkpoint_sources(name, family)
        missing = [s for s in sources if s not in tensors]
        if missing:
            raise KeyError(f"checkpoint lacks {missing[:4]} (needed for {name})")
        value = torch.cat([tensors[s] for s in sources], dim=0) if len(sources) > 1 else tensors[sources[0]]
        if value.shape != param.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(value.shape)} != model {tuple(param.shape)}")
        param.data.copy_(value)
        loaded.update(sources)
    ignored = {k for k in tensors if k not in loaded and not k.endswith("rotary_emb.inv_freq")}
    if model.lm_head is None:
        ignored.discard("lm_head.weight")  # tied: some checkpoints store the copy anyway
    if ignored:
        raise KeyError(f"checkpoint tensors not used by the model: {sorted(ignored)[:5]}")

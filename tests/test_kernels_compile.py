"""The Triton kernels compile for real GPUs, with no GPU here.

The interpreter (tests/test_kernels.py) checks what the kernels compute but not Triton's
compiler: shape rules of ``tl.dot``, loop-carried types, early returns, shared-memory
size. This compiles, ahead of time, the very launches the dispatcher builds (built on
``meta`` tensors: shapes, dtypes and strides without data) for Hopper (sm_90) and Ampere
(sm_80), with Triton's bundled ptxas, over the layouts and dtypes we serve. It runs in a
subprocess because this test process runs Triton in interpreter mode.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
TARGETS = [(90, 32), (80, 32)]      # (compute capability, warp size): H100/H200, A100
LAYOUTS = [(32, 8, 128), (9, 3, 64), (8, 8, 64), (8, 2, 8)]  # (query heads, KV heads, head_dim); head_dim 8: tiny test models
# float16 and float32 (not served by default on CUDA) on the widest and the narrowest head only.
OTHER_DTYPE_LAYOUTS = [LAYOUTS[0], LAYOUTS[-1]]
SHARED_MEMORY_LIMIT = {90: 227 * 1024, 80: 163 * 1024}


def _type_names() -> dict:
    import torch

    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
            torch.int64: "i64"}


def _signature(launch) -> dict[str, str]:
    import torch

    type_names = _type_names()
    names = launch.kernel.arg_names
    sig = {}
    for name, arg in zip(names, launch.args):
        if isinstance(arg, torch.Tensor):
            sig[name] = "*" + type_names[arg.dtype]
        elif isinstance(arg, float):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    sig.update({name: "constexpr" for name in launch.constexprs})
    return sig


def _compiled(launch, capability: int, warp_size: int = 32):
    """``launch`` compiled ahead of time for one GPU target."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    return triton.compile(ASTSource(launch.kernel, _signature(launch), launch.constexprs),
                          target=GPUTarget("cuda", capability, warp_size), options=dict(launch.options))


def _compile(launch, dtype, what: str) -> list[str]:
    """One launch for each target of ``dtype``: Ampere for bfloat16 only (the dtype we serve),
    Hopper for everything. Labels start with the kernel, target and dtype."""
    import torch

    done = []
    for capability, warp_size in TARGETS if dtype == torch.bfloat16 else TARGETS[:1]:
        compiled = _compiled(launch, capability, warp_size)
        label = (f"{launch.kernel.__name__} sm_{capability} {_type_names()[dtype]} {what}: "
                 f"{compiled.metadata.shared} B shared")
        assert compiled.metadata.shared <= SHARED_MEMORY_LIMIT[capability], label
        done.append(label)
    return done


def compile_attention(dtype_name: str) -> list[str]:
    """Every attention and cache-write launch of one dtype, over the layouts and batch kinds."""
    import torch

    from kernels.triton_attention import attention_launches, cache_write_launch, plan_launch

    dtype = getattr(torch, dtype_name)
    meta = torch.device("meta")
    done = []
    for num_heads, num_kv_heads, head_dim in LAYOUTS if dtype == torch.bfloat16 else OTHER_DTYPE_LAYOUTS:
        key_cache = torch.empty(100, 16, num_kv_heads, head_dim, dtype=dtype, device=meta)
        tables = torch.empty(8, 64, dtype=torch.int32, device=meta)
        for name, num_tokens, num_seqs, max_query, max_seq in (("decode-split", 2, 2, 1, 8192),
                                                               ("decode", 256, 256, 1, 2048),
                                                               ("mixed", 600, 8, 512, 2048)):
            plan = plan_launch(num_tokens, num_seqs, num_heads, num_kv_heads, max_query, max_seq, num_sms=132)
            query = torch.empty(num_tokens, num_heads, head_dim, dtype=dtype, device=meta)
            layout = (query, key_cache, key_cache, torch.empty(num_seqs + 1, dtype=torch.int32, device=meta),
                      torch.empty(num_seqs, dtype=torch.int32, device=meta), tables, head_dim ** -0.5, plan,
                      torch.empty_like(query))
            launches = attention_launches(*layout)
            if dtype == torch.bfloat16 and (num_heads, num_kv_heads, head_dim) in OTHER_DTYPE_LAYOUTS \
                    and name != "decode":
                # gpt-oss's attention sinks: the kernel's variant and the merge's.
                sinks = torch.empty(num_heads, dtype=torch.float32, device=meta)
                for launch in attention_launches(*layout, window=128, sinks=sinks):
                    done += _compile(launch, dtype, f"h{num_heads}/kv{num_kv_heads} d{head_dim} {name} sinks")
            kv = torch.empty(num_tokens, 3 * num_kv_heads * head_dim, dtype=dtype, device=meta)
            kv = kv[:, :num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
            launches.append(cache_write_launch(kv, kv, key_cache, key_cache,
                                               torch.empty(num_tokens, dtype=torch.int64, device=meta)))
            for launch in launches:
                done += _compile(launch, dtype, f"h{num_heads}/kv{num_kv_heads} d{head_dim} {name}")
    return done


def compile_lora(dtype_name: str) -> list[str]:
    """LoRA's shrink/expand: SmolLM2's qkv (rank 64 x 3 parts) and a 4096 -> 14336 MLP projection."""
    import torch

    from kernels.triton_lora import expand_launch, shrink_launch

    dtype = getattr(torch, dtype_name)
    meta = torch.device("meta")
    done = []
    for num_tokens, in_features, out_features, max_rank in ((64, 576, 960, 192), (512, 4096, 28672, 128)):
        x = torch.empty(num_tokens, in_features, dtype=dtype, device=meta)
        y = torch.empty(num_tokens, max_rank, dtype=torch.float32, device=meta)
        slot_ids = torch.empty(num_tokens, dtype=torch.int32, device=meta)
        slot_ranks = torch.empty(4, dtype=torch.int32, device=meta)
        launches = [shrink_launch(x, torch.empty(4, max_rank, in_features, dtype=dtype, device=meta), slot_ids,
                                  slot_ranks, y),
                    expand_launch(y, torch.empty(4, max_rank, out_features, dtype=dtype, device=meta), slot_ids,
                                  slot_ranks, torch.empty(num_tokens, out_features, dtype=dtype, device=meta))]
        for launch in launches:
            done += _compile(launch, dtype, f"{in_features}->{out_features} r{max_rank}")
    return done


def compile_layer_ops(dtype_name: str) -> list[str]:
    """The fused layer ops: add_rms_norm at SmolLM2's, Llama 1B's, 8B's and 70B's hidden sizes
    (with and without the residual delta), rope_and_cache over the attention layouts,
    silu_and_mul at SmolLM2's and Llama 8B's intermediate sizes."""
    import torch

    from kernels.triton_layer_ops import add_rms_norm_launch, rope_and_cache_launch, silu_and_mul_launch

    dtype = getattr(torch, dtype_name)
    meta = torch.device("meta")
    done = []
    for hidden in (576, 2048, 4096, 8192):
        rows = torch.empty(64, hidden, dtype=dtype, device=meta)
        for delta in (None, rows):
            launch = add_rms_norm_launch(rows, delta, torch.empty(hidden, dtype=dtype, device=meta), rows, 1e-5)
            done += _compile(launch, dtype, f"hidden {hidden}{' + delta' if delta is not None else ''}")
    for num_heads, num_kv_heads, head_dim in LAYOUTS:
        qkv = torch.empty(64, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, device=meta)
        cos = torch.empty(64, head_dim, dtype=dtype, device=meta)
        cache = torch.empty(100, 16, num_kv_heads, head_dim, dtype=dtype, device=meta)
        launch = rope_and_cache_launch(qkv, cos, cos, torch.empty(64, dtype=torch.int64, device=meta), cache, cache,
                                       num_heads, num_kv_heads, head_dim)
        done += _compile(launch, dtype, f"h{num_heads}/kv{num_kv_heads} d{head_dim}")
    for inter in (1536, 14336):
        gate_up = torch.empty(64, 2 * inter, dtype=dtype, device=meta)
        done += _compile(silu_and_mul_launch(gate_up, inter), dtype, f"intermediate {inter}")
    # RoPE rounds each product as torch does: no multiply-add in its machine code (with Triton's
    # default contraction, sm_90 fused bfloat16 products and sums into fma.rn.bf16).
    ptx = _compiled(launch, 90).asm["ptx"]      # Triton's cache: compiled above already
    assert "fma.rn" not in ptx and "mul.rn" in ptx, "rope_and_cache fuses its products"
    return done


def compile_moe(dtype_name: str) -> list[str]:
    """The grouped expert matmul (kernels/triton_moe.py): gate|up and down (route-weighted, float32
    out) of a Qwen3-30B-A3B layer (hidden 2048, 128 experts of 768, top-8), in decode (blocks of
    16) and prefill (blocks of 64) steps. (Mixtral 8x7B's layer compiled too when this was written;
    the shapes change only runtime arguments, so one layer keeps the suite's time.)"""
    import torch

    from kernels.triton_moe import ExpertAlignment, block_m_for, grouped_matmul_launch

    dtype = getattr(torch, dtype_name)
    meta = torch.device("meta")
    done = []
    for hidden, experts, inter, top_k in ((2048, 128, 768, 8),):
        gate_up = torch.empty(experts, 2 * inter, hidden, dtype=dtype, device=meta)
        down = torch.empty(experts, hidden, inter, dtype=dtype, device=meta)
        for rows in (64, 512):
            assignments = rows * top_k
            block_m = block_m_for(assignments, experts)
            blocks = (assignments + min(experts, assignments) * (block_m - 1)) // block_m + 1
            alignment = ExpertAlignment(torch.empty(blocks * block_m, dtype=torch.int32, device=meta),
                                        torch.empty(blocks, dtype=torch.int32, device=meta),
                                        torch.empty(1, dtype=torch.int64, device=meta), block_m)
            x = torch.empty(rows, hidden, dtype=dtype, device=meta)
            h = torch.empty(assignments, 2 * inter, dtype=dtype, device=meta)
            y = torch.empty(assignments, hidden, dtype=torch.float32, device=meta)
            weights = torch.empty(assignments, dtype=torch.float32, device=meta)
            for launch, what in ((grouped_matmul_launch(x, top_k, gate_up, h, alignment), "gate_up"),
                                 (grouped_matmul_launch(h[:, :inter], 1, down, y, alignment, weights), "down")):
                done += _compile(launch, dtype, f"{what} hidden {hidden} e{experts} i{inter} rows {rows}")
    return done


def compile_all() -> list[str]:
    """Every group on its own process, as many at once as this process has cores (compiling
    is single-threaded: on 2 cores this halves the ~80 s it takes serially)."""
    from concurrent.futures import ProcessPoolExecutor

    groups = [(compile_attention, dtype) for dtype in ("bfloat16", "float16", "float32")]
    groups += [(compile_lora, dtype) for dtype in ("bfloat16", "float16", "float32")]
    groups += [(compile_layer_ops, dtype) for dtype in ("bfloat16", "float16", "float32")]
    groups += [(compile_moe, dtype) for dtype in ("bfloat16", "float32")]
    with ProcessPoolExecutor(max_workers=min(len(groups), len(os.sched_getaffinity(0)))) as pool:
        results = [pool.submit(function, dtype) for function, dtype in groups]
        return [label for result in results for label in result.result()]


def test_kernels_compile_for_hopper_and_ampere(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1", TRITON_DEFAULT_FP_FUSION="1", TRITON_CACHE_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "tests.test_kernels_compile"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    compiled = [line for line in done.stdout.splitlines() if " sm_" in line]
    # per (dtype, layout, batch kind): attention + cache write (+ merge when split), on sm_90;
    # bfloat16 on sm_80 too
    assert len(compiled) >= 2 * 3 * (len(LAYOUTS) * len(TARGETS) + 2 * len(OTHER_DTYPE_LAYOUTS)), done.stdout[-2000:]
    lora = [line for line in compiled if line.startswith("_lora_")]
    assert len(lora) == 2 * 2 * (2 + 1 + 1), lora   # 2 kernels x 2 shapes x (bf16 on two targets, fp16, fp32)
    layer_ops = [line for line in compiled if line.startswith(("_add_rms_norm", "_rope_and_cache", "_silu_and_mul"))]
    # (8 norms + the rope of each layout + 2 SiLUs) x (bf16 on two targets, fp16, fp32)
    assert len(layer_ops) == (8 + len(LAYOUTS) + 2) * (2 + 1 + 1), layer_ops
    moe = [line for line in compiled if line.startswith("_grouped_matmul")]
    assert len(moe) == 2 * 2 * (2 + 1), moe   # 2 steps x 2 matmuls x (bf16 on two targets, fp32)


if __name__ == "__main__":
    for line in compile_all():
        print(line)

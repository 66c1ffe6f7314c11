"""Linear layers for CPU (``EngineConfig.cpu_linear``): our C kernel, prepacked oneDNN, or
weight-only int8 (opt-in).

``F.linear`` hands MKL the weight in its checkpoint layout, and MKL re-packs it into its
blocked layout on every call; for the decode batches an engine runs (tens of rows against
a weight of millions) that packing is a large share of the matmul. Packing each weight
once at load time, as PyTorch's own CPU inference path (inductor's weight freezing) does,
measured clearly faster for a decoder layer's projections, and more so for SmolLM2's
49152-row LM head, at 16 rows (docs/benchmarks.md). Our own kernel over weights packed in
16-column panels (``NativeLinear``, kernels/csrc/linear_f32.c) is faster again than
oneDNN's on the whole model's projections, at 16 rows and at one.

``F.linear`` stays the reference: ``cpu_linear=torch`` serves with it, and tests compare
every path with it.
"""

from __future__ import annotations

import ctypes
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from backend.config import CPU_LINEAR_CHOICES
from backend.model.cpu_features import CpuFeatures, CpuIsa, detect
from kernels import cpu_native

PANEL_WIDTH = 16    # output columns per packed panel: NR in kernels/csrc/linear_f32.c


def onednn_packing_available(dtype: torch.dtype = torch.float32, features: CpuFeatures | None = None) -> bool:
    """oneDNN can prepack weights of this dtype here: float32 wherever torch has oneDNN; bfloat16
    only with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT (elsewhere torch refuses at packing time)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    if dtype == torch.bfloat16:
        features = features or detect()
        return features.avx512 or "avx_ne_convert" in features.flags
    return dtype == torch.float32


def native_kernel_available(dtype: torch.dtype) -> bool:
    """Our C matmul for this dtype builds and runs here: float32 with AVX2 + FMA, bfloat16 with
    AVX512_BF16 (dot products) or AVX2 + FMA (widened to float32 in registers)."""
    if dtype == torch.float32:
        return cpu_native.linear_available()
    return dtype == torch.bfloat16 and cpu_native.linear_bf16_available()


def bf16_fma_built(library: ctypes.CDLL | None = None) -> bool:
    """Our bfloat16 kernel's build has its float32-FMA version for prompt-sized calls
    (kernels/csrc/linear_bf16.c: the packed bfloat16 weight widened in registers, 512-bit FMAs;
    built where gcc targets AVX-512F)."""
    library = cpu_native.load() if library is None else library
    return library is not None and bool(library.linear_bf16_fma_built())


def use_bf16_fma_rows(min_rows: int, library: ctypes.CDLL | None = None) -> int:
    """From how many rows our bfloat16 kernel's calls run its float32-FMA version, for this
    process (0: never; the dot products, or the AVX2 version, below). Returns the threshold now in
    effect: 0 where the version is not built. The engine sets it once at start-up, from a timing
    (``backend.model.cpu_linear_tuning.choose_fma_rows``); AMX tiles, where on, take precedence."""
    library = cpu_native.load() if library is None else library
    return 0 if library is None else int(library.linear_bf16_use_fma(max(int(min_rows), 0)))


def use_bf16_fp16_rows(min_rows: int, library: ctypes.CDLL | None = None) -> int:
    """From how many rows our bfloat16 kernel's calls run its float16 version (AVX512-FP16 builds;
    0: never), for this process; returns the threshold now in effect (0 where it is not built).
    The engine sets it once its weights are loaded (``ModelRunner``), from the start-up timing
    (``backend.model.cpu_linear_tuning.choose_fp16_rows``) where every weight is in range; it
    comes before the float32 FMAs, and never serves ``linear_bf16_logits``."""
    library = cpu_native.load() if library is None else library
    return 0 if library is None else int(library.linear_bf16_use_fp16(max(int(min_rows), 0)))


def bf16_fp16_rows(library: ctypes.CDLL | None = None) -> int:
    """The threshold ``use_bf16_fp16_rows`` left (0: the float16 version never runs)."""
    library = cpu_native.load() if library is None else library
    return 0 if library is None else int(library.linear_bf16_fp16_rows())


def bf16_fp16_built(library: ctypes.CDLL | None = None) -> bool:
    """Our bfloat16 kernel's build has its float16 version (gcc targets AVX512-FP16)."""
    library = cpu_native.load() if library is None else library
    return library is not None and bool(library.linear_bf16_fp16_built())


# The float16 version holds a packed weight's values in float16 and sums up to 32 products per
# lane in it, each x row scaled under 1: weights up to this magnitude keep the sums in range.
FP16_WEIGHT_MAX = 1024.0


def largest_packed_bf16_weight(model: nn.Module) -> float:
    """The largest magnitude in any bfloat16 weight our kernel packed (0 if none)."""
    largest = 0.0
    for module in model.modules():
        packed = getattr(module, "packed_weight", None)
        if isinstance(packed, torch.Tensor) and packed.dtype == torch.bfloat16 and packed.numel():
            largest = max(largest, float(packed.abs().max()))
    return largest


def bf16_fma_rows(library: ctypes.CDLL | None = None) -> int:
    """The threshold ``use_bf16_fma_rows`` left (0: the FMA version never runs)."""
    library = cpu_native.load() if library is None else library
    return 0 if library is None else int(library.linear_bf16_fma_rows())


def resolve_cpu_linear(choice: str, dtype: torch.dtype, on_cpu: bool = True,
                       features: CpuFeatures | None = None) -> str:
    """The linear-layer path for these weights on this CPU. ``auto`` follows the measured rule
    (docs/benchmarks.md, "CPU linear layers"; ``python -m benchmarks.cpu_linear``):

    | weights  | CPU                      | auto   | why (decode rows 16, the serving regime)              |
    |----------|--------------------------|--------|-------------------------------------------------------|
    | float32  | AVX2 + FMA, no AVX-512   | native | faster than oneDNN's                                   |
    | float32  | AVX-512                  | onednn | 512-bit registers: faster than ours, more at 64 rows   |
    | bfloat16 | AVX512_BF16 (no AMX)     | native | our bf16 kernel: faster than prepacked oneDNN          |
    | bfloat16 | AMX-BF16                 | onednn | faster than our dot products;                          |
    |          |                          |        | with our AMX version built, ``auto`` times both at     |
    |          |                          |        | start-up (backend/model/cpu_linear_tuning.py): the     |
    |          |                          |        | tiles won every timing so far                          |
    | bfloat16 | AVX2 + FMA, no bf16 math | native | our kernel's AVX2 version (widening): see the docs     |
    | other    | any                      | torch  | F.linear                                              |

    ``native`` is our C kernel: float32 (AVX2 + FMA) or bfloat16 (AMX tiles from 2 rows where
    the CPU has them, AVX512_BF16 dot products, else AVX2 + FMA). On a CPU with bfloat16
    arithmetic only the AVX512_BF16 build of the bfloat16 kernel is ``native`` (a compiler that
    cannot target it leaves oneDNN). An explicit choice that
    cannot run here is an error at start-up. ``features`` defaults to this machine's (tests
    pass others)."""
    if choice not in CPU_LINEAR_CHOICES:
        raise ValueError(f"cpu_linear must be one of {CPU_LINEAR_CHOICES}, got {choice!r}")
    if choice == "measure":
        raise ValueError("cpu_linear=measure is a timing at start-up: backend.model.cpu_linear_tuning.choose_cpu_linear")
    features = features or detect()
    if not on_cpu:
        if choice not in ("auto", "torch"):
            raise ValueError(f"cpu_linear={choice} applies to CPU weights")
        return "torch"
    if choice == "native" and not native_kernel_available(dtype):
        raise ValueError("cpu_linear=native needs gcc and float32 or bfloat16 weights on a CPU with AVX2 and FMA")
    if choice == "onednn" and not onednn_packing_available(dtype, features):
        raise ValueError("cpu_linear=onednn needs float32 weights and a torch build with oneDNN, or bfloat16 "
                         "weights on a CPU with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT")
    if choice != "auto":
        return choice
    if dtype == torch.float32:
        if features.avx512 and onednn_packing_available():
            return "onednn"
        if native_kernel_available(dtype):
            return "native"
        return "onednn" if onednn_packing_available() else "torch"
    if dtype == torch.bfloat16:
        kernel = cpu_native.linear_bf16_version()
        if features.isa == CpuIsa.AVX512_BF16 and kernel == "avx512-bf16":
            return "native"
        if features.native_bf16:
            return "onednn" if onednn_packing_available(dtype, features) else "torch"
        if kernel is not None:
            return "native"
    return "torch"


def rule_is_measured(dtype: torch.dtype, features: CpuFeatures | None = None) -> bool:
    """Whether ``resolve_cpu_linear``'s ``auto`` is taken as it stands for this dtype and CPU. The
    one cell that is timed at start-up instead: bfloat16 on AMX where our kernel's AMX version is
    built. oneDNN won against our dot products there; the tiles beat oneDNN in every timing so
    far, at 16 rows and at 512, but by margins that varied by machine, and the AMX probe may
    still turn the tiles off, so the engine keeps timing them where it runs (docs/benchmarks.md,
    "Side by side in one call on the H100 machine's Xeon")."""
    features = features or detect()
    return not (dtype == torch.bfloat16 and features.isa == CpuIsa.AMX_BF16
                and cpu_native.linear_bf16_version() == "amx-bf16")


def _in_panels(weight: torch.Tensor, dtype: torch.dtype, row_shape: tuple[int, ...]) -> torch.Tensor:
    """[out, in] -> [ceil(out / 16), row_shape[0], 16, *row_shape[1:]] in ``dtype``, zero past
    ``out``; each weight row viewed as ``row_shape``. Written in one copy: padding the weight and
    then transposing it copied it twice, a noticeable part of an engine's start-up;
    ``tests/test_cpu_linear.py`` holds it to that obvious version."""
    out_features, in_features = weight.shape
    num_panels = -(-out_features // PANEL_WIDTH)
    full = out_features // PANEL_WIDTH
    packed = torch.empty(num_panels, row_shape[0], PANEL_WIDTH, *row_shape[1:], dtype=dtype)

    def panels(rows: torch.Tensor) -> torch.Tensor:
        return rows.reshape(-1, PANEL_WIDTH, *row_shape).transpose(1, 2)

    weight = weight.detach()
    packed[:full].copy_(panels(weight[:full * PANEL_WIDTH]))
    if full < num_panels:
        tail = torch.zeros(PANEL_WIDTH, in_features, dtype=dtype)
        tail[:out_features - full * PANEL_WIDTH] = weight[full * PANEL_WIDTH:]
        packed[full:].copy_(panels(tail))
    return packed


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [ceil(out / 16), in, 16] float32: each panel holds 16 output columns,
    k-major, zero-padded past ``out`` (the layout kernels/csrc/linear_f32.c reads)."""
    return _in_panels(weight, torch.float32, (weight.shape[1],))


class _NativeKernelLinear(nn.Module):
    """``y = x @ W.T + b`` through one of our C kernels: the weight packed once (``pack``), each
    call on 2-D rows with unit column stride (``matmul``). Subclasses say which kernel."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed_weight = self.pack(weight)
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        leading = x.shape[:-1]
        if x.dim() != 2 or x.stride(-1) != 1:
            x = x.reshape(-1, self.in_features).contiguous()
        return self.matmul(x).view(*leading, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class NativeLinear(_NativeKernelLinear):
    """float32 through kernels/csrc/linear_f32.c, ``W`` packed in 16-column panels."""

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError(f"NativeLinear is float32 on CPU, got {weight.dtype} on {weight.device}")
        return pack_panels(weight)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_native.linear_f32(x, self.packed_weight, self.out_features, self.bias)


def pack_pairs(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] bfloat16 -> [ceil(out / 16), in / 2, 16, 2]: panels of 16 output columns with
    the input dimension in pairs, zero-padded past ``out`` (kernels/csrc/linear_bf16.c)."""
    return _in_panels(weight, torch.bfloat16, (weight.shape[1] // 2, 2))


class NativeBf16Linear(_NativeKernelLinear):
    """bfloat16 through our kernel (kernels/csrc/linear_bf16.c: AVX512_BF16 dot products, else
    AVX2 widening; on AVX-512F CPUs float32 FMAs over the widened weight from the rows
    ``use_bf16_fma_rows`` set), ``W`` packed in pairs (float32 sums over the whole row, rounded
    once, as oneDNN's bfloat16 matmul does)."""

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.shape[1] % 2:
            raise ValueError(f"NativeBf16Linear is bfloat16 on CPU with an even input size, got {weight.dtype} "
                             f"{tuple(weight.shape)} on {weight.device}")
        return pack_pairs(weight)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_native.linear_bf16(x, self.packed_weight, self.out_features, self.bias)


def native_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
    """Our C kernel for the weight's dtype (``cpu_linear=native``). The bfloat16 kernel reads
    inputs in pairs: a projection with an odd input size (none in the models we load) goes
    to prepacked oneDNN instead, or where oneDNN cannot pack bfloat16, to ``F.linear``."""
    if weight.dtype != torch.bfloat16:
        return NativeLinear(weight, bias)
    if weight.shape[1] % 2 == 0:
        return NativeBf16Linear(weight, bias)
    return PackedLinear(weight, bias) if onednn_packing_available(torch.bfloat16) else TorchLinear(weight, bias)


def linear_maker(kind: str, onednn_batch_hint: int | None = None
                 ) -> Callable[[torch.Tensor, torch.Tensor | None], nn.Module]:
    """What packs a weight for a packed ``cpu_linear`` path: ``native`` (ours) or ``onednn``
    (packed for ``onednn_batch_hint`` rows where given)."""
    if kind == "native":
        return native_linear
    if kind == "onednn":
        return lambda weight, bias: PackedLinear(weight, bias, batch_size=onednn_batch_hint)
    raise ValueError(f"no packed linear path {kind!r}")


class TorchLinear(nn.Module):
    """``F.linear`` on the weight as it is: the reference path, as a module."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = weight.detach()
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Float32Logits(nn.Module):
    """The LM head of a bfloat16 model on CPU, giving float32 logits: bfloat16 logits (8
    significant bits) tie and reorder the top tokens. Through our bfloat16 kernel (bfloat16
    weights, exact products, float32 sums; AVX512_BF16 or AVX2) where it builds; elsewhere
    through a float32 copy of the weight (prepacked oneDNN or ``F.linear``), the same arithmetic."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed_weight = self.float_head = self.float_weight = None
        if weight.dtype == torch.bfloat16 and self.in_features % 2 == 0 and cpu_native.linear_bf16_available():
            self.packed_weight = pack_pairs(weight)
        elif onednn_packing_available():
            self.float_head = PackedLinear(weight.detach().float(), None)
        else:
            self.float_weight = weight.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.float_head is not None:
            return self.float_head(x.float())
        if self.float_weight is not None:
            return F.linear(x.float(), self.float_weight)
        if x.stride(-1) != 1:
            x = x.contiguous()
        return cpu_native.linear_bf16_logits(x, self.packed_weight, self.out_features)

    def extra_repr(self) -> str:
        path = f"bf16 kernel ({cpu_native.linear_bf16_version()})" if self.packed_weight is not None else "float32 copy"
        return f"in_features={self.in_features}, out_features={self.out_features}, {path}"


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` held in oneDNN's blocked layout (opaque tensor)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, batch_size: int | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # The engine gives no batch-size hint: one packed weight serves every number of rows.
        # ``batch_size``: the layout oneDNN picks for that many rows (benchmarks.cpu_linear's
        # ``onednn-hint`` path measures whether a hint pays where it may, bfloat16 on AMX).
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), batch_size)
        self.bias = None if bias is None else bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int8Linear(nn.Module):
    """Weight-only int8 (``quantization=int8``): symmetric per-output-channel scales,
    ``W ~= scale[n] * Wq[n, :]``; the matmul runs in torch's int8 weight kernel with
    bfloat16 activations and the result is cast back. A quarter of float32's weight bytes;
    measured slower than packed float32 from 16 rows up and faster for a single row
    (docs/benchmarks.md)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        weight = weight.detach().float()
        scales = weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.qweight = torch.round(weight / scales.unsqueeze(1)).clamp(-127, 127).to(torch.int8)
        self.scales = scales.to(torch.bfloat16)
        self.bias = None if bias is None else bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch._weight_int8pack_mm(x.to(torch.bfloat16), self.qweight, self.scales).to(x.dtype)
        return y if self.bias is None else y + self.bias


def replace_linears(module: nn.Module, make: Callable[[torch.Tensor, torch.Tensor | None], nn.Module]) -> int:
    """Replace every ``nn.Linear`` below ``module`` by ``make(weight, bias)``; returns how many.
    The original weights are dropped (the replacement keeps its own copy)."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, make(child.weight, child.bias))
            count += 1
        else:
            count += replace_linears(child, make)
    return count

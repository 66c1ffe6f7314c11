"""The C kernels for CPU, built on first use: decode attention over the paged cache, float32
or bfloat16 (kernels/csrc/paged_attention.c), the float32 linear layer (kernels/csrc/linear_f32.c),
the bfloat16 linear layer and LM head with float32 logits (kernels/csrc/linear_bf16.c), the fused small ops of a layer (residual add + RMSNorm, RoPE + KV write, SiLU x up), float32 or bfloat16 (kernels/csrc/layer_ops.c),
LoRA over a packed batch (kernels/csrc/lora.c) and a bfloat16 mixture-of-experts block (kernels/csrc/moe.c).

Plain C with OpenMP, no torch headers: gcc builds them in about a second, so they are
compiled for the machine it runs on (``-march=native``) the first time a process needs it
and cached by a hash of the source, the flags and the CPU. It is called through ctypes,
which releases the GIL for the call. torch must be imported first: the library's
``libgomp.so.1`` then binds to the OpenMP runtime torch already loaded (one thread pool).

Without a C compiler ``load()`` returns None: attention falls back to the batched torch
implementation in ``cpu_attention.py`` and linear layers to oneDNN (``backend/model/cpu_linear.py``).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

from kernels import amx_probe

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = tuple(CSRC / name for name in ("paged_attention.c", "linear_f32.c", "linear_bf16.c", "layer_ops.c",
                                         "lora.c", "sampling.c", "decoder.c", "moe.c"))
HEADERS = tuple(CSRC / name for name in ("bf16.h", "vec_exp.h"))  # hashed, not compiled alone
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


# kernels/csrc/decoder.c's structs, field for field (backend/model/cpu_decoder.py fills them).
class DecoderLayerPointers(ctypes.Structure):
    """decoder_layer_t: one layer's norm weights, packed projections, float32 biases (or
    None) and K/V caches."""
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("qkv", _P), ("o", _P), ("gate_up", _P), ("down", _P),
                ("qkv_bias", _P), ("o_bias", _P), ("gate_up_bias", _P), ("down_bias", _P),
                ("key_cache", _P), ("value_cache", _P)]


class DecoderShape(ctypes.Structure):
    """decoder_shape_t."""
    _fields_ = [("hidden", _I64), ("num_heads", _I64), ("num_kv_heads", _I64), ("head_dim", _I64),
                ("intermediate", _I64), ("block_size", _I64), ("eps", ctypes.c_float), ("scale", ctypes.c_float)]


class DecoderStep(ctypes.Structure):
    """decoder_step_t: the step's rows, RoPE tables, slots and attention plan (decode and
    prefill parts, a count of 0 when absent)."""
    _fields_ = [("tokens", _I64), ("cos", _P), ("sin", _P), ("slots", _P),
                ("num_decodes", _I64), ("decode_table_stride", _I64), ("decode_rows", _P),
                ("decode_seq_lens", _P), ("decode_tables", _P),
                ("num_prefills", _I64), ("prefill_table_stride", _I64), ("prefill_starts", _P),
                ("prefill_query_lens", _P), ("prefill_seq_lens", _P), ("prefill_tables", _P),
                ("external_prefill_attention", _I64)]


# decoder.c's external_projection_t: (layer, projection) -> the output's address, or None (NULL)
# to stop the step.
EXTERNAL_PROJECTION = ctypes.CFUNCTYPE(_P, _I64, _I64)
# The id it is called with for the prefill rows the caller attends (decoder.c says why).
EXTERNAL_PREFILL_ATTENTION = 4

# decoder.c's status codes.
DECODER_STATUS = {-1: "a kernel's scratch could not be allocated", -2: "an external projection failed",
                  -3: "a projection has no packed weights (or the step external prefill attention) and no "
                      "external callback was given"}


def _cache_dir() -> Path:
    base = os.environ.get("LLM_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "llm-engine-kernels")
    return Path(base)


@lru_cache(maxsize=1)
def cpu_identity() -> str:
    """The CPU's model name and flags (/proc/cpuinfo), else what the platform says: what
    ``-march=native`` compiles for, so part of the build's key (and of the step-cost
    calibration's, backend/worker/timing_cache.py)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = [line for line in lines if line.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(wanted))     # first of each (every core repeats them)


def build(compiler: str = "gcc", cflags: tuple[str, ...] = CFLAGS, folder: Path = CSRC) -> Path:
    """Compile (once per source/flags/CPU) and return the shared library's path. ``cflags``
    other than the default: tests build the same sources for an older instruction set.
    ``folder``: where the files named in SOURCES and HEADERS are read from (another revision's
    copies: benchmarks/cpu_attention.py --against)."""
    sources = [folder / source.name for source in SOURCES]
    digest = hashlib.sha256(" ".join(cflags).encode() + cpu_identity().encode())
    for source in sources + [folder / header.name for header in HEADERS]:
        digest.update(source.read_bytes())
    target = _cache_dir() / f"cpu_kernels-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent first uses never load a half-written file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        subprocess.run([compiler, *cflags, "-o", str(out), *map(str, sources), "-lm"], check=True,
                       capture_output=True, text=True)
        os.replace(out, target)
    return target


@lru_cache(maxsize=1)
def load() -> ctypes.CDLL | None:
    """The kernel library, or None when it cannot be built here (logged once)."""
    if shutil.which("gcc") is None:
        logger.warning("no C compiler: CPU attention and linear layers use torch's kernels")
        return None
    try:
        return open_library(build())
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning("building the C kernels failed (%s); using torch's kernels", detail)
        return None


def _signatures() -> dict[str, tuple[object, list]]:
    """Every exported function's (restype, argtypes)."""
    _F, _INT = ctypes.c_float, ctypes.c_int
    signatures: dict[str, tuple[object, list]] = {
        "attention_path": (_INT, [_INT, _I64]),
        "linear_f32_supported": (_INT, []),
        "linear_bf16_isa": (_INT, []),
        "linear_bf16_use_amx": (_INT, [_INT]),
        "linear_bf16_amx_on": (_INT, []),
        "linear_bf16_fma_built": (_INT, []),
        "linear_bf16_use_fma": (_I64, [_I64]),
        "linear_bf16_fma_rows": (_I64, []),
        "linear_bf16_use_fp16": (_I64, [_I64]),
        "linear_bf16_fp16_rows": (_I64, []),
        "linear_bf16_fp16_built": (_INT, []),
        "linear_bf16_f32": (_INT, [_P, _I64, _I64, _I64, _P, _I64, _P, _INT]),
        "linear_bf16_logits": (_INT, [_P, _I64, _I64, _I64, _P, _I64, _P, _INT]),
        "linear_bf16": (_INT, [_P, _I64, _I64, _I64, _P, _I64, _P, _P, _INT]),
        "linear_f32": (_INT, [_P, _I64, _I64, _I64, _P, _I64, _P, _P, _INT]),
        "decoder_layers": (_INT, [_INT, ctypes.POINTER(DecoderLayerPointers), _I64, ctypes.POINTER(DecoderShape),
                                  ctypes.POINTER(DecoderStep), _P, _P, EXTERNAL_PROJECTION, _INT, _INT]),
        "decoder_scratch_layout": (_I64, [_INT, ctypes.POINTER(DecoderShape), _I64, ctypes.POINTER(_I64 * 7)]),
        "argmax_rows_f32": (None, [_P, _I64, _I64, _I64, _P, _INT]),
        "moe_bf16": (_INT, [_P, _I64, _I64, _I64, _P, _P, _I64, _I64, _P, _P, _I64, _P, _INT]),
        "decode_attention_bf16_vector_width": (_INT, []),
        "decode_attention_bf16_dot_product": (_INT, []),
        "attention_soft_cap": (None, [_P, _I64, _F]),     # the scores' soft cap alone, for tests
        "prefill_attention_bf16_fma_built": (_INT, []),
        "prefill_attention_bf16_fp16_built": (_INT, []),
        "prefill_attention_bf16_dp_pv_built": (_INT, []),
        "prefill_attention_bf16_select": (_INT, [_INT]),
        "prefill_attention_bf16_selected": (_INT, []),
        "prefill_attention_bf16_path": (_INT, [_I64]),
    }
    for suffix in LAYER_OPS_SUFFIXES.values():
        # ... scale, window, sinks (float32 [num_heads] or NULL), num_threads; the _softcap ones
        # take the soft cap (float, 0: off) before num_threads
        decode = [_P, _P, _P, _P, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _I64, _F, _I64, _P]
        prefill = [_P, _P, _P, _P, _P, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _I64, _F, _I64, _P]
        signatures["paged_decode_attention" + suffix] = (_INT, decode + [_INT])
        signatures["paged_prefill_attention" + suffix] = (_INT, prefill + [_INT])
        signatures["paged_decode_attention_softcap" + suffix] = (_INT, decode + [_F, _INT])
        signatures["paged_prefill_attention_softcap" + suffix] = (_INT, prefill + [_F, _INT])
        signatures["add_rms_norm" + suffix] = (None, [_P, _P, _P, _P, _I64, _I64, _F])
        signatures["rope_and_cache" + suffix] = (None, [_P, _I64, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64])
        signatures["silu_and_mul" + suffix] = (None, [_P, _I64, _I64, _I64, _INT])
        signatures["lora_apply" + suffix] = (_INT, [_P, _I64, _P, _I64, _I64, _I64, _P, _P, _I64, _INT])
    return signatures


def open_library(path: Path, strict: bool = True) -> ctypes.CDLL:
    """Load a built library and declare its functions' signatures. ``strict=False``: a function
    the library lacks is left undeclared (another revision's build, benchmarks/cpu_attention.py
    --against, older than some of this tree's functions)."""
    library = ctypes.CDLL(str(path))
    for name, (restype, argtypes) in _signatures().items():
        try:
            function = getattr(library, name)
        except AttributeError:
            if strict:
                raise
            continue
        function.restype, function.argtypes = restype, argtypes
    return library


def linear_available() -> bool:
    """The C linear kernel builds here and the CPU has what it needs (AVX2 + FMA)."""
    library = load()
    return library is not None and bool(library.linear_f32_supported())


def linear_f32(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None,
               library: ctypes.CDLL | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` with ``packed`` = ``backend.model.cpu_linear.pack_panels(W)``. ``x``: [rows,
    in_features] float32 CPU with unit column stride (any row stride); returns a new
    contiguous [rows, out_features] tensor. The caller checks dtypes once, at load time.
    ``library``: another build (tests, benchmarks)."""
    return _packed_linear("linear_f32", torch.float32, x, packed, out_features, bias, library)


def _packed_linear(kernel: str, out_dtype: torch.dtype, x: torch.Tensor, packed: torch.Tensor, out_features: int,
                   bias: torch.Tensor | None, library: ctypes.CDLL | None = None) -> torch.Tensor:
    """One call of a projection kernel (``linear_f32``, ``linear_bf16``, ``linear_bf16_f32`` or
    ``linear_bf16_logits``: the same arguments, the last two without a bias). ``library``: another build (tests)."""
    rows, in_features = x.shape
    out = torch.empty(rows, out_features, dtype=out_dtype)
    if rows:
        function = getattr(load() if library is None else library, kernel)
        bias_args = () if kernel in ("linear_bf16_f32", "linear_bf16_logits") else (None if bias is None else bias.data_ptr(),)
        status = function(x.data_ptr(), rows, in_features, x.stride(0), packed.data_ptr(), out_features, *bias_args,
                          out.data_ptr(), torch.get_num_threads())
        if status != 0:
            raise MemoryError(f"{kernel}: scratch allocation failed")
    return out


# attention_path()'s answer (paged_attention.c's enum attention_path) -> the functions a build runs.
ATTENTION_PATHS = {0: "generic", 1: "avx2", 2: "avx512-bf16"}


# prefill_attention_bf16_path()'s answer beyond ATTENTION_PATHS: the float32-FMA, float16 and
# dot-products-for-both bfloat16 prefills.
PREFILL_BF16_PATHS = {**ATTENTION_PATHS, 3: "avx512-fma", 4: "avx512-fp16", 5: "avx512-dp-pv"}

# Our bfloat16 prefill functions, as prefill_attention_bf16_select numbers them: the build's own
# (attention_path's), the float32-FMA one (AVX-512F builds), the float16 one (AVX512-FP16 builds),
# the build's own dot products with P x V in dot products too, the probabilities rounded to
# bfloat16 (AVX512_BF16 builds).
PREFILL_BF16_KERNELS = ("dp", "fma", "fp16", "dp-pv")


def prefill_bf16_path(head_dim: int, library: ctypes.CDLL | None = None) -> str:
    """Which function a build's bfloat16 prefill runs now at this head size: ``avx512-fma``,
    ``avx512-fp16`` or ``avx512-dp-pv`` (where ``select_prefill_bf16_kernel`` selected it and the
    size fits) or
    ``attention_path``'s answer."""
    library = load() if library is None else library
    assert library is not None, "check load() before calling"
    return PREFILL_BF16_PATHS[library.prefill_attention_bf16_path(head_dim)]


def select_prefill_bf16_kernel(kernel: str, library: ctypes.CDLL | None = None) -> str:
    """Select which of ``PREFILL_BF16_KERNELS`` this process's bfloat16 prefills run (``dp``, the
    build's own, until asked; backend/model/prefill_attention_choice.py times them at start-up);
    the one now selected (``dp`` where the build lacks the one asked for, or without a library)."""
    library = load() if library is None else library
    if library is None:
        return "dp"
    return PREFILL_BF16_KERNELS[library.prefill_attention_bf16_select(PREFILL_BF16_KERNELS.index(kernel))]


def selected_prefill_bf16_kernel(library: ctypes.CDLL | None = None) -> str:
    """Which of ``PREFILL_BF16_KERNELS`` this process's bfloat16 prefills run now (``dp`` without a
    library)."""
    library = load() if library is None else library
    return "dp" if library is None else PREFILL_BF16_KERNELS[library.prefill_attention_bf16_selected()]


def attention_path(dtype: torch.dtype, head_dim: int, library: ctypes.CDLL | None = None) -> str:
    """Which decode and prefill attention functions a build runs for this dtype and head size
    (one rule for both): ``avx512-bf16`` (bfloat16 dot products), ``avx2`` or ``generic``."""
    library = load() if library is None else library
    assert library is not None, "check load() before calling"
    return ATTENTION_PATHS[library.attention_path(int(dtype == torch.bfloat16), head_dim)]


# linear_bf16_isa()'s answer -> the version of the bfloat16 kernels a library was built with.
# "amx-emulated" exists only in test builds (-DLINEAR_BF16_EMULATE_AMX).
LINEAR_BF16_VERSIONS = {4: "amx-emulated", 3: "amx-bf16", 2: "avx512-bf16", 1: "avx2"}
AMX_VERSIONS = ("amx-bf16", "amx-emulated")


def linear_bf16_version(library: ctypes.CDLL | None = None) -> str | None:
    """Which bfloat16 linear kernels a build has: ``amx-bf16`` (AMX tiles from 2 rows once
    ``use_amx``, the AVX512_BF16 dot products otherwise), ``avx512-bf16`` (dot products),
    ``avx2`` (bfloat16 widened to float32 in registers, for CPUs without bfloat16 arithmetic) or
    None."""
    library = load() if library is None else library
    return None if library is None else LINEAR_BF16_VERSIONS.get(library.linear_bf16_isa())


def use_amx(on: bool, library: ctypes.CDLL | None = None) -> bool:
    """Turn the bfloat16 kernel's AMX version on or off for this process (off until asked: the
    engine turns it on with ``cpu_linear=native``); whether it now runs. False where it is not
    built (no AMX, or no gcc), where the OS refused the process AMX state, or where the tiles
    failed the probe: before they first run in this process they run once in a child process
    (kernels/amx_probe.py), so that a crash, a hang or wrong sums there leave them off here
    instead of killing the server."""
    library = load() if library is None else library
    if library is None:
        return False
    if on:
        probe = amx_probe_result(library)
        on = probe is None or probe.passed    # None: no AMX version, which the C call answers itself
    return bool(library.linear_bf16_use_amx(int(on)))


def amx_probe_result(library: ctypes.CDLL | None = None) -> amx_probe.AmxProbeResult | None:
    """How this library's AMX tiles fared in the child process (probed on the first call); None
    where the library has no AMX version."""
    library = load() if library is None else library
    if library is None or linear_bf16_version(library) not in AMX_VERSIONS:
        return None
    return amx_probe.probe_once(library._name)


def amx_in_use(library: ctypes.CDLL | None = None) -> bool:
    """Whether the bfloat16 kernel's AMX version runs now (``use_amx`` turned it on and it could)."""
    library = load() if library is None else library
    return library is not None and bool(library.linear_bf16_amx_on())


def linear_bf16_available() -> bool:
    """The bfloat16 kernels (bfloat16 or float32 out) build here: AVX512_BF16, or AVX2 + FMA."""
    return linear_bf16_version() is not None


def linear_bf16_f32(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                    library: ctypes.CDLL | None = None) -> torch.Tensor:
    """``x @ W.T`` in float32 with ``packed`` = ``backend.model.cpu_linear.pack_pairs(W)``.
    ``x``: [rows, in_features] bfloat16 CPU, unit column stride, in_features even; returns a
    new contiguous float32 [rows, out_features]."""
    return _packed_linear("linear_bf16_f32", torch.float32, x, packed, out_features, None, library)


def linear_bf16_logits(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                       library: ctypes.CDLL | None = None) -> torch.Tensor:
    """``linear_bf16_f32`` never through the float16 version (``use_bf16_fp16_rows``): the LM
    head's float32 logits, whose top tokens a float16 sum could reorder."""
    return _packed_linear("linear_bf16_logits", torch.float32, x, packed, out_features, None, library)


def linear_bf16(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None,
                library: ctypes.CDLL | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` in bfloat16 (float32 sums, rounded once) with ``packed`` =
    ``backend.model.cpu_linear.pack_pairs(W)``. ``x``: [rows, in_features] bfloat16 CPU, unit
    column stride, in_features even; ``bias``: float32 [out_features] or None; returns a new
    contiguous bfloat16 [rows, out_features]."""
    return _packed_linear("linear_bf16", torch.bfloat16, x, packed, out_features, bias, library)


# The decode attention kernel per dtype of query, output and caches (all the same dtype).
DECODE_ATTENTION_DTYPES = {torch.float32: "paged_decode_attention_f32", torch.bfloat16: "paged_decode_attention_bf16"}


def paged_decode_attention(query: torch.Tensor, out: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor,
                           block_tables: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           scale: float, library: ctypes.CDLL | None = None, *, window: int = 0,
                           sinks: torch.Tensor | None = None, softcap: float = 0.0) -> None:
    """Decode rows ``rows`` of ``query`` attend over their sequences' pages; results go to the
    same rows of ``out``. Contiguous tensors: query, out and caches all float32 or all
    bfloat16 (``DECODE_ATTENTION_DTYPES``); rows / seq_lens int64, tables int32.
    ``window``: keys each query sees (0: all), never reading before them; ``sinks``: one float32
    logit per query head in every softmax, or None; ``softcap``: each scaled score becomes
    ``softcap * tanh(score / softcap)`` (0: off) (``paged_attention_reference``'s meanings).
    ``library``: another build of the kernels (tests); default ``load()``."""
    library = load() if library is None else library
    assert library is not None, "check load() before calling"
    name = _attention_kernel(DECODE_ATTENTION_DTYPES, "decode", query, out, key_cache, value_cache,
                             (rows, seq_lens), block_tables, sinks)
    name, cap = _with_softcap(name, softcap)
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    status = getattr(library, name)(
        query.data_ptr(), out.data_ptr(), rows.data_ptr(), seq_lens.data_ptr(), block_tables.data_ptr(),
        block_tables.shape[1], key_cache.data_ptr(), value_cache.data_ptr(), rows.shape[0], num_heads, num_kv_heads,
        head_dim, block_size, scale, window, None if sinks is None else sinks.data_ptr(), *cap,
        torch.get_num_threads())
    if status != 0:
        raise MemoryError(f"{name}: scratch allocation failed")


def _with_softcap(name: str, softcap: float) -> tuple[str, tuple[float, ...]]:
    """(kernel, its soft-cap argument) for an attention kernel named as in
    ``DECODE_ATTENTION_DTYPES`` / ``PREFILL_ATTENTION_DTYPES``: without a cap (0) the kernel
    itself, which takes none (kernels/csrc/decoder.c and builds of revisions before soft-capping
    call it too), else its ``_softcap`` version and the cap. The cap must be finite and positive."""
    if not softcap:
        return name, ()
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be a finite positive number (0: off), got {softcap}")
    stem, suffix = name.rsplit("_", 1)
    return f"{stem}_softcap_{suffix}", (float(softcap),)


def _attention_kernel(kernels: dict[torch.dtype, str], kind: str, query: torch.Tensor, out: torch.Tensor,
                      key_cache: torch.Tensor, value_cache: torch.Tensor, indices: tuple[torch.Tensor, ...],
                      block_tables: torch.Tensor, sinks: torch.Tensor | None) -> str:
    """The kernel's name for the query's dtype, after checking every tensor an attention kernel
    reads: contiguous CPU tensors, query/out/caches of one dtype, ``indices`` int64, tables int32,
    sinks (where given) float32 with one per query head."""
    if query.dtype not in kernels:
        raise ValueError(f"no C {kind} attention for {query.dtype}")
    check_tensors([(query, query.dtype), (out, query.dtype), (key_cache, query.dtype), (value_cache, query.dtype),
                   *((index, torch.int64) for index in indices), (block_tables, torch.int32)])
    if sinks is not None:
        check_tensors([(sinks, torch.float32)])
        if sinks.numel() != query.shape[1]:
            raise ValueError(f"expected one sink per query head ({query.shape[1]}), got {sinks.numel()}")
    return kernels[query.dtype]


def check_tensors(expected: list[tuple[torch.Tensor, torch.dtype]]) -> None:
    """Each tensor a contiguous CPU tensor of its dtype, as a C kernel reads it (without bounds),
    else ValueError."""
    for tensor, dtype in expected:
        if tensor.dtype != dtype or not tensor.is_contiguous() or tensor.device.type != "cpu":
            raise ValueError(f"expected a contiguous CPU {dtype} tensor, got {tensor.dtype} {tuple(tensor.shape)}")


PREFILL_ATTENTION_DTYPES = {torch.float32: "paged_prefill_attention_f32",
                            torch.bfloat16: "paged_prefill_attention_bf16"}


def paged_prefill_attention(query: torch.Tensor, out: torch.Tensor, starts: torch.Tensor, query_lens: torch.Tensor,
                            seq_lens: torch.Tensor, block_tables: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, scale: float, library: ctypes.CDLL | None = None, *,
                            window: int = 0, sinks: torch.Tensor | None = None, softcap: float = 0.0) -> None:
    """Prefill sequence i's ``query_lens[i]`` query rows from row ``starts[i]`` attend causally
    over its ``seq_lens[i]`` tokens (the queries are the last ones); results go to the same
    rows of ``out``. Same dtype and layout rules, ``window``, ``sinks`` and ``softcap`` as
    ``paged_decode_attention``; starts, query_lens and seq_lens int64, tables int32."""
    library = load() if library is None else library
    assert library is not None, "check load() before calling"
    name = _attention_kernel(PREFILL_ATTENTION_DTYPES, "prefill", query, out, key_cache, value_cache,
                             (starts, query_lens, seq_lens), block_tables, sinks)
    name, cap = _with_softcap(name, softcap)
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    status = getattr(library, name)(
        query.data_ptr(), out.data_ptr(), starts.data_ptr(), query_lens.data_ptr(), seq_lens.data_ptr(),
        block_tables.data_ptr(), block_tables.shape[1], key_cache.data_ptr(), value_cache.data_ptr(), starts.shape[0],
        num_heads, num_kv_heads, head_dim, block_size, scale, window, None if sinks is None else sinks.data_ptr(),
        *cap, torch.get_num_threads())
    if status != 0:
        raise MemoryError(f"{name}: scratch allocation failed")


# ---- fused layer ops (kernels/csrc/layer_ops.c). float32 or bfloat16 CPU tensors, all of one
# dtype; the model checks dtypes and layouts once at load time, so these do not (they run
# ~120 times a step).
LAYER_OPS_SUFFIXES = {torch.float32: "_f32", torch.bfloat16: "_bf16"}

def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, out: torch.Tensor,
                 eps: float) -> None:
    """``residual += delta`` (when given), then ``out = RMSNorm(residual) * weight``, in one
    pass. All [rows, hidden] contiguous."""
    rows, hidden = residual.shape
    function = getattr(load(), "add_rms_norm" + LAYER_OPS_SUFFIXES[residual.dtype])
    function(residual.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(), out.data_ptr(),
             rows, hidden, eps)


def rope_and_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                   key_cache: torch.Tensor, value_cache: torch.Tensor, num_heads: int, num_kv_heads: int,
                   head_dim: int) -> None:
    """Rotate the q and k heads of ``qkv`` [tokens, (num_heads + 2 * num_kv_heads) * head_dim]
    in place and write k and v to cache slots ``slots`` (int64; < 0: not written). cos/sin:
    [tokens, head_dim] contiguous; caches [num_blocks, block_size, num_kv_heads, head_dim]."""
    function = getattr(load(), "rope_and_cache" + LAYER_OPS_SUFFIXES[qkv.dtype])
    function(qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), key_cache.data_ptr(),
             value_cache.data_ptr(), qkv.shape[0], num_heads, num_kv_heads, head_dim)


def silu_and_mul(gate_up: torch.Tensor, inter: int) -> None:
    """The MLP's activation in place: ``gate_up`` [tokens, 2 * inter] (unit column stride) holds
    [gate | up] per row; the gate half becomes ``SiLU(gate) * up``."""
    function = getattr(load(), "silu_and_mul" + LAYER_OPS_SUFFIXES[gate_up.dtype])
    function(gate_up.data_ptr(), gate_up.shape[0], inter, gate_up.stride(0), torch.get_num_threads())


MOE_STATUS = {-1: "scratch allocation failed", -3: "an expert id out of range, or more than 64 experts a row"}


def moe_bf16(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
             inter: int, library: ctypes.CDLL | None = None) -> torch.Tensor:
    """A SwiGLU mixture-of-experts block (kernels/csrc/moe.c): ``x`` [rows, hidden] bfloat16 (unit
    column stride), ``ids`` int64 and ``weights`` float32 [rows, top_k] contiguous (routing),
    ``gate_up`` [experts, panels, hidden / 2, 16, 2] and ``down`` [experts, panels, inter / 2, 16, 2]
    bfloat16, each expert's weights as ``backend.model.cpu_linear.pack_pairs`` packs them. Returns
    a new bfloat16 [rows, hidden]."""
    rows, hidden = x.shape
    out = torch.empty(rows, hidden, dtype=torch.bfloat16)
    status = (load() if library is None else library).moe_bf16(
        x.data_ptr(), rows, hidden, x.stride(0), ids.data_ptr(), weights.data_ptr(), ids.shape[1], gate_up.shape[0],
        gate_up.data_ptr(), down.data_ptr(), inter, out.data_ptr(), torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"moe_bf16: {MOE_STATUS.get(status, status)}")
    return out


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of float32 CPU logits [rows, vocab] with unit column stride
    (kernels/csrc/sampling.c: the same answer, ties and NaN included, much faster than torch's
    CPU argmax on a decode step's logits, docs/benchmarks.md). Returns int64 [rows]."""
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    if rows:
        load().argmax_rows_f32(logits.data_ptr(), rows, vocab, logits.stride(0), out.data_ptr(),
                               torch.get_num_threads())
    return out


# LoRA (kernels/csrc/lora.c): per slot, one row of int64 fields, lora_slot_t's layout.
LORA_MAX_PARTS = 3
LORA_SLOT_FIELDS = 3 + 5 * LORA_MAX_PARTS


def lora_slot_fields(a: torch.Tensor | None, parts: list[tuple[torch.Tensor, int, int, int, int]]) -> list[int]:
    """The row of a slot: ``a`` (A [rank, in], contiguous) and per part (B transposed [part
    rank, part columns] contiguous, its first and end rank, its first and end output column).
    None: the slot's adapter does not adapt this projection."""
    if a is None:
        return [0] * LORA_SLOT_FIELDS
    if len(parts) > LORA_MAX_PARTS:
        raise ValueError(f"at most {LORA_MAX_PARTS} parts per projection")
    fields = [a.data_ptr(), a.shape[0], len(parts)]
    for b_t, rank_start, rank_end, out_start, out_end in parts:
        assert b_t.is_contiguous() and b_t.shape == (rank_end - rank_start, out_end - out_start)
        fields += [b_t.data_ptr(), rank_start, rank_end, out_start, out_end]
    return fields + [0] * (LORA_SLOT_FIELDS - len(fields))


def lora_apply(x: torch.Tensor, out: torch.Tensor, slot_ids: torch.Tensor, slot_table: torch.Tensor) -> None:
    """``out[t] += B_s (A_s x[t])`` for rows whose slot ``s = slot_ids[t]`` is >= 0 (in place).
    x / out: [rows, features] of one dtype (float32 or bfloat16), unit column stride;
    slot_ids int32; slot_table int64 [num_slots, LORA_SLOT_FIELDS] of ``lora_slot_fields``
    rows, whose tensors have x's dtype (the caller keeps them alive)."""
    function = getattr(load(), "lora_apply" + LAYER_OPS_SUFFIXES[x.dtype])
    status = function(x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), x.shape[0], x.shape[1],
                      slot_ids.data_ptr(), slot_table.data_ptr(), slot_table.shape[0], torch.get_num_threads())
    if status == -1:
        raise ValueError("lora_apply: a slot has over 512 ranks or over 3 parts")
    if status != 0:
        raise MemoryError("lora_apply: scratch allocation failed")

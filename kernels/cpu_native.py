"""The C decode-attention kernel (kernels/csrc/paged_decode_attention.c), built on first use.

Plain C with OpenMP, no torch headers: gcc builds it in well under a second, so it is
compiled for the machine it runs on (``-march=native``) the first time a process needs it
and cached by a hash of the source, the flags and the CPU. It is called through ctypes,
which releases the GIL for the call. torch must be imported first: the library's
``libgomp.so.1`` then binds to the OpenMP runtime torch already loaded (one thread pool).

Without a C compiler ``load()`` returns None and the CPU path falls back to the batched
torch implementation in ``cpu_attention.py``.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_decode_attention.c"
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared"]
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


def _cache_dir() -> Path:
    base = os.environ.get("LLM_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "llm-engine-kernels")
    return Path(base)


def _cpu_signature() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next((line for line in lines if line.startswith("flags")), platform.processor())
    except OSError:
        return platform.processor()


def build(compiler: str = "gcc") -> Path:
    """Compile (once per source/flags/CPU) and return the shared library's path."""
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode() + _cpu_signature().encode()).hexdigest()[:16]
    target = _cache_dir() / f"paged_decode_attention-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent first uses never load a half-written file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        subprocess.run([compiler, *CFLAGS, "-o", str(out), str(SOURCE), "-lm"], check=True, capture_output=True,
                       text=True)
        os.replace(out, target)
    return target


@lru_cache(maxsize=1)
def load() -> ctypes.CDLL | None:
    """The kernel library, or None when it cannot be built here (logged once)."""
    if shutil.which("gcc") is None:
        logger.warning("no C compiler: CPU decode attention uses the batched torch path")
        return None
    try:
        library = ctypes.CDLL(str(build()))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning("building the C decode-attention kernel failed (%s); using the torch path", detail)
        return None
    library.paged_decode_attention_f32.restype = ctypes.c_int
    library.paged_decode_attention_f32.argtypes = [_P, _P, _P, _P, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _I64,
                                                   ctypes.c_float, ctypes.c_int]
    return library


def paged_decode_attention(query: torch.Tensor, out: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor,
                           block_tables: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           scale: float) -> None:
    """Decode rows ``rows`` of ``query`` attend over their sequences' pages; results go to the
    same rows of ``out``. float32 contiguous tensors; rows / seq_lens int64, tables int32."""
    library = load()
    assert library is not None, "check load() before calling"
    for tensor, dtype in ((query, torch.float32), (out, torch.float32), (key_cache, torch.float32),
                          (value_cache, torch.float32), (rows, torch.int64), (seq_lens, torch.int64),
                          (block_tables, torch.int32)):
        if tensor.dtype != dtype or not tensor.is_contiguous() or tensor.device.type != "cpu":
            raise ValueError(f"expected a contiguous CPU {dtype} tensor, got {tensor.dtype} {tuple(tensor.shape)}")
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    status = library.paged_decode_attention_f32(
        query.data_ptr(), out.data_ptr(), rows.data_ptr(), seq_lens.data_ptr(), block_tables.data_ptr(),
        block_tables.shape[1], key_cache.data_ptr(), value_cache.data_ptr(), rows.shape[0], num_heads, num_kv_heads,
        head_dim, block_size, scale, torch.get_num_threads())
    if status != 0:
        raise MemoryError("paged_decode_attention_f32: scratch allocation failed")

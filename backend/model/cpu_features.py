"""What the CPU can compute natively, read once from /proc/cpuinfo, for the start-up choices
that depend on it (the linear-layer path, later the CPU dtype). The rules take a
``CpuFeatures`` so that tests can hand them any machine's flags.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from pathlib import Path


class CpuIsa(enum.Enum):
    """The widest vector extension that matters to our kernels, best first."""
    AMX_BF16 = "amx-bf16"          # Intel Sapphire Rapids and later: bf16 tile matmuls
    AVX512_BF16 = "avx512-bf16"    # AMD Zen 4+, Intel Cooper Lake+: bf16 dot products in 512-bit vectors
    AVX512 = "avx512"              # F + BW + VL + DQ
    AVX2 = "avx2"                  # AVX2 + FMA: what our C kernels need
    BASELINE = "baseline"          # none of the above: torch's own kernels only


@dataclass(frozen=True)
class CpuFeatures:
    flags: frozenset[str]

    @classmethod
    def from_cpuinfo(cls, text: str) -> "CpuFeatures":
        for line in text.splitlines():
            if line.startswith("flags"):
                return cls(frozenset(line.split(":", 1)[1].split()))
        return cls(frozenset())

    @classmethod
    def of(cls, *flags: str) -> "CpuFeatures":
        return cls(frozenset(flags))

    @property
    def avx2(self) -> bool:
        return {"avx2", "fma"} <= self.flags

    @property
    def avx512(self) -> bool:
        return {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= self.flags

    @property
    def native_bf16(self) -> bool:
        """bfloat16 arithmetic in hardware (not only conversions)."""
        return self.isa in (CpuIsa.AMX_BF16, CpuIsa.AVX512_BF16)

    @property
    def isa(self) -> CpuIsa:
        if self.avx512 and "amx_bf16" in self.flags:
            return CpuIsa.AMX_BF16
        if self.avx512 and "avx512_bf16" in self.flags:
            return CpuIsa.AVX512_BF16
        if self.avx512:
            return CpuIsa.AVX512
        if self.avx2:
            return CpuIsa.AVX2
        return CpuIsa.BASELINE

    def describe(self) -> str:
        return self.isa.value


@functools.cache
def detect() -> CpuFeatures:
    try:
        return CpuFeatures.from_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:   # not Linux: assume nothing
        return CpuFeatures(frozenset())

"""The C sources compile for every x86 generation we meet, on whatever machine runs the tests.

The kernel tests run only the versions the CPU can execute (the rest are named NOT RUN), so a
version that does not even compile stays unseen on the machines that lack its ISA: the
bfloat16 half of benchmarks/prefill_roofline.py's peak loop failed to compile on every
AVX512_BF16 CPU until a Xeon with AMX ran it (2026-11-26). Compiling alone (``-c``) needs no
such CPU."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

import pytest

from benchmarks.prefill_roofline import _PEAK_SOURCE
from kernels import cpu_native

# AVX2 + FMA (Haswell, Zen 1-3); AVX-512F without bfloat16 (Skylake-SP to Ice Lake);
# AVX512_BF16 (Cooper Lake); AVX512_BF16 + AMX (Sapphire Rapids and later; Zen 4-5 compile alike).
TARGETS = ("x86-64-v3", "skylake-avx512", "cooperlake", "sapphirerapids")
pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                                reason=f"NOT RUN: x86 targets, and this machine is {platform.machine()}")


def compile_only(source: Path, march: str, tmp_path: Path) -> subprocess.CompletedProcess:
    # -O0: type and target errors do not depend on the optimisation level (always_inline still
    # inlines); -O1 took 2x as long, -O3 about 3.5x.
    return subprocess.run(["gcc", "-O0", f"-march={march}", "-fopenmp", "-fPIC", "-Wall", "-c", "-o",
                           str(tmp_path / f"{source.stem}-{march}.o"), str(source)],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("march", TARGETS)
def test_kernel_sources_compile(march: str, tmp_path: Path) -> None:
    for source in cpu_native.SOURCES:
        done = compile_only(Path(source), march, tmp_path)
        assert done.returncode == 0, f"{source} for -march={march}:\n{done.stderr[-3000:]}"


@pytest.mark.parametrize("march", TARGETS)
def test_peak_loop_compiles(march: str, tmp_path: Path) -> None:
    source = tmp_path / "fma_peak.c"
    source.write_text(_PEAK_SOURCE)
    done = compile_only(source, march, tmp_path)
    assert done.returncode == 0, f"the FMA peak loop for -march={march}:\n{done.stderr[-3000:]}"

"""The GPU benchmark scripts run end to end in their --smoke mode (tiny shapes; on CPU the
kernels run in Triton's interpreter), so they cannot rot between GPU runs. Their figures
are meaningless here; the real ones are in docs/benchmarks.md."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("module,expect", [("benchmarks.kernels", "mixed step"),
                                           ("benchmarks.decode_roofline", "step / floor")])
def test_benchmark_smoke(module: str, expect: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", module, "--smoke"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert expect in done.stdout
    assert "device:" in done.stdout

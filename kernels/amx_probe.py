"""Runs the bfloat16 kernel's AMX tiles once, in a process of its own, before the engine does.

Why: the AMX version of kernels/csrc/linear_bf16.c is turned on in the serving process (the
``cpu_linear=auto`` timing at start-up, ``cpu_linear=native``). A fault there (a tile
configuration the CPU rejects, a kernel that grants the AMX state but does not save it) would
kill the server at start-up on every AMX machine, not fail one request. So
``cpu_native.use_amx`` first runs this script in a child process: it turns the tiles on in
that child, multiplies small matrices whose every product and sum is exact in float32 (so any
summation order gives the same bits), and compares each output with the exact result. A child
killed by a signal, hung, refused the AMX state or wrong leaves the tiles off in the engine.

The child side (``run``) is plain Python and ctypes (no torch): it starts in ~50 ms and runs
under any Python 3. The parent side is ``probe_once``, one probe per library and process.

    python kernels/amx_probe.py LIBRARY.so     # prints one JSON line; exit status 0 when it ran
"""

from __future__ import annotations

import ctypes
import enum
import json
import logging
import os
import shutil
import signal
import struct
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

TIMEOUT_S = 60.0                        # a child that has not answered by then is hung (it needs ~0.1 s)

PANEL = 16                              # output columns of a packed panel (linear_bf16.c's NR)
IN_FEATURES = 64                        # two AMX k chunks of 32
OUT_FEATURES = 40                       # two whole panels and a partial one
ROW_COUNTS = (2, 16, 17, 35)            # the fewest the tiles take; one block; a padded block; three
THREAD_COUNTS = (1, 2)


def bf16_bits(value: float) -> int:
    """The bfloat16 of a float32 that bfloat16 holds exactly (the values below all are)."""
    return struct.unpack("<I", struct.pack("<f", value))[0] >> 16


def exact_value(i: int, j: int, salt: int) -> float:
    """Multiples of 1/4 in [-1, 1]: products are multiples of 1/16 and 64 of them sum exactly."""
    return ((i * 7 + j * 3 + salt) % 9 - 4) / 4


def run(library_path: str) -> dict[str, object]:
    library = ctypes.CDLL(library_path)
    library.linear_bf16_use_amx.restype = ctypes.c_int
    library.linear_bf16_use_amx.argtypes = [ctypes.c_int]
    kernel = library.linear_bf16_f32
    kernel.restype = ctypes.c_int
    kernel.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                       ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    if not library.linear_bf16_use_amx(1):
        return {"amx_on": False, "checked": 0, "wrong": []}
    k, n = IN_FEATURES, OUT_FEATURES
    weight = [[exact_value(c, i, 1) for i in range(k)] for c in range(n)]
    panels = -(-n // PANEL)
    # [panels][k / 2][16][2], zero past n: backend.model.cpu_linear.pack_pairs's layout.
    packed = (ctypes.c_uint16 * (panels * k * PANEL))()
    for p in range(panels):
        for pair in range(k // 2):
            for c in range(PANEL):
                for half in range(2):
                    column = p * PANEL + c
                    value = weight[column][2 * pair + half] if column < n else 0.0
                    packed[((p * (k // 2) + pair) * PANEL + c) * 2 + half] = bf16_bits(value)
    wrong = []
    checked = 0
    for rows in ROW_COUNTS:
        x = [[exact_value(r, i, 2) for i in range(k)] for r in range(rows)]
        x_bits = (ctypes.c_uint16 * (rows * k))(*(bf16_bits(v) for row in x for v in row))
        expected = [sum(a * b for a, b in zip(x[r], weight[c])) for r in range(rows) for c in range(n)]
        for threads in THREAD_COUNTS:
            out = (ctypes.c_float * (rows * n))()
            status = kernel(ctypes.addressof(x_bits), rows, k, k, ctypes.addressof(packed), n, ctypes.addressof(out),
                            threads)
            checked += 1
            mismatches = sum(got != want for got, want in zip(out, expected))
            if status != 0 or mismatches:
                wrong.append({"rows": rows, "threads": threads, "status": status, "mismatches": mismatches})
    library.linear_bf16_use_amx(0)
    return {"amx_on": True, "checked": checked, "wrong": wrong}


class ProbeOutcome(enum.Enum):
    PASSED = "passed"
    REFUSED = "refused"          # the OS refused the process AMX state (it refuses the engine too)
    CRASHED = "crashed"          # the child was killed by a signal
    WRONG = "wrong results"
    HUNG = "hung"
    FAILED = "failed"            # no interpreter, another exit status, an unreadable answer


@dataclass(frozen=True)
class AmxProbe:
    outcome: ProbeOutcome
    detail: str

    @property
    def passed(self) -> bool:
        return self.outcome is ProbeOutcome.PASSED

    def describe(self) -> str:
        return f"AMX probe {self.outcome.value}: {self.detail}"


_probes: dict[str, AmxProbe] = {}
_probes_lock = threading.Lock()


def probe_once(library_path: str) -> AmxProbe:
    """``probe`` of this library, run once per process (later calls return the first answer);
    a probe that did not pass is logged as a warning."""
    with _probes_lock:
        if library_path not in _probes:
            result = probe(library_path, TIMEOUT_S)
            if not result.passed:
                logger.warning("%s; the AMX tiles stay off (the bfloat16 kernel's version without them runs)",
                               result.describe())
            _probes[library_path] = result
        return _probes[library_path]


def python_interpreter() -> str | None:
    """A Python to run the child in: this one where it is one (inside Triton's stub
    ``sys.executable`` is the ``python3`` on PATH, server/launch.py), else ``python3`` on PATH."""
    for candidate in (sys.executable, shutil.which("python3")):
        if candidate and Path(candidate).name.startswith("python") and os.access(candidate, os.X_OK):
            return candidate
    return None


def probe(library_path: str, timeout_s: float | None = None) -> AmxProbe:
    """Run ``run(library_path)`` in a child process and judge how it ended."""
    timeout_s = TIMEOUT_S if timeout_s is None else timeout_s
    python = python_interpreter()
    if python is None:
        return AmxProbe(ProbeOutcome.FAILED, "no Python interpreter to run it in")
    try:
        # -I: the child's sys.path holds neither this folder nor user packages; it needs the stdlib only.
        done = subprocess.run([python, "-I", str(Path(__file__).resolve()), library_path], capture_output=True,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return AmxProbe(ProbeOutcome.HUNG, f"no answer in {timeout_s:g} s (the child was killed)")
    except OSError as exc:
        return AmxProbe(ProbeOutcome.FAILED, f"could not start {python}: {exc}")
    if done.returncode < 0:
        return AmxProbe(ProbeOutcome.CRASHED, f"the child was killed by {signal.Signals(-done.returncode).name}")
    lines = done.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if done.returncode == 0 and lines else None
    except json.JSONDecodeError:
        answer = None
    if not isinstance(answer, dict):
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return AmxProbe(ProbeOutcome.FAILED, f"the child exited with status {done.returncode}: {tail}")
    if not answer.get("amx_on"):
        return AmxProbe(ProbeOutcome.REFUSED, "the OS refused the process AMX state (arch_prctl)")
    if answer.get("wrong"):
        return AmxProbe(ProbeOutcome.WRONG, f"{len(answer['wrong'])} of {answer['checked']} calls differ from "
                                            f"the exact result, first {answer['wrong'][0]}")
    return AmxProbe(ProbeOutcome.PASSED, f"{answer['checked']} calls exact")


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1])), flush=True)

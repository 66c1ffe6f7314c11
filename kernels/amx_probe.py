"""Runs the bfloat16 kernel's AMX tiles once, in a process of its own, before the engine does.

Why: the AMX version of kernels/csrc/linear_bf16.c is turned on in the serving process (the
``cpu_linear=auto`` timing at start-up, ``cpu_linear=native``). A fault there (a tile
configuration the CPU rejects, a kernel that grants the AMX state but does not save it) would
kill the server at start-up on every AMX machine, not fail one request. So
``cpu_native.use_amx`` first runs this script in a child process: it turns the tiles on in
that child, multiplies small matrices whose every product and sum is exact in float32 (so any
summation order gives the same bits), and compares each output with the exact result. A child
killed by a signal, hung, refused the AMX state or wrong leaves the tiles off in the engine.

The child side (``check_tiles_here``) is plain Python and ctypes (no torch): it starts quickly and runs
under any Python 3. The parent side is ``probe_once``, one probe per library and process.

    python kernels/amx_probe.py LIBRARY.so [LIBGOMP.so]   # prints one JSON line; exit status 0 when it ran
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

TIMEOUT_S = 60.0                        # a child that has not answered by then is hung (it needs far less)

PANEL = 16                              # output columns of a packed panel (linear_bf16.c's NR)
IN_FEATURES = 96                        # three AMX k chunks of 32 (an odd count)
OUT_FEATURES = 104                      # six whole panels and a partial one
ROW_STRIDE = IN_FEATURES + 32           # x's rows lie apart, NaN between: a tile must read each row where it is
ROW_COUNTS = (2, 16, 17, 35)            # the fewest the tiles take; one block; a padded block; three blocks
THREAD_COUNTS = (1, 2, 4)               # with three blocks: panel groups of 4, 3, 2 and 1 (linear_bf16.c's amx_group)
BF16_NAN = 0x7FC0


def bf16_bits(value: float) -> int:
    """``value`` (a float32) rounded to the nearest bfloat16, ties to even, as linear_bf16.c's
    f32_to_bf16 rounds (the inputs below are bfloat16 already: exact)."""
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16


def exact_value(i: int, j: int, salt: int) -> float:
    """Multiples of 1/4 in [-1, 1], a pattern that repeats every 9 rows and 3 k: products are
    multiples of 1/16, and any sum of 96 of them (plus a bias of the same kind) is exact in
    float32, whatever the order of summation."""
    return ((i * 7 + j * 3 + salt) % 9 - 4) / 4


def packed_weight(weight: list[list[float]]) -> ctypes.Array:
    """``weight`` [n][k] in pairs, [panels][k / 2][16][2], zero past n: backend.model.cpu_linear.pack_pairs's layout."""
    n, k = len(weight), len(weight[0])
    panels = -(-n // PANEL)
    packed = (ctypes.c_uint16 * (panels * k * PANEL))()
    for p in range(panels):
        for pair in range(k // 2):
            for c in range(PANEL):
                column = p * PANEL + c
                for half in range(2):
                    value = weight[column][2 * pair + half] if column < n else 0.0
                    packed[((p * (k // 2) + pair) * PANEL + c) * 2 + half] = bf16_bits(value)
    return packed


def check_tiles_here(library_path: str, openmp_runtime: str | None = None) -> dict[str, object]:
    """The child's work: turn the tiles on, run both kernels (float32 out; bfloat16 out with a
    bias) at every row and thread count, and count the outputs that differ from the exact result.
    ``openmp_runtime``: the libgomp the parent runs the kernels on (torch's own copy), loaded
    first so that the child's kernels bind to it too, not to the system's."""
    if openmp_runtime:
        ctypes.CDLL(openmp_runtime, mode=ctypes.RTLD_GLOBAL)
    library = ctypes.CDLL(library_path)
    library.linear_bf16_use_amx.restype = ctypes.c_int
    library.linear_bf16_use_amx.argtypes = [ctypes.c_int]
    common = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
    to_f32, to_bf16 = library.linear_bf16_f32, library.linear_bf16
    to_f32.restype = to_bf16.restype = ctypes.c_int
    to_f32.argtypes = common + [ctypes.c_void_p, ctypes.c_int]
    to_bf16.argtypes = common + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    if not library.linear_bf16_use_amx(1):
        return {"amx_on": False, "checked": 0, "wrong": [], "openmp": openmp_runtime}
    k, n = IN_FEATURES, OUT_FEATURES
    weight = [[exact_value(c, i, 1) for i in range(k)] for c in range(n)]
    packed = packed_weight(weight)
    bias = (ctypes.c_float * n)(*(exact_value(c, 0, 5) for c in range(n)))
    wrong = []
    checked = 0
    for rows in ROW_COUNTS:
        x = [[exact_value(r, i, 2) for i in range(k)] for r in range(rows)]
        x_bits = (ctypes.c_uint16 * (rows * ROW_STRIDE))(*[BF16_NAN] * (rows * ROW_STRIDE))
        for r in range(rows):
            x_bits[r * ROW_STRIDE:r * ROW_STRIDE + k] = [bf16_bits(v) for v in x[r]]
        sums = [sum(a * b for a, b in zip(x[r], weight[c])) for r in range(rows) for c in range(n)]
        with_bias = [bf16_bits(value + bias[i % n]) for i, value in enumerate(sums)]
        for threads in THREAD_COUNTS:
            for kernel, expected in (("linear_bf16_f32", sums), ("linear_bf16", with_bias)):
                head = (ctypes.addressof(x_bits), rows, k, ROW_STRIDE, ctypes.addressof(packed), n)
                if kernel == "linear_bf16_f32":
                    out = (ctypes.c_float * (rows * n))()
                    status = to_f32(*head, ctypes.addressof(out), threads)
                else:
                    out = (ctypes.c_uint16 * (rows * n))()
                    status = to_bf16(*head, ctypes.addressof(bias), ctypes.addressof(out), threads)
                checked += 1
                mismatches = sum(got != want for got, want in zip(out, expected))
                if status != 0 or mismatches:
                    wrong.append({"kernel": kernel, "rows": rows, "threads": threads, "status": status,
                                  "mismatches": mismatches})
    library.linear_bf16_use_amx(0)
    return {"amx_on": True, "checked": checked, "wrong": wrong, "openmp": openmp_runtime}


class ProbeOutcome(enum.Enum):
    PASSED = "passed"
    REFUSED = "refused"          # the OS refused the process AMX state (it refuses the engine too)
    CRASHED = "crashed"          # the child was killed by a signal
    WRONG = "computed wrong results"
    HUNG = "hung"
    FAILED = "failed"            # no interpreter, another exit status, an unreadable answer


@dataclass(frozen=True)
class AmxProbeResult:
    outcome: ProbeOutcome
    detail: str

    @property
    def passed(self) -> bool:
        return self.outcome is ProbeOutcome.PASSED

    def describe(self) -> str:
        return f"AMX probe {self.outcome.value}: {self.detail}"


_probes: dict[str, AmxProbeResult] = {}
_probes_lock = threading.Lock()


def probe_once(library_path: str) -> AmxProbeResult:
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


def loaded_openmp_runtime() -> str | None:
    """The path of the libgomp this process has loaded (torch's, once torch is imported), or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = [line.split()[-1] for line in maps if "/libgomp" in line]
    except OSError:
        return None
    return paths[0] if paths else None


def signal_name(number: int) -> str:
    """SIGILL for 4; real-time signals have no name in ``signal.Signals``."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def probe(library_path: str, timeout_s: float | None = None) -> AmxProbeResult:
    """Run ``check_tiles_here(library_path)`` in a child process and judge how it ended. Never
    raises: whatever goes wrong here is a failed probe, not a failed start."""
    try:
        return _probe(library_path, TIMEOUT_S if timeout_s is None else timeout_s)
    except Exception as exc:   # noqa: BLE001 - the probe exists so that start-up survives the unexpected
        return AmxProbeResult(ProbeOutcome.FAILED, f"the probe itself raised {exc!r}")


def _probe(library_path: str, timeout_s: float) -> AmxProbeResult:
    python = python_interpreter()
    if python is None:
        return AmxProbeResult(ProbeOutcome.FAILED, "no Python interpreter to run it in")
    try:
        # -I: the child's sys.path holds neither this folder nor user packages; it needs the stdlib only.
        command = [python, "-I", str(Path(__file__).resolve()), library_path, loaded_openmp_runtime() or ""]
        done = subprocess.run(command, capture_output=True,
                              stdin=subprocess.DEVNULL, text=True, errors="replace", timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return AmxProbeResult(ProbeOutcome.HUNG, f"no answer in {timeout_s:g} s (the child was killed)")
    except OSError as exc:
        return AmxProbeResult(ProbeOutcome.FAILED, f"could not start {python}: {exc}")
    if done.returncode < 0:
        return AmxProbeResult(ProbeOutcome.CRASHED, f"the child was killed by {signal_name(-done.returncode)}")
    lines = done.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if done.returncode == 0 and lines else None
    except json.JSONDecodeError:
        answer = None
    if not isinstance(answer, dict):
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return AmxProbeResult(ProbeOutcome.FAILED, f"the child exited with status {done.returncode}: {tail}")
    if not answer.get("amx_on"):
        return AmxProbeResult(ProbeOutcome.REFUSED, "the OS refused the process AMX state (arch_prctl)")
    if answer.get("wrong"):
        return AmxProbeResult(ProbeOutcome.WRONG, f"{len(answer['wrong'])} of {answer['checked']} calls differ "
                                                  f"from the exact result, first {answer['wrong'][0]}")
    return AmxProbeResult(ProbeOutcome.PASSED, f"{answer['checked']} calls exact")


if __name__ == "__main__":
    print(json.dumps(check_tiles_here(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)), flush=True)

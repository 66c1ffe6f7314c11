"""The start-up probe of the bfloat16 kernel's AMX tiles (kernels/amx_probe.py): before the tiles
first run in a process, they run in a child process, and a crash, a hang, wrong sums or a refused
AMX state there leave them off in the engine, which goes on. Checked on the AMX code over emulated
tiles (kernels/csrc/linear_bf16.c, ``-DLINEAR_BF16_EMULATE_AMX``), each fault asked of the
emulation by ``LINEAR_BF16_EMULATED_FAULT`` in the child's environment: the same probe runs the
real tiles on AMX CPUs."""

from __future__ import annotations

import ctypes
import logging
import platform
import sys

import pytest

from backend import Engine, EngineConfig
from backend.model.cpu_features import detect
from kernels import amx_probe, cpu_native
from kernels.amx_probe import ProbeOutcome

pytestmark = pytest.mark.usefixtures("fp16_matmuls_off")   # see tests/conftest.py

EMULATED = ("-mno-avx512f", "-DLINEAR_BF16_EMULATE_AMX")
FAULTS = {1: ProbeOutcome.CRASHED, 2: ProbeOutcome.WRONG, 3: ProbeOutcome.HUNG, 4: ProbeOutcome.REFUSED}
HANG_TIMEOUT_S = 3.0


def emulated_library() -> ctypes.CDLL:
    missing = {"avx2", "fma"} - detect().flags if platform.machine() in ("x86_64", "AMD64") else {"an x86 CPU"}
    if missing:
        pytest.skip(f"NOT RUN: the AMX code over emulated tiles needs {sorted(missing)}, which this CPU lacks")
    library = cpu_native.open_library(cpu_native.build(cflags=cpu_native.CFLAGS + EMULATED))
    assert cpu_native.linear_bf16_version(library) == "amx-emulated"
    return library


def test_the_probe_passes_correct_tiles() -> None:
    library = emulated_library()
    result = amx_probe.probe(library._name)
    assert result.outcome is ProbeOutcome.PASSED, result
    calls = len(amx_probe.ROW_COUNTS) * len(amx_probe.THREAD_COUNTS) * 2      # two kernels
    assert result.detail == f"{calls} calls exact"
    assert cpu_native.use_amx(True, library) and cpu_native.amx_in_use(library)
    cpu_native.use_amx(False, library)


def test_the_child_runs_the_tiles_on_every_panel_group() -> None:
    """The child's work, here in-process on the emulated tiles: every call goes through them
    (the emulation counts its tile products), with groups of 4, 3, 2 and 1 panels."""
    library = emulated_library()
    products = library.linear_bf16_emulated_tile_products     # emulated builds only
    products.restype = ctypes.c_int64
    before = products()
    answer = amx_probe.check_tiles_here(library._name)
    assert answer == {"amx_on": True, "checked": len(amx_probe.ROW_COUNTS) * len(amx_probe.THREAD_COUNTS) * 2,
                      "wrong": [], "openmp": None}
    # one TDPBF16PS per 16-row block, panel and 32 k, whatever the grouping
    blocks = sum(-(-rows // 16) for rows in amx_probe.ROW_COUNTS)
    panels = -(-amx_probe.OUT_FEATURES // amx_probe.PANEL)
    per_pass = blocks * panels * (amx_probe.IN_FEATURES // 32)
    assert products() - before == per_pass * len(amx_probe.THREAD_COUNTS) * 2
    assert not cpu_native.amx_in_use(library)           # the child turns them off again


def ask_for_fault(monkeypatch: pytest.MonkeyPatch, library: ctypes.CDLL, fault: int) -> amx_probe.AmxProbeResult:
    """Probe with ``fault`` asked of the child's emulated tiles only: the variable is unset again
    before this process calls the library itself, so what follows tests the probe's answer, not
    a fault (a refusal, a SIGILL) of this process's own."""
    monkeypatch.setattr(amx_probe, "_probes", {})
    monkeypatch.setenv("LINEAR_BF16_EMULATED_FAULT", str(fault))
    if fault == 3:
        monkeypatch.setattr(amx_probe, "TIMEOUT_S", HANG_TIMEOUT_S)
    result = cpu_native.amx_probe_result(library)
    monkeypatch.delenv("LINEAR_BF16_EMULATED_FAULT")
    return result


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_faulty_tile_path_stays_off_and_the_process_goes_on(fault: int, caplog: pytest.LogCaptureFixture,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The fault happens in the child; this process gets the tiles off, a warning naming what
    happened, and the kernel's version without tiles."""
    library = emulated_library()
    with caplog.at_level(logging.WARNING, logger="kernels.amx_probe"):
        result = ask_for_fault(monkeypatch, library, fault)
    assert result.outcome is FAULTS[fault], result
    assert f"AMX probe {FAULTS[fault].value}" in caplog.text and "stay off" in caplog.text
    if fault == 1:
        assert "SIGILL" in result.detail
    # Tiles that would run here (no fault asked of this process) stay off all the same.
    assert cpu_native.use_amx(True, library) is False
    assert not cpu_native.amx_in_use(library)


def test_the_probe_runs_once_per_library(monkeypatch: pytest.MonkeyPatch) -> None:
    library = emulated_library()
    calls: list[str] = []
    real_probe = amx_probe.probe

    def counting_probe(path: str, timeout_s: float | None = None) -> amx_probe.AmxProbeResult:
        calls.append(path)
        return real_probe(path, timeout_s)

    monkeypatch.setattr(amx_probe, "_probes", {})
    monkeypatch.setattr(amx_probe, "probe", counting_probe)
    for _ in range(3):
        assert cpu_native.use_amx(True, library)
    assert calls == [library._name]
    cpu_native.use_amx(False, library)


def test_turning_the_tiles_off_runs_no_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    library = emulated_library()
    monkeypatch.setattr(amx_probe, "_probes", {})
    monkeypatch.setattr(amx_probe, "probe", lambda *args: pytest.fail("probed to turn the tiles off"))
    assert cpu_native.use_amx(False, library) is False


def test_a_library_without_amx_is_not_probed(monkeypatch: pytest.MonkeyPatch) -> None:
    if cpu_native.load() is None:
        pytest.skip("NOT RUN: no C compiler here")
    if cpu_native.linear_bf16_version() in cpu_native.AMX_VERSIONS:
        pytest.skip("NOT RUN: this CPU has AMX, so the engine's own build has an AMX version to probe")
    monkeypatch.setattr(amx_probe, "probe", lambda *args: pytest.fail("probed a build without AMX"))
    assert cpu_native.amx_probe_result() is None
    assert cpu_native.use_amx(True) is False


def test_a_child_that_cannot_load_the_library_is_a_failed_probe(tmp_path) -> None:
    result = amx_probe.probe(str(tmp_path / "missing.so"))
    assert result.outcome is ProbeOutcome.FAILED
    assert "exited with status 1" in result.detail and "missing.so" in result.detail


def test_the_probe_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    """A signal without a name (real-time ones), or anything else unexpected, is a failed or
    crashed probe: start-up goes on."""
    assert amx_probe.signal_name(4) == "SIGILL" and amx_probe.signal_name(40) == "signal 40"

    def broken_run(*args, **kwargs):
        raise RuntimeError("something unforeseen")

    monkeypatch.setattr(amx_probe.subprocess, "run", broken_run)
    result = amx_probe.probe("/nowhere.so")
    assert result.outcome is ProbeOutcome.FAILED and "something unforeseen" in result.detail


def test_inside_tritons_stub_the_child_runs_under_python3(monkeypatch: pytest.MonkeyPatch) -> None:
    """An embedded interpreter's sys.executable may be its host binary; the child then runs
    under python3 on PATH."""
    monkeypatch.setattr(sys, "executable", "/opt/tritonserver/backends/python/triton_python_backend_stub")
    monkeypatch.setattr(amx_probe.shutil, "which", lambda name: "/usr/bin/python3" if name == "python3" else None)
    monkeypatch.setattr(amx_probe.os, "access", lambda path, mode: True)
    assert amx_probe.python_interpreter() == "/usr/bin/python3"


def test_the_start_up_line_says_why_the_tiles_are_off(model_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    """What an operator reads when the tiles failed their probe: the engine starts, bfloat16 on
    our kernel without tiles, and its start-up line names the probe's outcome."""
    library = emulated_library()
    ask_for_fault(monkeypatch, library, 1)
    monkeypatch.setattr(cpu_native, "load", lambda: library)     # the engine's own build, with AMX (emulated)
    engine = Engine(EngineConfig(model=str(model_dir), dtype="bfloat16", cpu_linear="native", load_format="dummy",
                                 num_kv_blocks=32, device="cpu", calibration_cache=False))
    line = next(note for note in engine.runner.startup_notes if "linear layers" in note)
    assert "amx-emulated, AMX tiles off: AMX probe crashed: the child was killed by SIGILL" in line, line
    assert not cpu_native.amx_in_use(library)


def test_the_child_runs_on_the_parents_openmp_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch ships its own libgomp, which the engine's kernels bind to; the child loads that one
    first, so it runs the tiles on the same runtime (not whatever the system has, or lacks)."""
    library = emulated_library()
    runtime = amx_probe.loaded_openmp_runtime()
    assert runtime is not None and "libgomp" in runtime      # torch is imported, and the kernels loaded
    seen: list[list[str]] = []
    real_run = amx_probe.subprocess.run

    def recording_run(command, **kwargs):
        seen.append(command)
        return real_run(command, **kwargs)

    monkeypatch.setattr(amx_probe.subprocess, "run", recording_run)
    assert amx_probe.probe(library._name).passed
    assert seen[0][-2:] == [library._name, runtime]

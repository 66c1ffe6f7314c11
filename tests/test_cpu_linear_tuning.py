"""``cpu_linear`` timed at start-up (backend/model/cpu_linear_tuning.py): when the engine times the
paths instead of following the rule, how it scores them, that a path computing wrong numbers is
never chosen, and that an engine started with ``cpu_linear=measure`` serves with what it chose."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from backend import Engine, EngineConfig, SamplingParams
from backend.model.architecture import ModelArchitecture
from backend.model.cpu_features import CpuFeatures
from backend.model.cpu_linear import NativeLinear, PackedLinear, rule_is_measured
from backend.model import cpu_linear_tuning
from backend.model.cpu_linear_tuning import (HINTED_ONEDNN, NATIVE_MARGIN, PATH_MAKERS, TOLERANCE, PathTiming,
                                             choose_cpu_linear, fastest, path_makers, projection_shapes, time_paths)
from kernels import cpu_native

pytestmark = pytest.mark.usefixtures("fp16_matmuls_off")   # see tests/conftest.py

AVX2 = CpuFeatures.of("avx2", "fma")
AVX512 = CpuFeatures.of("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq")
AVX512_BF16 = CpuFeatures.of(*AVX512.flags, "avx512_bf16")
AMX_BF16 = CpuFeatures.of(*AVX512_BF16.flags, "amx_bf16", "amx_tile")


def timing(path: str, decode_ms: float, prefill_ms: float) -> PathTiming:
    return PathTiming(path, decode_ms, prefill_ms, decode_rows=16, prefill_rows=512)


def test_score_is_time_per_token_over_equal_prompt_and_output_tokens() -> None:
    assert timing("native", 32.0, 1024.0).per_token_ms == pytest.approx(32.0 / 16 + 1024.0 / 512)
    # Faster at decode but slow enough at prompts to lose overall.
    quick_decode = timing("onednn", 16.0, 4096.0)     # 1 + 8 ms a token
    quick_prefill = timing("native", 32.0, 512.0)     # 2 + 1
    assert fastest([quick_decode, quick_prefill]).path == "native"
    assert fastest([timing("onednn", 16.0, 512.0), timing("torch", 64.0, 512.0)]).path == "onednn"


def test_ours_wins_unless_another_path_is_clearly_faster() -> None:
    ours = timing("native", 32.0, 1024.0)                         # 4 ms a token
    within = timing("onednn", 32.0 / NATIVE_MARGIN * 1.01, 1024.0 / NATIVE_MARGIN * 1.01)
    beyond = timing("onednn", 32.0 / NATIVE_MARGIN * 0.95, 1024.0 / NATIVE_MARGIN * 0.95)
    assert fastest([within, ours]).path == "native"
    assert fastest([beyond, ours]).path == "onednn"
    assert fastest([within]).path == "onednn"                    # without ours: the fastest


class FakeTimer:
    """Stands in for time_paths: records its calls and answers the given timings and errors."""

    def __init__(self, timings: list[PathTiming], errors: dict[str, float] | None = None) -> None:
        self.timings, self.errors, self.calls = timings, errors, []

    def __call__(self, shapes, dtype, paths, decode_rows, makers):
        assert set(paths) <= set(makers)
        self.calls.append((len(shapes), dtype, list(paths), decode_rows))
        errors = self.errors if self.errors is not None else {t.path: 0.0 for t in self.timings}
        return [t for t in self.timings if t.path in paths], errors


@pytest.fixture
def arch(model_dir: Path) -> ModelArchitecture:
    return ModelArchitecture.from_folder(model_dir)


@pytest.fixture
def amx_machine(monkeypatch: pytest.MonkeyPatch) -> CpuFeatures:
    """An AMX CPU whose gcc builds our kernel's AMX version, and on which both paths run."""
    monkeypatch.setattr(cpu_native, "linear_bf16_version", lambda library=None: "amx-bf16")
    monkeypatch.setattr(cpu_linear_tuning, "native_kernel_available", lambda dtype: True)
    monkeypatch.setattr(cpu_linear_tuning, "onednn_packing_available", lambda dtype, features=None: True)
    return AMX_BF16


def test_only_bfloat16_on_amx_lacks_a_measured_rule(amx_machine: CpuFeatures, monkeypatch: pytest.MonkeyPatch) -> None:
    assert not rule_is_measured(torch.bfloat16, AMX_BF16)
    assert rule_is_measured(torch.float32, AMX_BF16)
    for features in (AVX2, AVX512, AVX512_BF16):
        assert rule_is_measured(torch.bfloat16, features)
    # An AMX CPU whose compiler could not build the AMX version: the measured dot-products cell.
    monkeypatch.setattr(cpu_native, "linear_bf16_version", lambda library=None: "avx512-bf16")
    assert rule_is_measured(torch.bfloat16, AMX_BF16)


def test_auto_times_the_paths_where_the_rule_has_no_figures(arch: ModelArchitecture,
                                                            amx_machine: CpuFeatures) -> None:
    timer = FakeTimer([timing("native", 14.0, 300.0), timing("onednn", 29.0, 250.0),
                       timing(HINTED_ONEDNN, 27.0, 260.0)])
    choice = choose_cpu_linear("auto", torch.bfloat16, arch, max_num_seqs=64, features=amx_machine, timer=timer)
    assert timer.calls == [(4 * arch.num_layers, torch.bfloat16, ["native", "onednn", HINTED_ONEDNN], 16)]
    assert (choice.path, choice.onednn_batch_hint) == ("native", None)
    assert "timed at start-up" in choice.why and "native 14.0 ms at 16 rows" in choice.why
    assert [t.path for t in choice.timings] == ["native", "onednn", HINTED_ONEDNN]
    # The decode batch timed is no larger than the engine runs.
    choose_cpu_linear("auto", torch.bfloat16, arch, max_num_seqs=4, features=amx_machine, timer=timer)
    assert timer.calls[-1][3] == 4
    # oneDNN clearly faster: chosen, packed as it was timed.
    timer = FakeTimer([timing("native", 30.0, 900.0), timing("onednn", 20.0, 250.0),
                       timing(HINTED_ONEDNN, 22.0, 250.0)])
    choice = choose_cpu_linear("auto", torch.bfloat16, arch, features=amx_machine, timer=timer)
    assert (choice.path, choice.onednn_batch_hint) == ("onednn", None)
    timer = FakeTimer([timing("native", 30.0, 900.0), timing("onednn", 20.0, 250.0),
                       timing(HINTED_ONEDNN, 12.0, 250.0)])
    choice = choose_cpu_linear("auto", torch.bfloat16, arch, max_num_seqs=8, features=amx_machine, timer=timer)
    assert (choice.path, choice.onednn_batch_hint) == ("onednn", 8)


def test_the_rule_and_explicit_choices_time_nothing(arch: ModelArchitecture, amx_machine: CpuFeatures) -> None:
    timer = FakeTimer([timing("native", 1.0, 1.0), timing("onednn", 100.0, 100.0)])
    # float32 on AMX: the measured rule (oneDNN's 512-bit registers), however the paths would time.
    choice = choose_cpu_linear("auto", torch.float32, arch, features=amx_machine, timer=timer)
    assert (choice.path, choice.timings) == ("onednn", ())
    assert "measured rule" in choice.why
    assert choose_cpu_linear("onednn", torch.bfloat16, arch, features=amx_machine, timer=timer).path == "onednn"
    assert choose_cpu_linear("auto", torch.bfloat16, arch, on_cpu=False, features=amx_machine,
                             timer=timer).path == "torch"
    assert timer.calls == []
    with pytest.raises(ValueError, match="CPU"):
        choose_cpu_linear("measure", torch.bfloat16, arch, on_cpu=False, features=amx_machine, timer=timer)


def test_measure_with_one_runnable_path_takes_it_untimed(arch: ModelArchitecture) -> None:
    # bfloat16 here (AVX2): oneDNN cannot pack bfloat16, our kernel's AVX2 version runs.
    timer = FakeTimer([timing("native", 1.0, 1.0)])
    choice = choose_cpu_linear("measure", torch.bfloat16, arch, features=AVX2, timer=timer)
    assert choice.path == "native" and "only native runs here" in choice.why
    assert timer.calls == []


def test_a_path_with_wrong_results_is_never_chosen(arch: ModelArchitecture, amx_machine: CpuFeatures,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    # time_paths leaves a failing path out of the timings; the choice names it in the log.
    timer = FakeTimer([timing("onednn", 29.0, 250.0)], errors={"native": 0.5, "onednn": 0.001})
    with caplog.at_level(logging.WARNING, logger=cpu_linear_tuning.__name__):
        choice = choose_cpu_linear("auto", torch.bfloat16, arch, features=amx_machine, timer=timer)
    assert choice.path == "onednn"
    assert "native computes wrong results" in caplog.text
    # A path that raised (error inf) was logged with its exception by time_paths: not again here
    # as one computing wrong results.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=cpu_linear_tuning.__name__):
        choice = choose_cpu_linear("auto", torch.bfloat16, arch, features=amx_machine,
                                   timer=FakeTimer([timing("onednn", 29.0, 250.0)],
                                                   errors={"native": float("inf"), "onednn": 0.001}))
    assert choice.path == "onednn" and "computes wrong results" not in caplog.text
    with pytest.raises(RuntimeError, match="no linear path"):
        choose_cpu_linear("auto", torch.bfloat16, arch, features=amx_machine,
                          timer=FakeTimer([], errors={"native": 0.5, "onednn": float("inf")}))


class OffByOnePair(nn.Module):
    """F.linear without the input's last two features: a kernel that drops its last k pair."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x[:, :-2], self.weight[:, :-2])


class NaNOnce(nn.Module):
    """Right everywhere but one element: the check must see a single NaN."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        y[-1, -1] = float("nan")
        return y


# Small shapes (two layers of a made-up model) keep this quick; the real ones run in the engine test.
SHAPES = [(64, 96), (64, 64), (64, 256), (128, 64)] * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_time_paths_checks_each_path_against_f_linear(dtype: torch.dtype) -> None:
    makers = {"native": PATH_MAKERS["native"], "dropped-pair": OffByOnePair, "nan": NaNOnce}
    if dtype == torch.float32:   # oneDNN packs float32 here, with and without the hint
        makers.update(onednn=PATH_MAKERS["onednn"], **{HINTED_ONEDNN: path_makers(16)[HINTED_ONEDNN]})
    timings, errors = time_paths(SHAPES, dtype, list(makers), decode_rows=16, prefill_rows=40, rounds=2,
                                 makers=makers)
    assert errors["native"] <= TOLERANCE[dtype]      # our kernel (AVX2 version for bfloat16 here)
    assert errors["dropped-pair"] > 10 * TOLERANCE[dtype]
    assert errors["nan"] == float("inf")
    correct = ["native"] + (["onednn", HINTED_ONEDNN] if dtype == torch.float32 else [])
    assert all(errors[path] <= TOLERANCE[dtype] for path in correct)
    assert [t.path for t in timings] == correct
    ours = timings[0]
    assert (ours.decode_rows, ours.prefill_rows) == (16, 40)
    assert ours.decode_ms > 0 and ours.prefill_ms > 0


class FakeClock:
    """time.perf_counter for time_paths: each projection call takes 1 ms (decode rows) or 3 ms."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def maker(self, weight: torch.Tensor, bias: None) -> nn.Module:
        clock = self

        class Ticking(nn.Module):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                clock.now += 1e-3 if x.shape[0] == 16 else 3e-3
                return F.linear(x, weight)
        return Ticking()


def test_time_paths_times_whole_layers_within_the_budget_and_scales_to_the_model(
        monkeypatch: pytest.MonkeyPatch) -> None:
    layer_bytes = sum(k * n for k, n in SHAPES[:4]) * 4              # float32
    clock = FakeClock()
    monkeypatch.setattr(cpu_linear_tuning.time, "perf_counter", clock)
    made: list[tuple[int, ...]] = []

    def counting(weight: torch.Tensor, bias: None) -> nn.Module:
        made.append(tuple(weight.shape))
        return clock.maker(weight, bias)

    model = SHAPES[:4] * 10                                           # 10 layers
    # Room for 3 layers of each of 2 paths (and a little more): 3 timed, scaled to 10.
    monkeypatch.setattr(cpu_linear_tuning, "MAX_WEIGHT_BYTES", 2 * 3 * layer_bytes + 100)
    timings, errors = time_paths(model, torch.float32, ["a", "b"], decode_rows=16, prefill_rows=40, rounds=2,
                                 makers={"a": counting, "b": counting})
    assert made == [(n, k) for k, n in SHAPES[:4] * 3] * 2
    assert errors == {"a": 0.0, "b": 0.0}
    for timing in timings:
        # decode: 12 projections of 1 ms timed, x 40/12; prefill: the first layer, 4 x 3 ms, x 10.
        assert timing.decode_ms == pytest.approx(40.0)
        assert timing.prefill_ms == pytest.approx(120.0)
    # Not one layer per path fits: no timing at all.
    monkeypatch.setattr(cpu_linear_tuning, "MAX_WEIGHT_BYTES", 2 * layer_bytes - 1)
    with pytest.raises(ValueError, match="one layer"):
        time_paths(model, torch.float32, ["a", "b"], decode_rows=16, makers={"a": counting, "b": counting})


def test_a_path_that_raises_is_no_candidate_and_amx_is_restored(monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    state = {"amx": False}
    calls: list[bool] = []

    def use_amx(on: bool, library: None = None) -> bool:
        calls.append(on)
        state["amx"] = on
        return on

    monkeypatch.setattr(cpu_native, "use_amx", use_amx)
    monkeypatch.setattr(cpu_native, "amx_in_use", lambda library=None: state["amx"])

    def refusing(weight: torch.Tensor, bias: None) -> nn.Module:
        raise RuntimeError("cannot pack this here")

    makers = {"native": PATH_MAKERS["native"], "refusing": refusing}
    with caplog.at_level(logging.WARNING, logger=cpu_linear_tuning.__name__):
        timings, errors = time_paths(SHAPES, torch.bfloat16, ["native", "refusing"], decode_rows=16,
                                     prefill_rows=40, rounds=1, makers=makers)
    assert [t.path for t in timings] == ["native"] and errors["refusing"] == float("inf")
    assert "refusing raised RuntimeError('cannot pack this here')" in caplog.text
    assert calls == [True, False] and state["amx"] is False          # on for our kernel, then as before
    # Restored when the timing itself fails, and to what it was (on) before.
    state["amx"], calls[:] = True, []

    def broken(weight: torch.Tensor, bias: None) -> nn.Module:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        time_paths(SHAPES, torch.bfloat16, ["native", "broken"], decode_rows=16, prefill_rows=40, rounds=1,
                   makers={**makers, "broken": broken})
    assert calls == [True, True] and state["amx"] is True


def test_int8_projections_and_huge_layers_keep_the_rule(arch: ModelArchitecture, amx_machine: CpuFeatures,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    timer = FakeTimer([timing("native", 1.0, 1.0), timing("onednn", 100.0, 100.0)])
    choice = choose_cpu_linear("auto", torch.bfloat16, arch, quantization="int8", features=amx_machine, timer=timer)
    assert choice.path == "onednn" and "int8" in choice.why
    monkeypatch.setattr(cpu_linear_tuning, "MAX_WEIGHT_BYTES", 1 << 20)   # SmolLM2's layer: ~7 MB in bfloat16
    choice = choose_cpu_linear("measure", torch.bfloat16, arch, features=amx_machine, timer=timer)
    assert choice.path == "onednn" and "too large to time" in choice.why
    assert timer.calls == []


def test_projection_shapes_are_a_decode_steps_matmuls(arch: ModelArchitecture) -> None:
    shapes = projection_shapes(arch)
    assert len(shapes) == 4 * arch.num_layers
    qkv = (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim
    assert shapes[:4] == [(arch.hidden_size, qkv), (arch.num_heads * arch.head_dim, arch.hidden_size),
                          (arch.hidden_size, 2 * arch.intermediate_size), (arch.intermediate_size, arch.hidden_size)]


def test_engine_with_measure_serves_with_the_path_it_chose(model_dir: Path, prose_ids: list[int],
                                                           caplog: pytest.LogCaptureFixture) -> None:
    # float32 here: our kernel and oneDNN both run, so this times both on the model's shapes.
    with caplog.at_level(logging.INFO):
        engine = Engine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=64, cpu_linear="measure",
                                     itl_target_ms=0.0, calibration_cache=False))
    chosen = engine.runner.cpu_linear
    assert chosen in ("native", "onednn")
    layer_type = {"native": NativeLinear, "onednn": PackedLinear}[chosen]
    assert isinstance(engine.runner.model.model.layers[0].mlp.down_proj, layer_type)
    # Whichever of the timed paths won on this machine (oneDNN packed for the decode batch wins
    # on some CPUs), the log names that one, then every timing it chose from.
    hint = engine.runner.onednn_batch_hint
    assert hint is None or chosen == "onednn"
    packed = f" packed for {hint} rows" if hint is not None else ""
    assert f"linear layers {chosen}{packed} (cpu_linear=measure: native " in caplog.text
    assert "; onednn " in caplog.text and f"; {HINTED_ONEDNN} " in caplog.text and " ms at 16 rows" in caplog.text
    # Greedy tokens do not depend on which of the two it chose: test_cpu_linear.py's
    # test_engine_tokens_do_not_depend_on_the_linear_path. Here: it serves.
    (output,) = engine.generate([prose_ids[:40]], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(output.token_ids) == 4


def test_the_hint_chosen_is_the_hint_packed(model_dir: Path, arch: ModelArchitecture,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # onednn packed for the decode batch serves exactly as it was timed: every projection (the
    # head of a float32 model too) is packed with the hint.
    from backend.model import cpu_linear
    from backend.model.loader import load_model
    hints: list[int | None] = []

    class Recording(PackedLinear):
        def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, batch_size: int | None = None) -> None:
            hints.append(batch_size)
            super().__init__(weight, bias, batch_size)

    monkeypatch.setattr(cpu_linear, "PackedLinear", Recording)
    model = load_model(model_dir, arch, torch.float32, torch.device("cpu"), cpu_linear="onednn", onednn_batch_hint=16)
    assert hints == [16] * (4 * arch.num_layers + 1)
    assert isinstance(model.model.layers[0].mlp.down_proj, Recording)

"""The Newton–Schulz probe: picks the fastest allowed kernel from (injected) timings, within the
precision ceiling, once per key, with a disk cache, never when pinned, leaving global state as found;
and every kernel it may pick stays within its documented distance from float64."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import optzoo.optimizers.newton_schulz_probe as probe
from optzoo.optimizers.muon import Muon
from optzoo.optimizers.newton_schulz_probe import Kernel, allowed_kernels, choose_kernel, probe_report, run_kernel
from tests.optimizers.test_newton_schulz_sharded import polar_polynomial


@pytest.fixture(autouse=True)
def probing(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Undo the suite's pin (tests/conftest.py), and start from an empty memory cache."""
    monkeypatch.delenv(probe.VARIANT_ENV, raising=False)
    probe.clear_probe_cache()
    yield
    probe.clear_probe_cache()


class FakeClock:
    """A clock that moves only when a kernel runs, by that kernel's injected time."""

    def __init__(self, seconds: dict[str, float]) -> None:
        self.now = 0.0
        self.seconds = seconds
        self.runs: list[str] = []

    def __call__(self) -> float:
        return self.now

    def run(self, x: torch.Tensor, kernel: Kernel | None, **settings: Any) -> torch.Tensor:
        assert kernel is not None
        self.runs.append(str(kernel))
        self.now += self.seconds[str(kernel)]
        return x


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock({})
    monkeypatch.setattr(probe, "_timer", fake)
    monkeypatch.setattr(probe, "run_kernel", fake.run)
    return fake


SETTINGS: dict[str, Any] = {"steps": 5, "coefficient_type": "quintic"}
MEDIUM_CPU = ["standard/ieee", "gram/ieee", "standard/bf16"]
MEDIUM_CPU_BATCHED = MEDIUM_CPU + [f"{name}/per-matrix" for name in MEDIUM_CPU]


def test_allowed_kernels_per_ceiling(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    names = lambda precision, dtype=torch.float32, batch=1: [str(k) for k in allowed_kernels(precision, dtype, cpu, batch)]  # noqa: E731
    assert names("highest") == ["standard/ieee", "gram/ieee"]
    assert names("high") == ["standard/ieee", "gram/ieee"]  # no TF32 on a CPU
    assert names("medium") == MEDIUM_CPU
    assert names("medium", batch=3) == MEDIUM_CPU_BATCHED
    assert names("medium", dtype=torch.float64) == ["standard/ieee", "gram/ieee"]  # float64 computes in float64
    monkeypatch.setattr(probe, "_has_tf32", lambda device: True)
    assert names("high") == ["standard/ieee", "gram/ieee", "standard/tf32"]
    assert names("medium") == ["standard/ieee", "gram/ieee", "standard/tf32", "standard/bf16"]


def test_from_512_rows_symmetric_blocks_are_timed_against_dense_products() -> None:
    kernels = [str(k) for k in allowed_kernels("medium", torch.float32, torch.device("cpu"), 1, short_side=512)]
    assert kernels == ["standard/ieee/blocks", "standard/ieee/dense", "gram/ieee/blocks", "gram/ieee/dense", "standard/bf16"]
    assert all(Kernel.parse(name) == kernel for name, kernel in zip(kernels, allowed_kernels("medium", torch.float32, torch.device("cpu"), 1, 512)))
    assert Kernel.parse("gram/ieee/dense/per-matrix") == Kernel("gram", "ieee", stacked=False, blocks=False)


def test_probe_picks_the_fastest_and_reports_every_time(clock: FakeClock) -> None:
    # dyadic times: exact sums. Stage 1 times the stacked forms (gram/ieee wins), then the winner per matrix.
    clock.seconds = dict(zip(MEDIUM_CPU_BATCHED, [n / 1024 for n in (4, 2, 3, 5, 1, 6)], strict=True))
    x = torch.randn(5, 16, 40)
    kernel = choose_kernel(x, matmul_precision="medium", **SETTINGS)
    assert str(kernel) == "gram/ieee/per-matrix"
    [record] = probe_report()
    assert record.source == "measured" and record.kernel == "gram/ieee/per-matrix"
    timed = ["standard/ieee", "gram/ieee", "standard/bf16", "gram/ieee/per-matrix"]
    assert record.seconds == {name: clock.seconds[name] for name in timed}  # each kernel's own time, from the injected clock
    assert record.key.short == 16 and record.key.long == 40 and record.key.batch_class == 8
    assert record.sample_matrices == probe.PROBE_SAMPLE_MATRICES
    # Each kernel: one warm-up, then repeats while its share of the budget lasts (at most 3).
    assert record.runs == dict.fromkeys(timed, 1 + probe.PROBE_MAX_REPEATS)
    assert record.probe_seconds == sum(record.seconds.values()) * (1 + probe.PROBE_MAX_REPEATS)


def test_the_search_refines_the_fastest_form_with_blocks_then_per_matrix(clock: FakeClock) -> None:
    names = [str(k) for k in allowed_kernels("highest", torch.float32, torch.device("cpu"), 2, short_side=512)]
    # standard/ieee/dense wins the forms; its blocks form is faster still; per matrix is slower
    clock.seconds = dict.fromkeys(names, 1.0) | {
        "standard/ieee/dense": 0.5, "gram/ieee/dense": 0.75, "standard/ieee/blocks": 0.25, "standard/ieee/blocks/per-matrix": 0.375,
    }  # fmt: skip
    assert str(choose_kernel(torch.randn(2, 512, 520), matmul_precision="highest", **SETTINGS)) == "standard/ieee/blocks"
    assert clock.runs == ["standard/ieee/dense", "gram/ieee/dense", "standard/ieee/blocks", "standard/ieee/blocks/per-matrix"]
    [record] = probe_report()
    assert record.runs == dict.fromkeys(clock.runs, 1)  # each run alone outlasts its share (0.2 s / 4)


def test_a_loop_slower_than_ieee_in_the_screen_is_never_run(clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> None:
    # A CPU without bf16 units emulates bf16 matmuls: one product of the screen says so, and no
    # bf16 kernel's first run (seconds on such a machine) is paid.
    monkeypatch.setattr(probe, "screen_loops", lambda matrix, loops: {"ieee": 0.001, "bf16": 0.012})
    clock.seconds = {"standard/ieee": 0.002, "gram/ieee": 0.003, "standard/bf16": 0.0001}
    assert str(choose_kernel(torch.randn(16, 40), matmul_precision="medium", **SETTINGS)) == "standard/ieee"
    assert set(clock.runs) == {"standard/ieee", "gram/ieee"}
    [record] = probe_report()
    assert record.screen == {"ieee": 0.001, "bf16": 0.012} and record.screened_out == ["standard/bf16"]


def test_the_screen_times_one_product_per_loop_on_a_bounded_block(monkeypatch: pytest.MonkeyPatch) -> None:
    shapes: list[tuple[tuple[int, ...], torch.dtype]] = []
    real_matmul = torch.Tensor.__matmul__

    def spy(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        shapes.append((tuple(a.shape) + tuple(b.shape), a.dtype))
        return real_matmul(a, b)

    monkeypatch.setattr(torch.Tensor, "__matmul__", spy)
    seconds = probe.screen_loops(torch.randn(3000, 300), ["ieee", "bf16"])
    assert set(seconds) == {"ieee", "bf16"} and all(0 < value < 1 for value in seconds.values())
    block = (256, 1024, 1024, 256)  # the short side first, at most SCREEN_BLOCK
    assert shapes == [(block, torch.float32), (block, torch.bfloat16)] * (1 + probe.SCREEN_ROUNDS)


def test_a_kernel_slower_than_its_share_runs_once_and_ties_go_to_the_more_accurate(clock: FakeClock) -> None:
    clock.seconds = {"standard/ieee": 1.0, "gram/ieee": 1.0}
    assert str(choose_kernel(torch.randn(8, 8), matmul_precision="highest", **SETTINGS)) == "standard/ieee"
    [record] = probe_report()
    assert record.runs == {"standard/ieee": 1, "gram/ieee": 1}
    assert record.probe_seconds == 2.0


def test_highest_never_tries_a_coarser_kernel(clock: FakeClock) -> None:
    clock.seconds = {"standard/ieee": 0.003, "gram/ieee": 0.002, "standard/tf32": 1e-6, "standard/bf16": 1e-9}
    for precision, allowed in [("highest", {"standard/ieee", "gram/ieee"}), ("high", {"standard/ieee", "gram/ieee"})]:
        clock.runs.clear()
        assert str(choose_kernel(torch.randn(8, 24), matmul_precision=precision, **SETTINGS)) == "gram/ieee"
        assert set(clock.runs) == allowed
    assert str(choose_kernel(torch.randn(8, 24), matmul_precision="medium", **SETTINGS)) == "standard/bf16"


def test_second_call_of_a_key_does_not_probe(clock: FakeClock) -> None:
    clock.seconds = dict.fromkeys(MEDIUM_CPU_BATCHED, 0.001)
    choose_kernel(torch.randn(3, 16, 40), matmul_precision="medium", **SETTINGS)
    runs = len(clock.runs)
    # Same class: another batch of up to 4, the transposed shape; no new run.
    choose_kernel(torch.randn(4, 40, 16), matmul_precision="medium", **SETTINGS)
    assert len(clock.runs) == runs and len(probe_report()) == 1
    choose_kernel(torch.randn(5, 16, 40), matmul_precision="medium", **SETTINGS)  # batch class 8: a new key
    assert len(clock.runs) > runs and len(probe_report()) == 2


def test_disk_cache_round_trips(clock: FakeClock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ns.json"
    monkeypatch.setenv(probe.CACHE_ENV, str(path))
    clock.seconds = {"standard/ieee": 2 / 1024, "gram/ieee": 1 / 1024, "standard/bf16": 3 / 1024}  # dyadic: exact
    x = torch.randn(16, 40)
    assert str(choose_kernel(x, matmul_precision="medium", **SETTINGS)) == "gram/ieee"
    saved = json.loads(path.read_text())
    [machine] = saved
    assert machine.endswith(f"| {torch.get_num_threads()} threads | torch {torch.__version__}")
    assert saved[machine]["float32 16x40 batch<=1 medium steps=5"]["kernel"] == "gram/ieee"
    probe.clear_probe_cache()  # a new process
    clock.runs.clear()
    assert str(choose_kernel(x, matmul_precision="medium", **SETTINGS)) == "gram/ieee"
    assert clock.runs == []
    [record] = probe_report()
    assert record.source == "disk cache" and record.seconds == clock.seconds


def test_an_unreadable_disk_cache_warns_and_probes(clock: FakeClock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ns.json"
    path.write_text("{not json")
    monkeypatch.setenv(probe.CACHE_ENV, str(path))
    clock.seconds = {"standard/ieee": 0.002, "gram/ieee": 0.001}
    with pytest.warns(RuntimeWarning, match=r"OPTZOO_NS_CACHE: cannot read .*ns.json"):
        assert str(choose_kernel(torch.randn(16, 40), matmul_precision="highest", **SETTINGS)) == "gram/ieee"


def test_pinned_kernels_never_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_probe(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("probed")

    monkeypatch.setattr(probe, "measure", no_probe)
    x = torch.randn(16, 40)
    assert choose_kernel(x, matmul_precision="medium", setting="standard/bf16", **SETTINGS) == Kernel("standard", "bf16")
    assert choose_kernel(x, matmul_precision="medium", setting="auto", **SETTINGS) is None
    monkeypatch.setenv(probe.VARIANT_ENV, "gram/ieee/per-matrix")
    assert choose_kernel(x, matmul_precision="medium", **SETTINGS) == Kernel("gram", "ieee", stacked=False)
    # A Muon step with a pinned kernel: the pinned kernel runs, nothing is probed.
    monkeypatch.delenv(probe.VARIANT_ENV)
    w = torch.nn.Parameter(torch.randn(16, 40))
    w.grad = torch.randn(16, 40)
    Muon([w], ns_variant="gram/ieee").step()
    assert probe_report() == []


def test_a_muon_step_runs_the_probed_kernel(clock: FakeClock, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    clock.seconds = {"standard/ieee": 0.002, "gram/ieee": 0.003, "standard/bf16": 0.001}
    seen: list[tuple[str | None, torch.dtype]] = []
    real = run_kernel

    def spy(x: torch.Tensor, kernel: Kernel | None, **settings: Any) -> torch.Tensor:
        seen.append((str(kernel), x.dtype))
        return real(x, kernel, **settings)

    monkeypatch.setattr("optzoo.optimizers.muon.run_kernel", spy)
    w = torch.nn.Parameter(torch.randn(16, 40))
    w.grad = torch.randn(16, 40)
    with caplog.at_level(logging.INFO):
        Muon([w]).step()  # fp32_matmul_prec="medium", the default
    assert seen == [("standard/bf16", torch.float32)]
    assert caplog.records == []  # issue 25: a default run is silent at INFO; the probe logs at DEBUG
    assert [r.kernel for r in probe_report()] == ["standard/bf16"]


def test_under_a_process_group_the_rule_is_used_without_timing(clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(probe.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(probe.dist, "get_world_size", lambda group=None: 2)
    assert choose_kernel(torch.randn(16, 40), matmul_precision="medium", **SETTINGS) is None
    assert clock.runs == [] and [r.source for r in probe_report()] == ["rule under a process group"]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"ns_variant": "fast"}, ValueError,
         r"^`ns_variant`: unknown kernel; got 'fast'; expected 'probe', 'auto' or '<standard\|gram>/<ieee\|tf32\|bf16>\[/blocks\|/dense\]\[/per-matrix\]'"),
        ({"ns_variant": "standard/bf16/blocks"}, ValueError, r"^`ns_variant`: symmetric blocks are too coarse in bf16; got 'standard/bf16/blocks'"),
        ({"ns_variant": "standard/ieee/per-matrix/dense"}, ValueError, r"^`ns_variant`: unknown kernel; got 'standard/ieee/per-matrix/dense'"),
        ({"ns_variant": "gram/bf16"}, ValueError, r"^`ns_variant`: Gram Newton-Schulz squares the condition number .*; got 'gram/bf16'"),
        ({"ns_variant": 3}, TypeError, r"^`ns_variant`: must be a string; got int"),
        ({"ns_variant": "standard/bf16", "fp32_matmul_prec": "highest"}, ValueError,
         r"^param group #0: `ns_variant`: runs bf16 matmuls, coarser than fp32_matmul_prec='highest' allows; "
         r"got 'standard/bf16'; expected a kernel with loop precision in \['ieee'\], or 'probe' or 'auto'$"),
    ],
)  # fmt: skip
def test_bad_kernel_settings_raise(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        Muon([torch.nn.Parameter(torch.randn(4, 8))], **kwargs)


def test_the_config_field_pins_every_muon_it_builds() -> None:
    from optzoo import OptimizerConfig, get_optimizer
    from optzoo.models import GPT, GPTConfig

    model = GPT(GPTConfig(num_layers=1, hidden_size=16, num_heads=2, vocab_size=32, max_seq_len=8))
    optimizer = get_optimizer(OptimizerConfig(optimizer="muon", lr=0.02, muon_ns_variant="standard/ieee/per-matrix"), [model])
    muons = [inner for inner in optimizer.optimizers if isinstance(inner, Muon)]
    assert [m.ns_variant for m in muons] == ["standard/ieee/per-matrix"]
    with pytest.raises(ValueError, match=r"^`OptimizerConfig.muon_ns_variant`: unknown kernel; got 'fastest'; expected 'probe', 'auto' or"):
        OptimizerConfig(optimizer="muon", lr=0.02, muon_ns_variant="fastest")


def test_a_pin_in_the_environment_above_the_ceiling_raises_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(probe.VARIANT_ENV, "standard/bf16")
    w = torch.nn.Parameter(torch.randn(4, 8))
    w.grad = torch.randn(4, 8)
    before = w.detach().clone()
    opt = Muon([w], fp32_matmul_prec="highest")
    with pytest.raises(ValueError, match=re.escape("environment variable OPTZOO_NS_VARIANT: runs bf16 matmuls, coarser than")):
        opt.step()
    assert torch.equal(w.detach(), before)


# ---- no global state touched --------------------------------------------------------------


def read(getter: Any) -> Any:
    try:
        return getter()
    except RuntimeError as error:  # torch refuses to read some mixes of its legacy and new flags
        return f"unreadable: {error}"


def global_state() -> dict[str, Any]:
    """Every process-wide setting a Newton–Schulz step could plausibly change."""
    cuda_matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    mkldnn_matmul = getattr(torch.backends.mkldnn, "matmul", None)
    return {
        "float32_matmul_precision": read(torch.get_float32_matmul_precision),
        "cuda.matmul.fp32_precision": read(lambda: cuda_matmul.fp32_precision),
        "mkldnn.matmul.fp32_precision": read(lambda: getattr(mkldnn_matmul, "fp32_precision", None)),
        "cuda.matmul.allow_tf32": read(lambda: cuda_matmul.allow_tf32),
        "cuda.matmul.allow_bf16_reduced": cuda_matmul.allow_bf16_reduced_precision_reduction,
        "cuda.matmul.allow_fp16_reduced": cuda_matmul.allow_fp16_reduced_precision_reduction,
        "cudnn.allow_tf32": read(lambda: cudnn.allow_tf32),
        "cudnn.benchmark": cudnn.benchmark,
        "cudnn.deterministic": cudnn.deterministic,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "num_threads": torch.get_num_threads(),
        "num_interop_threads": torch.get_num_interop_threads(),
        "default_dtype": torch.get_default_dtype(),
        "grad_enabled": torch.is_grad_enabled(),
    }


@pytest.fixture
def unusual_global_state() -> Iterator[dict[str, Any]]:
    """Settings no step would pick: torch's 'medium' with CUDA matmuls set back to IEEE (the new
    per-backend API), cuDNN benchmarking on, bf16 reduced-precision reductions off, another thread count."""
    saved_precision = torch.get_float32_matmul_precision()
    threads = torch.get_num_threads()
    benchmark, reduced = torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    torch.set_float32_matmul_precision("medium")
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    with torch.backends.__allow_nonbracketed_mutation():  # other tests' torch.testing imports call disable_global_flags
        torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.set_num_threads(1 if threads > 1 else 2)
    yield global_state()
    torch.set_num_threads(threads)
    with torch.backends.__allow_nonbracketed_mutation():
        torch.backends.cudnn.benchmark = benchmark
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = reduced
    torch.set_float32_matmul_precision(saved_precision)


@pytest.mark.parametrize("precision", ["highest", "high", "medium"])
def test_probe_and_every_kernel_leave_global_state_as_found(unusual_global_state: dict[str, Any], precision: str) -> None:
    """The real probe (its timings are not asserted), then a step under every allowed kernel."""
    params = [torch.nn.Parameter(torch.randn(3, 8, 24)), torch.nn.Parameter(torch.randn(24, 8))]
    for setting in ["probe", "auto", *map(str, allowed_kernels(precision, torch.float32, torch.device("cpu"), 3))]:  # type: ignore[arg-type]
        opt = Muon(params, fp32_matmul_prec=precision, ns_variant=setting)  # type: ignore[arg-type]
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        assert global_state() == unusual_global_state, setting
    assert {r.source for r in probe_report()} == {"measured"}
    assert global_state() == unusual_global_state


# ---- every allowed kernel within its documented distance from float64 ----------------------

# Relative Frobenius distance ‖NS(x) − NS₆₄(x)‖_F / ‖NS₆₄(x)‖_F from the same iteration in float64
# (U f(S/‖x‖_F) Vᵀ), docs/optimizers.md "Distance from float64". Measured worst over 3 seeds of
# 2×64×256 and 2×96×48 inputs (low-rank: rank 4 and 8), 'quintic'/5, 'polar_express'/8, 'cans'/5:
# ieee 3.0e-4 (gram 2.9e-4); bf16 0.14 on random inputs, 3.2 on low-rank ones (the bf16 noise in
# the null space is lifted by the slope at 0, up to ~1e3: upstream's bf16 loop does the same).
# Bounds: the measured worst rounded up (not tightened further: a BLAS may round differently).
BOUNDS = {("ieee", "random"): 1e-4, ("ieee", "low-rank"): 1e-3, ("bf16", "random"): 0.2, ("bf16", "low-rank"): 4.0}


@pytest.mark.parametrize(("coefficient_type", "steps"), [("quintic", 5), ("polar_express", 8), ("cans", 5)])
@pytest.mark.parametrize("kind", ["random", "low-rank"])
def test_every_allowed_kernel_is_within_its_documented_distance_from_float64(kind: str, coefficient_type: str, steps: int) -> None:
    g = torch.Generator().manual_seed(0)
    if kind == "random":
        inputs = [torch.randn(2, 64, 256, generator=g), torch.randn(2, 96, 48, generator=g)]
    else:
        inputs = [torch.randn(2, 64, 4, generator=g) @ torch.randn(2, 4, 256, generator=g), torch.randn(2, 96, 8, generator=g) @ torch.randn(2, 8, 48, generator=g)]
    for x in inputs:
        reference = polar_polynomial(x, coefficient_type, steps)
        forced_blocks = [Kernel("standard", "ieee", blocks=True), Kernel("gram", "ieee", blocks=True)]  # below their 512 rows
        for kernel in allowed_kernels("medium", torch.float32, torch.device("cpu"), 2) + [Kernel("standard", "tf32"), *forced_blocks]:
            out = run_kernel(x, kernel, steps=steps, coefficient_type=coefficient_type, matmul_precision="medium")  # type: ignore[arg-type]
            distance = (torch.linalg.matrix_norm(out.double() - reference) / torch.linalg.matrix_norm(reference)).max().item()
            bound = BOUNDS[("bf16" if kernel.loop == "bf16" else "ieee", kind)]  # tf32 on a CPU runs as torch's 'high' does
            assert distance < bound, (str(kernel), kind, distance)


def test_symmetric_blocks_on_request_and_never_in_bf16() -> None:
    from optzoo.optimizers.newton_schulz import newton_schulz

    x = torch.randn(2, 24, 40)
    dense = newton_schulz(x, symmetric_blocks=False)
    # Blocks add one rounding per block product (float32 ulps), amplified by the iteration: 1e-5 slack.
    torch.testing.assert_close(newton_schulz(x, symmetric_blocks=True), dense, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"^`symmetric_blocks`: blocks round each block product once more, too coarse in bf16"):
        newton_schulz(x, matmul_precision="medium", loop_precision="bf16", symmetric_blocks=True)

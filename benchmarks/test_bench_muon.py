"""``benchmarks.bench_muon``'s comparison against ``torch.optim.Muon``: the pipeline, not the speed."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.optim import _muon as torch_muon_module

from benchmarks import bench_muon
from benchmarks._timing import RoundRobinTimes, round_robin

TORCH_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch/optim/_muon.py DEFAULT_A, B, C (Keller Jordan's)


def _table_rows(output: str) -> list[list[str]]:
    """The github-format table's body rows, split into stripped cells."""
    lines = [line for line in output.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]


def test_quick_comparison_has_every_candidate_on_both_models_with_finite_positive_numbers() -> None:
    measured = bench_muon.torch_comparison(bench_muon.QUICK, devices=("cpu",), repeats=1)
    expected = [
        "torch.optim.Muon, defaults", "torch.optim.Muon, fp32 (patched)", "emerging-optimizers Muon, defaults",
        'emerging-optimizers Muon, "highest"', "optzoo muon, defaults", 'optzoo muon, "highest"',
    ]  # fmt: skip
    pairs = [(model, label) for model in ("GPT blocks", "MoE experts") for label in expected]
    assert [(m.model, m.candidate.label) for m in measured] == pairs
    for m in measured:
        assert all(math.isfinite(v) and v > 0 for v in (m.median_s, m.first_s, m.vs_torch, m.fastest_vs_torch)), m
        if m.candidate.label == "torch.optim.Muon, defaults":
            assert m.vs_torch == m.fastest_vs_torch == 1.0
    rows = _table_rows(bench_muon.torch_table(measured))
    assert [(row[0], row[1]) for row in rows] == pairs
    assert all(len(row) == 7 and all(math.isfinite(float(cell)) for cell in row[3:]) for row in rows)


def test_header_names_the_cpu_its_bf16_flags_and_the_versions() -> None:
    header = bench_muon.machine_description(("cpu",))
    assert header.startswith("CPU: ") and "model name" not in header
    assert "avx512_bf16 " in header and "amx_bf16 " in header and f"{torch.get_num_threads()} torch threads" in header
    assert f"torch {torch.__version__}" in header and "emerging-optimizers 0.3.0" in header


def test_command_prints_the_header_the_table_and_the_notes(capsys: pytest.CaptureFixture[str]) -> None:
    bench_muon.main(["--quick", "--table", "torch", "--device", "cpu"])
    output = capsys.readouterr().out
    assert output.startswith("CPU: ")
    assert len(_table_rows(output)) == 2 * len(bench_muon.TORCH_CANDIDATES)
    assert "torch.optim.Muon has no setting for its Newton–Schulz precision" in output


def test_a_stack_steps_as_torch_muon_on_each_expert_alone() -> None:
    """The reference rows step a 3-D stack through 2-D views: the same as torch.optim.Muon (and
    AdamW) on separate copies of each expert, bit for bit."""
    model = bench_muon.build_model("MoE experts", bench_muon.QUICK, torch.device("cpu"))
    generator = torch.Generator().manual_seed(1)
    for param in model.parameters():
        assert param.grad is not None
        param.grad.copy_(torch.randn(param.shape, generator=generator))
    separate = {
        name: [nn.Parameter(m.detach().clone()) for m in (param if param.ndim == 3 else [param])]
        for name, param in model.named_parameters()
    }  # fmt: skip
    for name, param in model.named_parameters():
        assert param.grad is not None
        for copied, grad in zip(separate[name], param.grad if param.ndim == 3 else [param.grad], strict=True):
            copied.grad = grad.clone()
    matrices = [p for ps in separate.values() for p in ps if p.ndim == 2]
    vectors = [p for ps in separate.values() for p in ps if p.ndim == 1]
    muon = torch.optim.Muon(matrices, lr=bench_muon.LR)
    adamw = torch.optim.AdamW(vectors, lr=bench_muon.SCALAR_LR, weight_decay=0.0, fused=True)
    step = bench_muon.TORCH_CANDIDATES[0].build(model)
    for _ in range(2):
        step()
        muon.step()  # type: ignore[no-untyped-call]  # torch.optim.Muon is untyped
        adamw.step()
    for name, param in model.named_parameters():
        expected = torch.stack([p.detach() for p in separate[name]]) if param.ndim == 3 else separate[name][0].detach()
        assert torch.equal(param.detach(), expected), name


@pytest.mark.parametrize("model_name", list(bench_muon.MODELS))
def test_optzoo_at_highest_steps_every_matrix_as_emerging_optimizers_does(model_name: str) -> None:
    """Same defaults (momentum 0.95, no Nesterov, spectral scale, decay 0.01) at IEEE float32: after
    two steps every matrix, the expert stacks included (upstream: through per-expert views), is
    where emerging-optimizers' Muon puts it. So optzoo routes the stacks to Muon, not to Adam."""
    base = bench_muon.build_model(model_name, bench_muon.QUICK, torch.device("cpu"))
    generator = torch.Generator().manual_seed(3)
    grads = {name: torch.randn(param.shape, generator=generator) for name, param in base.named_parameters()}
    stepped = {}
    for label in ('emerging-optimizers Muon, "highest"', 'optzoo muon, "highest"'):
        model = bench_muon.with_zero_grads(copy.deepcopy(base))  # deepcopy drops a Parameter's grad
        candidate = next(c for c in bench_muon.TORCH_CANDIDATES if c.label == label)
        step = candidate.build(model)
        for scale in (1.0, 0.5):
            for name, param in model.named_parameters():
                assert param.grad is not None
                param.grad.copy_(grads[name] * scale)
            step()
        stepped[label] = dict(model.named_parameters())
    for name, param in base.named_parameters():
        if param.ndim >= 2:
            upstream, ours = (stepped[label][name] for label in stepped)
            assert not torch.equal(ours, param), name
            # float32 Newton–Schulz (Gram and dense loops) on updates of ~0.15: measured within 2.1e-7
            torch.testing.assert_close(ours, upstream, atol=1e-6, rtol=0, msg=name)


def _newton_schulz_float64(x: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Keller Jordan's quintic iteration (torch.optim.Muon's), in float64."""
    a, b, c = TORCH_COEFFICIENTS
    y: torch.Tensor = x.double().T if x.size(0) > x.size(1) else x.double()
    y = y / y.norm().clamp(min=eps)
    for _ in range(steps):
        gram = y @ y.T
        y = a * y + (b * gram + c * gram @ gram) @ y
    return y.T if x.size(0) > x.size(1) else y


@pytest.mark.parametrize("shape", [(33, 65), (65, 33), (64, 64)])
def test_fp32_patch_is_torchs_newton_schulz_without_the_bf16_cast(shape: tuple[int, int]) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    ours = bench_muon.torch_newton_schulz_fp32(x, TORCH_COEFFICIENTS, 5, 1e-7)
    torchs = torch_muon_module._zeropower_via_newtonschulz(x, TORCH_COEFFICIENTS, 5, 1e-7)
    assert ours.dtype == torch.float32 and torchs.dtype == torch.bfloat16
    # torch's bf16 loop: 5 iterations, each rounding to 2**-8 relative; its entries are <= ~0.5
    # here, and it lands within 1.4e-2 of float32 on these inputs.
    torch.testing.assert_close(ours, torchs.float(), atol=3e-2, rtol=0)
    # float32 products against float64: 1e-5 is ~100 float32 ulps at these magnitudes.
    torch.testing.assert_close(ours.double(), _newton_schulz_float64(x), atol=1e-5, rtol=0)
    assert torch.equal(x, torch.randn(shape, generator=torch.Generator().manual_seed(0)))  # input untouched


def test_fp32_row_leaves_torchs_newton_schulz_in_place() -> None:
    original = torch_muon_module._zeropower_via_newtonschulz
    model = bench_muon.build_model("GPT blocks", bench_muon.QUICK, torch.device("cpu"))
    reference = copy.deepcopy(model)
    step = bench_muon.TORCH_CANDIDATES[1].build(model)
    for param in model.parameters():
        assert param.grad is not None
        param.grad.normal_()
    step()
    assert torch_muon_module._zeropower_via_newtonschulz is original
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True))


def test_round_robin_times_the_first_call_apart_calls_before_untimed_and_rotates() -> None:
    calls: list[tuple[str, int] | str] = []
    steps = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    times = round_robin(steps, 2, before=lambda name, repeat: calls.append((name, repeat)), rotate=True)
    assert calls == [("a", -1), "a", ("b", -1), "b", ("a", 0), "a", ("b", 0), "b", ("b", 1), "b", ("a", 1), "a"]
    assert set(times.first) == set(times.median) == {"a", "b"} and all(len(t) == 2 for t in times.samples.values())


def test_median_ratio_is_taken_within_each_repeat() -> None:
    # b is twice a in every repeat while the load moves both: 2.
    times = RoundRobinTimes(first={"a": 1.0, "b": 1.0}, samples={"a": [1.0, 5.0, 3.0], "b": [2.0, 10.0, 6.0]})
    assert times.median_ratio("b", "a") == 2.0
    # per-repeat ratios 2, 0.3, 1.2 (median 1.2), where the medians' ratio is 3 / 5 (hand computed).
    times = RoundRobinTimes(first={"a": 1.0, "b": 1.0}, samples={"a": [1.0, 10.0, 5.0], "b": [2.0, 3.0, 6.0]})
    assert times.median_ratio("b", "a") == 1.2 and times.median["b"] / times.median["a"] == 3.0 / 5.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_cuda_without_a_gpu_is_a_one_line_refusal(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench_muon.main(["--quick", "--device", "cpu,cuda"])
    assert exit_info.value.code == 2
    assert "--device: 'cuda' asked for, but torch.cuda.is_available() is False here" in capsys.readouterr().err

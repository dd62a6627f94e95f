"""``python -m benchmarks.compare --quick`` runs the whole comparison suite and writes a complete report.

These tests check structure and exact byte counts, never timings.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks import compare
from benchmarks.bench_precision import _bytes_per_param
from optzoo.optimizers.newton_schulz import COEFFICIENT_SETS
from optzoo import OptimizerConfig, get_optimizer
from benchmarks.report import PLOTS

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, Path]:
    """One ``python -m benchmarks.compare --quick`` through its entry point: (exit status, stdout, out folder)."""
    out = tmp_path_factory.mktemp("bench")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):  # capsys is per test; this runs once for the module
        status = compare.main(["--quick", "--device", "cpu", "--out", str(out)])
    return status, stdout.getvalue(), out


@pytest.mark.slow
def test_quick_run_prints_every_section(quick_run: tuple[int, str, Path]) -> None:
    status, stdout, out = quick_run
    assert status == 0
    for title in ("1. Step time", "2. Newton–Schulz", "3. Memory", "4. Convergence"):
        assert title in stdout
    assert f"wrote {out / 'results.json'} and convergence_steps.png" in stdout


@pytest.mark.slow
def test_quick_run_writes_valid_pngs(quick_run: tuple[int, str, Path]) -> None:
    _, _, out = quick_run
    for name in PLOTS:
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC), name
        assert len(data) < 150_000, name


@pytest.mark.slow
def test_quick_run_json_structure(quick_run: tuple[int, str, Path]) -> None:
    _, _, out = quick_run
    results: dict[str, Any] = json.loads((out / "results.json").read_text())
    assert set(results) == {"environment", "plan", "step_time", "newton_schulz", "memory", "convergence", "section_s", "runtime_s", "plots"}
    assert results["plots"] == list(PLOTS)
    env = results["environment"]
    assert {"torch", "python", "cpu", "threads", "device", "device_name", "dtype", "date", "git_commit", "packages"} <= set(env)
    assert env["torch"] == torch.__version__ and env["device"] == "cpu" and env["dtype"] == "float32"

    models = [label for label, *_ in results["plan"]["models"]]
    steps = results["step_time"]
    assert [row["model"] for row in steps[:1]] == models[:1] and {row["model"] for row in steps} == set(models)
    names = {model: [row["candidate"] for row in steps if row["model"] == model] for model in models}
    assert names[models[0]][-2:] == ["optzoo soap", "emerging SOAP + AdamW"]  # SOAP: the smallest model only
    assert all("soap" not in name.lower() for model in models[1:] for name in names[model])
    for candidate in ("optzoo adam", "torch AdamW foreach", "optzoo muon", "emerging Muon + AdamW", "emerging Lion"):
        assert all(candidate in names[model] for model in models)
    for row in steps:
        assert row["median_ms"] > 0 and row["first_call_ms"] > 0 and row["vs_torch_adamw_foreach"] > 0
    assert all(row["vs_torch_adamw_foreach"] == 1.0 for row in steps if row["candidate"] == "torch AdamW foreach")

    ns = results["newton_schulz"]
    assert {row["shape"] for row in ns} == {"16×32", "2×16×16"}
    assert {row["coefficients"] for row in ns if row["shape"] == "16×32"} == {"-", *COEFFICIENT_SETS}
    assert all(row["gflop"] > 0 and math.isfinite(row["fraction_of_mm"]) for row in ns)

    memory = {(row["optimizer"], row["precision"]): row for row in results["memory"]}
    assert len(memory) == 2 * len(compare.OPTIMIZERS) + 4
    # Exact, from the tensors: Adam keeps two fp32 moments, SGD and Lion one buffer, bf16 adds an fp32 main copy.
    assert memory["adam", "fp32"]["state"] == 8.0 and memory["adam", "fp32"]["main_params"] == 0.0
    assert memory["sgd", "fp32"]["state"] == memory["lion", "fp32"]["state"] == 4.0
    assert memory["adam", "bf16, fp32 main params"]["main_params"] == 4.0
    assert memory["adam", "bf16 precision-aware, param remainders"]["main_params"] == 2.0
    assert memory["adam", "bf16 precision-aware, param remainders, bf16 moments"]["state_plus_main"] == 6.0
    assert memory["soap", "fp32"]["state"] > memory["adam", "fp32"]["state"]

    runs = results["convergence"]
    assert [run["optimizer"] for run in runs] == list(compare.OPTIMIZERS)
    for run in runs:
        assert len(run["train_loss"]) == len(run["elapsed_s"]) == results["plan"]["train_steps"]
        assert run["elapsed_s"] == sorted(run["elapsed_s"]) and math.isfinite(run["valid_loss"])


def test_state_bytes_split_sums_to_bench_precision_count() -> None:
    model = compare._model_with_grads(compare.QUICK.memory_model, torch.device("cpu"), torch.bfloat16)
    config = OptimizerConfig(lr=1e-3, bf16=True, use_precision_aware_optimizer=True, exp_avg_dtype=torch.bfloat16)
    opt = get_optimizer(config, model)
    opt.step()
    state, main = compare.state_bytes(opt, model)
    assert (state, main) == (6.0, 2.0)  # bf16 exp_avg + fp32 exp_avg_sq; int16 remainders
    assert state + main == _bytes_per_param(opt, model)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message for a machine without a GPU")
def test_cuda_without_a_gpu_is_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert compare.main(["--device", "cuda", "--quick"]) == 2
    assert capsys.readouterr().err == "benchmarks.compare: error: `--device`: unavailable; got 'cuda'; expected 'cpu'\n"

"""The examples train: ``examples/hf_trainer.py`` (transformers.Trainer),
``examples/lightning_example.py`` (Lightning's automatic optimization) and ``examples/hf_moe.py``
(a tiny Qwen3-MoE, its expert stacks on Muon), 3 steps on CPU each; and under ``torchrun`` with 2
gloo processes, ``examples/hf_trainer_distributed.py`` (Trainer + DDP + the layer-wise optimizer,
saving and resuming) and ``examples/accelerate_fsdp2.py`` (accelerate's FSDP2 prepare, an inf step skipped)."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_example(script: str) -> str:
    command = [sys.executable, f"examples/{script}", "--max-steps", "3"]
    done = subprocess.run(command, check=False, cwd=REPO_ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def logged_losses(out: str) -> dict[int, float]:
    return {int(step): float(loss) for step, loss in re.findall(r"^step (\d+): loss (\S+)", out, re.MULTILINE)}


@pytest.mark.parametrize("script", ["hf_trainer.py", "lightning_example.py", "hf_moe.py"])
def test_example_trains_three_steps_with_muon_and_adamw(script: str) -> None:
    out = run_example(script)
    groups = re.findall(r"^ *(muon|adam) lr=\S+ wd=\S+: \d+ params$", out, re.MULTILINE)
    assert groups[0] == "muon" and "adam" in groups, out
    losses = logged_losses(out)
    assert list(losses) == [1, 2, 3], out
    assert all(math.isfinite(loss) for loss in losses.values()), out
    assert abs(losses[1] - math.log(256)) < 0.5, out  # an untrained byte model: about uniform
    assert losses[3] < losses[1], out  # seeded: the optimizer did step
    assert re.search(r"^final loss \S+ after 3 steps$", out, re.MULTILINE), out


def test_the_moe_example_puts_every_expert_stack_on_muon() -> None:
    out = run_example("hf_moe.py")
    rows = re.findall(r"^(model\.layers\.\d\.mlp\.experts\.\w+) +(\d+x\d+x\d+) +(True|False)$", out, re.MULTILINE)
    assert [(name.rsplit(".", 1)[-1], shape, on_muon) for name, shape, on_muon in rows] == [
        ("gate_up_proj", "4x64x64", "True"), ("down_proj", "4x64x32", "True"),
        ("gate_up_proj", "4x64x64", "True"), ("down_proj", "4x64x32", "True"),
    ], out
    # Qwen3-MoE's forward, 2 layers: q/k/v/o, a router and two expert stacks per layer are matmul weights (14),
    # 9 RMSNorm gains (q_norm, k_norm and two layer norms per layer, and the final one)
    assert re.search(r"roles: elementwise 9, embedding 1, expert 4, matrix 14, norm 9, output 1, router 2$", out, re.MULTILINE), out


def run_with_torchrun(script: str, *args: str) -> str:
    """``torchrun --standalone --nproc-per-node 2 examples/<script> <args>``: 2 CPU processes on gloo."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", f"examples/{script}", *args]
    done = subprocess.run(command, check=False, cwd=REPO_ROOT, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_the_trainer_ddp_example_saves_on_rank_0_and_resumes_bit_for_bit() -> None:
    out = run_with_torchrun("hf_trainer_distributed.py", "--max-steps", "4")
    first, _, resumed = out.partition("-- resuming a fresh model from checkpoint-2")
    assert list(logged_losses(first)) == [1, 2, 3, 4], out
    assert logged_losses(resumed) == {step: loss for step, loss in logged_losses(first).items() if step > 2}, out
    assert re.search(r"^resumed run matches the uninterrupted run: params and optimizer state, bit for bit$", out, re.MULTILINE), out


def test_the_accelerate_fsdp2_example_skips_the_inf_step_and_reports_grad_norms() -> None:
    out = run_with_torchrun("accelerate_fsdp2.py", "--max-steps", "3", "--inf-at-step", "2")
    lines = re.findall(r"^step (\d): loss \S+ (.*)$", out, re.MULTILINE)
    assert [(step, text.split(" ")[0]) for step, text in lines] == [("1", "grad_norm"), ("2", "skipped"), ("3", "grad_norm")], out
    assert all(math.isfinite(float(text.split(" ")[1])) for step, text in lines if step != "2"), out

"""``examples/train_distributed.py`` runs under torchrun: 2 gloo ranks, DDP, layer-wise Muon."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_example_trains_on_two_ranks_and_saves_a_consolidated_checkpoint(tmp_path: Path) -> None:
    # --standalone: a free port for the rendezvous, so parallel runs cannot collide on 29500.
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "examples/train_distributed.py", "--steps", "3", "--save", str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, check=False, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout

    assert re.search(r"^GPT with 136,960 parameters on 2 rank\(s\), gloo backend, cpu;", out, re.MULTILINE), out
    losses = {int(step): float(loss) for step, loss in re.findall(r"^step +(\d+)  loss (\S+)", out, re.MULTILINE)}
    assert list(losses) == [1, 3], out  # the first and the last step
    assert all(math.isfinite(loss) for loss in losses.values())
    assert abs(losses[1] - math.log(256)) < 0.5  # an untrained byte model: about uniform over 256 bytes
    assert losses[3] < losses[1] - 0.1, out

    # Each param has one owner: the ranks' params and elements add up to the whole model.
    owned = [tuple(int(n.replace(",", "")) for n in row) for row in
             re.findall(r"^rank \d: owns (\d+) params \(([\d,]+) elements\), optimizer state ([\d,]+) bytes", out, re.MULTILINE)]  # fmt: skip
    assert len(owned) == 2, out
    assert sum(params for params, _, _ in owned) == 29
    assert sum(elements for _, elements, _ in owned) == 136960
    assert all(state > 0 for _, _, state in owned)

    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    assert checkpoint["step"] == 3
    assert set(checkpoint["optimizer"]["state"]) == set(checkpoint["model"])  # both ranks' state, merged

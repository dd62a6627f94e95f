"""Step time of this checkout against another git revision, measured side by side in one run.

Run: ``.venv/bin/python -m benchmarks.bench_revisions --against HEAD~3`` (any git revision). The
revision is checked out into a temporary worktree; one worker process per side
(:mod:`benchmarks._revision_worker`, the same script for both, with the side's checkout first on
``PYTHONPATH``) builds the candidates of ``bench_step`` and ``bench_muon`` plus the default
clipped fp32 and bf16 Adam paths. The driver then asks the two workers in turn, candidate by
candidate and repeat by repeat (alternating which side goes first), to time one step, so drift in
the machine's speed hits both sides alike; only one worker computes at a time. A refactor should
read ~1.00 in the last column, within the noise of the machine (about ±0.05 on a shared 2-core VM).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from tabulate import tabulate

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("_revision_worker.py")


class _Worker:
    def __init__(self, checkout: Path, sizes: list[int]) -> None:
        env = {**os.environ, "PYTHONPATH": str(checkout)}
        self.process = subprocess.Popen(
            [sys.executable, str(WORKER), *map(str, sizes)], cwd=checkout, env=env, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )  # fmt: skip
        ready = self._read()
        assert ready.startswith("ready "), ready
        self.names = ready.removeprefix("ready ").split("|")

    def _read(self) -> str:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"worker for {self.process.args} exited with {self.process.wait()}")
        return line.strip()

    def time(self, name: str) -> float:
        assert self.process.stdin is not None
        self.process.stdin.write(name + "\n")
        self.process.stdin.flush()
        return float(self._read())

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait(timeout=60)


@contextlib.contextmanager
def worktree(revision: str) -> Iterator[Path]:
    """``revision`` checked out in a temporary git worktree (removed afterwards)."""
    with tempfile.TemporaryDirectory(prefix="optzoo-rev-") as folder:
        path = Path(folder) / "checkout"
        subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(path), revision], cwd=ROOT, check=True)
        try:
            yield path
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT, check=False)


def compare(revision: str, *, repeats: int, sizes: list[int]) -> list[list[object]]:
    """``[candidate, before ms, after ms, after / before]`` medians, before being ``revision``."""
    with worktree(revision) as checkout:
        before, after = _Worker(checkout, sizes), _Worker(ROOT, sizes)
        try:
            names = [name for name in after.names if name in before.names]
            times: dict[tuple[str, str], list[float]] = {(side, name): [] for side in ("before", "after") for name in names}
            for repeat in range(repeats):
                for name in names:
                    order = [("before", before), ("after", after)]
                    for side, worker in order if repeat % 2 == 0 else order[::-1]:
                        times[(side, name)].append(worker.time(name))
        finally:
            before.close()
            after.close()
    median = {key: sorted(values)[len(values) // 2] for key, values in times.items()}
    return [[name, median[("before", name)] * 1e3, median[("after", name)] * 1e3, median[("after", name)] / median[("before", name)]] for name in names]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", required=True, help="the git revision to compare with (before)")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--hidden", type=int, default=512, help="bench_step's GPT (default 512 x 8 layers, 33.7M params)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--muon-hidden", type=int, default=1024, help="bench_muon's matrices (default 1024, ffn 4096, 2 layers)")
    parser.add_argument("--muon-ffn", type=int, default=4096)
    parser.add_argument("--muon-layers", type=int, default=2)
    args = parser.parse_args()
    sizes = [args.hidden, args.layers, args.muon_hidden, args.muon_ffn, args.muon_layers]
    rows = compare(args.against, repeats=args.repeats, sizes=sizes)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    print(f"before: {args.against}; after: this checkout ({head}, with any uncommitted changes); "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}; median of {args.repeats} alternating repeats")  # fmt: skip
    print(tabulate(rows, headers=["candidate", "before ms", "after ms", "after / before"], floatfmt=".3f"))


if __name__ == "__main__":
    main()

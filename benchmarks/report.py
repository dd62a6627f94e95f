"""The report of the comparison suite: environment record, tables and PNG plots of one run.

The suite itself (the measurements) is :mod:`benchmarks.compare`; this module only renders its
results dict, whose keys are ``environment``, ``plan``, ``step_time``,
``newton_schulz``, ``memory`` and ``convergence`` (lists of flat rows, one per measurement; see
that module), ``runtime_s`` and ``plots``. matplotlib is optional: ``pip install 'optzoo[bench]'``.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch
from tabulate import tabulate

Row = dict[str, Any]
PLOTS = ("convergence_steps.png", "convergence_time.png", "step_time.png", "newton_schulz.png")
"""The files :func:`write_plots` writes, in order."""


def _smooth(values: list[float], window: int = 10) -> list[float]:
    return [sum(values[max(0, i - window + 1) : i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(values))]


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], check=False, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: torch.device) -> Row:
    """Where and when the numbers were taken: versions, CPU or GPU name, threads, date, git commit."""
    versions: dict[str, str | None] = {}
    for package in ("emerging-optimizers", "numpy", "matplotlib", "tabulate"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    status = _git("status", "--porcelain")
    return {
        "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
        "cpu": _cpu_model(), "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(), "device": device.type,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_model(),
        "dtype": "float32", "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "git_commit": _git("rev-parse", "HEAD"), "git_dirty": None if status is None else bool(status), "packages": versions,
    }  # fmt: skip


def tables(results: Row) -> list[str]:
    """The four sections as tabulate tables."""
    steps, labels = results["step_time"], [label for label, *_ in results["plan"]["models"]]
    by_name: dict[str, dict[str, Row]] = {}
    for row in steps:
        by_name.setdefault(row["candidate"], {})[row["model"]] = row
    step_table = [
        [name, next(iter(cells.values()))["source"],
         *(f"{cells[m]['median_ms']:.2f} ({cells[m]['vs_torch_adamw_foreach']:.2f}x)" if m in cells else "-" for m in labels),
         f"{next(iter(cells.values()))['first_call_ms']:.0f}"]
        for name, cells in by_name.items()
    ]  # fmt: skip
    sizes = {row["model"]: row["params"] for row in steps}
    ns = [[r["shape"], r["implementation"], r["coefficients"], r["median_ms"], r["gflop"], r["gflops"], r["fraction_of_mm"], r["effective_gflops"]]
          for r in results["newton_schulz"]]  # fmt: skip
    mem = [[r["optimizer"], r["precision"], r["model_weights"], r["state"], r["main_params"], r["state_plus_main"], r["total_with_weights"]]
           for r in results["memory"]]  # fmt: skip
    conv = [
        [r["optimizer"], *(f"{r['settings'][k]:.3g}" if k in r["settings"] else "-" for k in ("lr", "decoupled_lr", "weight_decay")),
         *(f"{v:.3f}" for v in (sum(r["train_loss"][:10]) / len(r["train_loss"][:10]),
                                sum(r["train_loss"][-20:]) / len(r["train_loss"][-20:]), r["valid_loss"])),
         f"{r['ms_per_step']:.1f}", f"{r['elapsed_s'][-1]:.1f}"]
        for r in results["convergence"]
    ]  # fmt: skip
    plan = results["plan"]
    return [
        f"1. Step time: median ms (ratio to torch AdamW foreach); {', '.join(f'{m} = {sizes[m]:,} params' for m in labels)}; "
        f"SOAP on the first {plan['soap_models']} model(s) only\n"
        + tabulate(step_table, headers=["candidate", "source", *labels, "first call ms (1st model)"], floatfmt=".1f", disable_numparse=True),
        "2. Newton–Schulz, 5 steps, float32, IEEE matmuls (highest): counted GFLOP/s and fraction of torch.matmul's\n"
        + tabulate(ns, headers=["shape", "impl", "coefficients", "median ms", "GFLOP", "GFLOP/s", "of mm", "effective GFLOP/s"], floatfmt=".2f"),
        f"3. Memory after one step, bytes per model parameter ({plan['memory_params']:,}-param GPT)\n"
        + tabulate(mem, headers=["optimizer", "precision", "weights", "state", "main params", "state + main", "total"], floatfmt=".2f"),
        f"4. Convergence: {plan['train_params']:,}-param byte-level GPT, {plan['train_steps']} steps of {plan['batch_size']}x"
        f"{plan['train_seq_len']} bytes (nats/byte; uniform = 5.545)\n"
        + tabulate(conv, headers=["optimizer", "lr", "decoupled_lr", "wd", "train first 10", "train last 20", "valid", "ms/step", "total s"],
                   disable_numparse=True, colalign=("left",) + ("right",) * 8),
    ]  # fmt: skip


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as error:
        raise ImportError(
            "`benchmarks.compare`: the plots need matplotlib; got no module named 'matplotlib'; "
            "expected it installed: `pip install 'optzoo[bench]'` or `pip install matplotlib`"
        ) from error


def write_plots(results: Row, out: Path) -> list[Path]:
    """The four PNGs (matplotlib's Agg canvas, no pyplot state)."""
    from matplotlib.figure import Figure

    paths = [out / name for name in PLOTS]
    for path, key, xlabel in ((paths[0], None, "step"), (paths[1], "elapsed_s", "seconds (warm-up excluded)")):
        fig = Figure(figsize=(8, 5), dpi=100)
        ax = fig.add_subplot()
        for run in results["convergence"]:
            x = run[key] if key else list(range(1, len(run["train_loss"]) + 1))
            ax.plot(x, _smooth(run["train_loss"]), label=f"{run['optimizer']} (valid {run['valid_loss']:.3f})")
        ax.set(xlabel=xlabel, ylabel="train loss, nats/byte (10-step mean)", title=f"Convergence vs {xlabel.split()[0]}")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.savefig(path)

    labels = [label for label, *_ in results["plan"]["models"]]
    names = list(dict.fromkeys(r["candidate"] for r in results["step_time"]))
    fig = Figure(figsize=(9, 7), dpi=100)
    ax = fig.add_subplot()
    height = 0.8 / len(labels)
    for k, label in enumerate(labels):
        cells = {r["candidate"]: r["median_ms"] for r in results["step_time"] if r["model"] == label}
        ys = [i + k * height for i, name in enumerate(names) if name in cells]
        ax.barh(ys, [cells[name] for name in names if name in cells], height=height, label=label)
    ax.set_yticks([i + 0.4 - height / 2 for i in range(len(names))], names)
    ax.invert_yaxis()
    ax.set(xscale="log", xlabel="median step time, ms (log)", title="Optimizer step time by model size")
    ax.grid(axis="x", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(paths[2])

    ns = [r for r in results["newton_schulz"] if r["implementation"] != "torch.matmul (one step's products)"]
    series = [("ours", "quintic"), ("ours", "polar_express"), ("upstream", "quintic")]
    shapes = list(dict.fromkeys(r["shape"] for r in ns))
    fig = Figure(figsize=(9, 5), dpi=100)
    ax = fig.add_subplot()
    for k, (impl, coefficients) in enumerate(series):
        cells = {r["shape"]: r["fraction_of_mm"] for r in ns if (r["implementation"], r["coefficients"]) == (impl, coefficients)}
        ax.bar([i + k * 0.27 for i in range(len(shapes))], [cells.get(s, 0.0) for s in shapes], width=0.27, label=f"{impl} {coefficients}")
    ax.set_xticks([i + 0.27 for i in range(len(shapes))], shapes)
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set(ylabel="GFLOP/s as a fraction of torch.matmul's", title="Newton–Schulz throughput (5 steps, float32)", ylim=(0, 1.25))
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="upper center", ncols=3)
    fig.savefig(paths[3])
    return paths


def write_report(results: Row, out: Path) -> list[Path]:
    """``results.json`` and the plots in ``out``; returns their paths (the JSON last)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = write_plots(results, out)
    results["plots"] = [path.name for path in paths]
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    return [*paths, out / "results.json"]

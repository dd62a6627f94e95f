"""The report of ``benchmarks.compare``: environment record, markdown table, docs block and plot.

The measurements are :mod:`benchmarks.compare`'s; this module only renders its results dict
(``rows``, one per algorithm; ``tasks``; ``plan``; ``devices``; ``baselines``; ``command``;
``environment``; ``runtime_s``). matplotlib is optional: ``pip install 'optzoo[bench]'``.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import math
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

from optzoo.optimizers.newton_schulz_probe import cpu_name
from tabulate import tabulate

Row = dict[str, Any]
DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
"""The page whose marked block a full run rewrites."""
BEGIN = "<!-- benchmarks.compare:begin -->"
END = "<!-- benchmarks.compare:end -->"
GPU_COLUMNS = ("cuda",)
"""Devices that always get their columns, ``n/a`` where the run had no such device."""


def _smooth(values: list[float], window: int = 10) -> list[float]:
    return [sum(values[max(0, i - window + 1) : i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(values))]


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], check=False, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _cpu_model() -> str:
    return cpu_name()


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


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as error:
        raise ImportError(
            "`benchmarks.compare`: the plots need matplotlib; got no module named 'matplotlib'; "
            "expected it installed: `pip install 'optzoo[bench]'` or `pip install matplotlib`"
        ) from error




def lr_text(lr: float) -> str:
    """``3e-3`` for small lrs, ``0.3`` and ``1`` for the others."""
    if lr >= 0.01:
        return f"{lr:g}"
    mantissa, exponent = f"{lr:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def _seconds(value: float | str | None) -> str:
    if value is None:
        return "-"
    return "n/a" if isinstance(value, str) else f"{value:.2f}"


def _columns(results: Row) -> list[str]:
    """Devices in the table: the CPU, then every GPU column (``n/a`` when not measured)."""
    return ["cpu", *GPU_COLUMNS]


def _loss_cell(row: Row, label: str) -> str:
    task = row["tasks"].get(label)
    if task is None:
        return "-"
    if task["best_lr"] is None:
        statuses = {run["status"].split(":")[0] for run in task["runs"]}
        return " / ".join(sorted(statuses))
    best = next(run for run in task["runs"] if run["lr"] == task["best_lr"])
    return f"{best['valid']:.3f} @ {lr_text(best['lr'])}"


def table_rows(results: Row) -> tuple[list[str], list[list[str]]]:
    """The main table: headers and one row of strings per algorithm, in the run's order."""
    devices, labels = _columns(results), [task["label"] for task in results["tasks"]]
    baselines = results["baselines"]
    base = baselines.get("cpu", "AdamW(fused)")
    headers = [
        "algorithm", "family",
        *(f"step ×{baselines.get(d, base)} ({d})" for d in devices),
        *(f"first step s ({d}): optzoo / upstream" for d in devices),
        "state B/param: measured / record", "fallback (params, % of weights)",
        *(f"{label}: held-out loss @ lr" for label in labels),
    ]  # fmt: skip
    body = []
    for row in results["rows"]:
        if row["status"] != "ok":
            body.append([row["name"], row["family"], f"**{row['status']}**", *("-" for _ in headers[3:])])
            continue
        cells = [row["name"], row["family"]]
        for d in devices:
            ratio = row["step_ratio"].get(d)
            cells.append("n/a" if ratio is None or isinstance(ratio, str) else f"{ratio:.2f}")
        for d in devices:
            ours, theirs = row["first_step_s"].get(d, "n/a"), row["upstream_first_step_s"].get(d, "n/a")
            cells.append("n/a" if d not in results["devices"] else f"{_seconds(ours)} / {_seconds(theirs)}")
        measured, record = row.get("state_measured"), row.get("state_record")
        if measured is None:
            cells.append("-")
        else:
            same = math.isclose(measured, record, rel_tol=0, abs_tol=1e-9)
            cells.append(f"{measured:.2f} / {record:.2f}" if same else f"**{measured:.2f} ≠ {record:.2f}**")
        cells.append(row["fallback"])
        cells.extend(_loss_cell(row, label) for label in labels)
        body.append(cells)
    return headers, body


def sweep_rows(results: Row) -> list[list[str]]:
    """One row per (algorithm, task): every lr of the grid and its held-out loss, the winner in bold."""
    body = []
    for row in results["rows"]:
        for label, task in row["tasks"].items():
            points = []
            for run in task["runs"]:
                value = f"{run['valid']:.3f}" if run["status"] == "ok" else run["status"].split(":")[0]
                point = f"{lr_text(run['lr'])} → {value}"
                points.append(f"**{point}**" if run["lr"] == task["best_lr"] else point)
            body.append([row["name"], label, ", ".join(points)])
    return body


def _notes(results: Row) -> list[str]:
    """Why each refused, failed or n/a cell is so (the table keeps to one short word)."""
    notes = []
    for row in results["rows"]:
        if row["status"] != "ok":
            notes.append(f"- `{row['name']}`: {row['status']}")
        for kind, values in (("first step", row["first_step_s"]), ("upstream first step", row["upstream_first_step_s"])):
            for device, value in values.items():
                if isinstance(value, str):
                    notes.append(f"- `{row['name']}`, {kind} ({device}): {value}")
        for device, value in row["step_ratio"].items():
            if isinstance(value, str):
                notes.append(f"- `{row['name']}`, step time ({device}): {value}")
        for label, task in row["tasks"].items():
            for run in task["runs"]:
                if run["status"] not in ("ok", "diverged"):
                    notes.append(f"- `{row['name']}`, {label}, lr {lr_text(run['lr'])}: {run['status']}")
    return notes


def render_block(results: Row, *, plot_link: str) -> str:
    """The markdown the run writes between the docs markers: command, budget, tables, plot, notes."""
    env, plan = results["environment"], results["plan"]
    tasks = ", ".join(f"{t['label']} ({t['params']:,} params)" for t in results["tasks"])
    first = "each in a fresh process with an empty inductor cache" if plan["fresh_first_steps"] else "in this process (quick)"
    hidden, layers, seq = plan["timing_model"]
    minutes = results["runtime_s"] / 60
    headers, body = table_rows(results)
    lines = [
        "<!-- written by benchmarks.compare; a rerun replaces everything up to the end marker -->",
        "",
        f"Command: `{results['command']}` — {minutes:.1f} min on {env['device_name']} ({env['threads']} torch threads), "
        f"torch {env['torch']}, emerging-optimizers {env['packages'].get('emerging-optimizers')}, {env['date'][:10]}, "
        f"commit `{(env['git_commit'] or 'unknown')[:7]}`{' (uncommitted changes)' if env['git_dirty'] else ''}"
        f"{'; quick plan: numbers meaningless' if plan['quick'] else ''}.",
        "",
        f"Budget: **step time** on a {plan['timing_params']:,}-param GPT (hidden {hidden}, {layers} layers, seq {seq}; "
        f"fixed seeded grads, lr 1e-3, decay 0.1, no clipping), median of {plan['repeats']} interleaved rounds, "
        "as a ratio to torch AdamW on the same params in the same rounds. **First step**: lazy state and any "
        f"`torch.compile`, {first}; upstream = emerging-optimizers' class of the same registry name stepped directly "
        "on the params the record takes (`-`: upstream has no such name). **State**: bytes of every state tensor after "
        "the first step (fallback optimizers' included, fp32) per model param, next to the registry records' "
        f"`state_bytes`. **Loss**: held-out nats/byte (mean of {plan['valid_batches']} batches) after "
        f"{plan['steps']} steps of {plan['batch_size']}×{plan['seq_len']} bytes of the standard library's source, "
        f"on {results['train_device']}: {tasks}; same init and batches for every run; the best lr of the "
        "record family's grid (sweep below).",
        "",
        tabulate(body, headers=headers, tablefmt="github", disable_numparse=True),
        "",
        "lr sweep (held-out loss per lr; bold: the one in the table):",
        "",
        tabulate(sweep_rows(results), headers=["algorithm", "task", "lr → held-out loss"], tablefmt="github", disable_numparse=True),
        "",
        f"![Training loss per algorithm at its best lr, and step time]({plot_link})",
        "",
    ]  # fmt: skip
    took = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in results.get("phase_s", {}).items())
    slowest = sorted(((sum(row.get("train_s", {}).values()), row["name"]) for row in results["rows"]), reverse=True)[:3]
    lines += [f"Time per phase: {took}; the slowest to train (every lr and task): "
              + ", ".join(f"{name} {seconds:.0f} s" for seconds, name in slowest) + ".", ""]  # fmt: skip
    notes = _notes(results)
    if notes:
        lines += ["Refusals and n/a cells:", "", *notes, ""]
    return "\n".join(lines)


def check_markers(path: Path) -> str:
    """``path``'s text; raises ``ValueError`` unless it holds one :data:`BEGIN` line before one :data:`END` line."""
    text = path.read_text()
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"`{path}`: no single marked block; got {text.count(BEGIN)} begin and {text.count(END)} end markers; "
                         f"expected one {BEGIN!r} line before one {END!r} line")  # fmt: skip
    return text


def write_docs(path: Path, block: str) -> None:
    """Replace what lies between :data:`BEGIN` and :data:`END` in ``path`` with ``block``."""
    before, rest = check_markers(path).split(BEGIN)
    _, after = rest.split(END)
    path.write_text(f"{before}{BEGIN}\n{block.strip()}\n{END}{after}")


def write_plot(results: Row, path: Path) -> None:
    """Train loss against step (each algorithm at its best lr, per task) and the step-time ratios."""
    from matplotlib.figure import Figure

    labels = [task["label"] for task in results["tasks"]]
    fig = Figure(figsize=(6 * (len(labels) + 1), 6), dpi=90)
    axes = fig.subplots(1, len(labels) + 1)
    colors = [f"C{i}" for i in range(10)]
    for ax, label in zip(axes, labels):
        for index, row in enumerate(results["rows"]):
            task = row["tasks"].get(label)
            if task is None or task["best_lr"] is None:
                continue
            run = next(r for r in task["runs"] if r["lr"] == task["best_lr"])
            style = "-" if index < 10 else "--"
            ax.plot(range(1, len(run["curve"]) + 1), _smooth(run["curve"]), style, color=colors[index % 10],
                    label=f"{row['name']} @ {lr_text(run['lr'])} ({run['valid']:.3f})")  # fmt: skip
        ax.set(xlabel="step", ylabel="train loss, nats/byte (10-step mean)", title=label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ratios = [(row["name"], row["step_ratio"].get("cpu")) for row in results["rows"]]
    measured = [(name, r) for name, r in ratios if isinstance(r, float)]
    ax = axes[-1]
    ax.barh([name for name, _ in measured], [r for _, r in measured], color="C0")
    ax.axvline(1.0, color="gray", linewidth=0.8)
    ax.invert_yaxis()
    ax.set(xscale="log", xlabel=f"step time / {results['baselines'].get('cpu', 'AdamW')} (cpu, log)", title="Step time")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)

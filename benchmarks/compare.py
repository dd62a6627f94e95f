"""One table and one plot for every registered optimizer, from one command.

Run from a source checkout (the wheel does not ship ``benchmarks/``)::

    .venv/bin/python -m benchmarks.compare            # every registered name; rewrites docs/benchmarks.md's table
    .venv/bin/python -m benchmarks.compare --quick --only adam,muon --out /tmp/cmp   # seconds: checks the pipeline

The names come from :func:`optzoo.optimizers.registry.registered_names` at run time, so an
algorithm registered later gets its row with no change here. For each name, side by side in one
process:

- **step time** as a ratio to ``torch.optim.AdamW(fused=True)`` (foreach where fused is not
  supported), every candidate stepping its own copy of one GPT with fixed seeded gradients, in
  interleaved rounds (:func:`benchmarks._timing.round_robin_medians`): medians, ratios only;
- **optimizer state bytes per model parameter**: measured from the real state after the first
  step, next to the registry record's ``state_bytes`` fact;
- **first-step seconds** (lazy state and any ``torch.compile``), and where emerging-optimizers'
  registry holds the same name, that upstream class stepped directly on the params the record
  takes: the "before" of optzoo's "after". Full runs time each in a fresh process with an empty
  inductor cache (a user's first run); ``--quick`` times them in this process;
- **held-out loss** after the training budget on the built-in task (:mod:`optzoo.demo`'s GPT on
  the standard library's bytes) and on a tiny Hugging Face Llama (random init, same bytes), same
  init and same batches for every run, at the best of a 3-point lr sweep per algorithm (the grid
  comes from the record's ``family``).

A name whose optimizer cannot be built on a model (the record or the class raises) gets the row
``refused: <first line of the message>`` and the run goes on; so does a step that raises
(``failed: ...``). Params a record hands to its fallback optimizer are counted in the
``fallback`` column. With a GPU (``--device auto``, the default, or ``cuda``) the step and
first-step columns are measured on it too and training runs on it; on a CPU those columns read
``n/a``. Outputs: ``results.json`` and ``compare.png`` in ``--out``; a full run also rewrites the
table between the markers of ``docs/benchmarks.md`` and its plot ``docs/img/compare.png``
(``--docs FILE`` elsewhere, ``--no-docs`` not at all).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from benchmarks._timing import round_robin_medians
from benchmarks.report import DOCS, check_markers, environment, render_block, require_matplotlib, write_docs, write_plot
from optzoo import OptimizerConfig, get_optimizer, resolve_group_configs
from optzoo.demo import stdlib_bytes
from optzoo.models import GPT, GPTConfig
from optzoo.optimizers import _emerging
from optzoo.optimizers.registry import OptimizerSpec, fused_supported, get_spec, registered_names

Row = dict[str, Any]
DEFAULT_OUT = Path(__file__).resolve().parent / "results"

LR_GRIDS: dict[str, tuple[float, ...]] = {
    "adam": (1e-3, 3e-3, 1e-2),
    "sgd": (0.1, 0.3, 1.0),
    "sign": (1e-4, 3e-4, 1e-3),
    "orthogonalized": (3e-4, 3e-3, 3e-2),
    "preconditioned": (1e-3, 3e-3, 1e-2),
}
"""lr sweep per record ``family``: 3 points around where that lineage trained best on this task in
the former suite's 3-5-point sweeps (Adam 3e-3, SGD 1.0, Lion 1e-3, Muon 3e-3, AdaptiveMuon 1e-4,
SOAP 1e-2). The orthogonalised grid spans two decades because its members disagree by 30x."""
DEFAULT_LR_GRID = (1e-4, 1e-3, 1e-2)
"""For a family not listed above."""
FALLBACK_DECOUPLED_LR = 1e-3
"""Embeddings and the output layer of a record with a fallback optimizer go to it (AdamW by
default) at the demo's ``decoupled_lr``; a record without one steps them itself at ``lr / 3``
(the demo's ratio, 3e-3 to 1e-3)."""


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Sizes and repeats of one run (``FULL`` or ``QUICK``)."""

    timing_model: GPTConfig
    """Where step time, state bytes and first steps are measured."""
    repeats: int
    """Interleaved rounds of step timing."""
    gpt: GPTConfig
    """The built-in task's model: the demo's GPT (byte-level)."""
    llama: dict[str, Any]
    """``transformers.LlamaConfig`` arguments of the tiny Llama (byte vocabulary)."""
    steps: int
    """Training steps per run (the budget)."""
    batch_size: int
    seq_len: int
    valid_batches: int
    data_bytes: int = 4_000_000
    """Bytes of the standard library's source (``optzoo.demo.stdlib_bytes``); the last 10% held out."""
    lr_points: int = 3
    """How many points of each grid are swept (1: the middle one)."""
    fresh_first_steps: bool = True
    """Time first steps in fresh processes with an empty inductor cache."""


def _gpt(hidden: int, layers: int, heads: int, seq: int) -> GPTConfig:
    return GPTConfig(hidden_size=hidden, num_layers=layers, num_heads=heads, vocab_size=256, max_seq_len=seq)


def _llama(hidden: int, layers: int, heads: int, seq: int) -> dict[str, Any]:
    return {
        "vocab_size": 256, "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": heads // 2, "max_position_embeddings": seq,
        "tie_word_embeddings": False,
    }  # fmt: skip


FULL = Plan(
    timing_model=_gpt(128, 4, 4, 128), repeats=7, gpt=_gpt(128, 2, 4, 64), llama=_llama(64, 2, 4, 64),
    steps=100, batch_size=8, seq_len=64, valid_batches=8,
)  # fmt: skip
"""Sized for about 10 minutes on 2 quiet CPU cores for ~19 names (an estimate from per-step costs; the
block records each run's real time per phase): the demo's model at half its sequence length, 100
steps of 8 sequences (the demo: 120 of 16×128), so 6 training runs per name stay a few seconds each
for the element-wise algorithms (SOAP-like ones, with an eigendecomposition per matrix per step, take
about a minute). ``--steps`` trims it."""
QUICK = Plan(
    timing_model=_gpt(16, 1, 2, 16), repeats=1, gpt=_gpt(16, 1, 2, 16), llama=_llama(16, 1, 2, 16),
    steps=3, batch_size=2, seq_len=16, valid_batches=1, data_bytes=50_000, lr_points=1, fresh_first_steps=False,
)  # fmt: skip


def lr_grid(spec: OptimizerSpec, points: int) -> tuple[float, ...]:
    """The lrs swept for ``spec``: its family's grid, or its middle point when ``points`` is 1."""
    grid = LR_GRIDS.get(spec.family, DEFAULT_LR_GRID)
    return grid if points >= len(grid) else (grid[len(grid) // 2],)


def _config(spec: OptimizerSpec, lr: float, device: torch.device) -> OptimizerConfig:
    decoupled = FALLBACK_DECOUPLED_LR if spec.fallback_field else lr / 3
    # bf16 Newton–Schulz is slower than float32 on CPUs (docs/optimizers.md); a GPU gains from it.
    precision = "highest" if device.type == "cpu" else "medium"
    return OptimizerConfig(optimizer=spec.name, lr=lr, decoupled_lr=decoupled, weight_decay=0.1, muon_fp32_matmul_prec=precision)


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


class _Progress:
    def __init__(self, bar: tqdm[Any]) -> None:
        self.bar = bar

    def add(self, units: int, what: str) -> None:
        self.bar.total = (self.bar.total or 0) + units
        self.bar.set_description(what)
        self.bar.refresh()

    def tick(self, units: int = 1) -> None:
        self.bar.update(units)


# --- step time, state bytes, first steps -----------------------------------------------------------


def _with_grads(config: GPTConfig, device: torch.device) -> GPT:
    torch.manual_seed(0)
    return _seeded_grads(GPT(config).to(device))


def _seeded_grads(model: GPT) -> GPT:
    """The same gradients on every copy (``copy.deepcopy`` does not copy ``.grad``)."""
    generator = torch.Generator().manual_seed(1)
    for param in model.parameters():
        param.grad = (torch.randn(param.shape, generator=generator) * 1e-3).to(param.device)
    return model


def _timed_step(step: Callable[[], object], device: torch.device) -> float:
    started = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def state_bytes_per_param(optimizer: torch.optim.Optimizer, model: torch.nn.Module, config: OptimizerConfig) -> tuple[float, float]:
    """(measured, record) optimizer state bytes per model param: the tensors in the state after a
    step, and the sum of each param's record ``state_bytes`` under the routing ``get_optimizer`` used."""
    count = sum(p.numel() for p in model.parameters())
    state = optimizer.state_dict()["state"]
    measured = sum(t.nbytes for s in state.values() for v in s.values() for t in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(t, torch.Tensor))  # PSGD keeps lists
    groups, _ = resolve_group_configs(config, model)
    record = 0
    for group in groups:
        spec = get_spec(group.config.optimizer)
        fields = {name: getattr(group.config, name) for name in spec.config_fields}
        record += sum(spec.state_bytes(tuple(r.param.shape), fields, torch.float32) for r in group.params)
    return measured / count, record / count


def fallback_share(spec: OptimizerSpec, model: torch.nn.Module, config: OptimizerConfig) -> str:
    """Which params the routing hands to other optimizers than ``spec``'s: ``"adam: 5/13 (12%)"``."""
    groups, _ = resolve_group_configs(config, model)
    total = sum(p.numel() for p in model.parameters())
    others: dict[str, list[int]] = {}
    for group in groups:
        if group.config.optimizer != spec.name:
            sizes = others.setdefault(group.config.optimizer, [0, 0])
            sizes[0] += len(group.params)
            sizes[1] += sum(r.param.numel() for r in group.params)
    count = len(list(model.parameters()))
    return ", ".join(f"{name}: {n}/{count} params ({100 * numel / total:.0f}%)" for name, (n, numel) in others.items()) or "-"


def _upstream_optimizer(spec: OptimizerSpec, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer | None:
    """emerging-optimizers' class of the same registry name, as upstream ships it, over the groups
    ``optimizer`` (optzoo's, not stepped) gives ``spec``; ``None`` when upstream has no such name."""
    import inspect

    cls = _emerging.upstream_registered_class(spec.name)
    if cls is None:
        return None
    inner = [g for opt in optimizer.optimizers for g in opt.param_groups if g.get("optimizer") == spec.name]  # type: ignore[attr-defined]
    groups = [{k: v for k, v in g.items() if k not in ("param_names", "matrix_views")} for g in inner]
    accepted = inspect.signature(cls).parameters
    options = {k: v for k, v in groups[0].items() if k in accepted and k != "params"}
    return cls(groups, **options)


def first_step_seconds(name: str, device: torch.device, plan: Plan, *, upstream: bool) -> float | str | None:
    """Seconds of the first step of ``name`` (``upstream``: of emerging-optimizers' class of that
    name) on ``plan``'s timing model; a string says why it could not run, ``None``: no upstream class."""
    spec = get_spec(name)
    model = _with_grads(plan.timing_model, device)
    try:
        optimizer = get_optimizer(_config(spec, 1e-3, device), model)
        if upstream:
            optimizer = _upstream_optimizer(spec, optimizer)  # type: ignore[assignment]
            if optimizer is None:
                return None
        return _timed_step(optimizer.step, device)
    except Exception as error:  # noqa: BLE001  # a row, not a crash: the reason goes in the table
        return f"n/a: {_first_line(error)}"


def _fresh_first_steps(name: str, device: torch.device) -> tuple[float | str | None, float | str | None]:
    """(optzoo, upstream) :func:`first_step_seconds` in one new process with an empty inductor
    cache, a user's first run. optzoo's goes first: where both use one compiled kernel (on a GPU),
    upstream's may then find it compiled, which favours "before", never "after"."""
    argv = [sys.executable, "-m", "benchmarks.compare", "--first-step", name, "--device", device.type]
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        done = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    try:
        result = json.loads(done.stdout.strip().splitlines()[-1])
        return result["optzoo"], result["upstream"]
    except (IndexError, ValueError, KeyError):
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        failed = f"n/a: worker exited {done.returncode}: {tail}"
        return failed, failed


def measure_steps(rows: dict[str, Row], plan: Plan, device: torch.device, progress: _Progress) -> str:
    """Step-time ratios to AdamW(fused) on ``device`` (and on the first device, state bytes and
    fallbacks) into ``rows``; a name that cannot be built is marked refused. Returns the baseline's name."""
    base = _with_grads(plan.timing_model, device)
    kernel = "fused" if fused_supported(list(base.parameters())) else "foreach"
    adamw_model = _seeded_grads(copy.deepcopy(base))
    adamw = torch.optim.AdamW(adamw_model.parameters(), lr=1e-3, weight_decay=0.1, **{kernel: True})  # type: ignore[arg-type]
    baseline_name = f"AdamW({kernel})"
    steps: dict[str, Callable[[], object]] = {baseline_name: adamw.step}
    progress.add(len(rows) * (plan.repeats + 2), f"step time ({device.type})")
    for name, row in rows.items():
        if row["status"] != "ok":
            progress.tick(plan.repeats + 2)
            continue
        spec, model = get_spec(name), _seeded_grads(copy.deepcopy(base))
        try:
            config = _config(spec, 1e-3, device)
            optimizer = get_optimizer(config, model)
        except Exception as error:  # noqa: BLE001  # a row, not a crash
            row["status"] = f"refused: {_first_line(error)}"
            progress.tick(plan.repeats + 2)
            continue
        try:
            first = _timed_step(optimizer.step, device)
        except Exception as error:  # noqa: BLE001
            row["status"] = f"failed: first step: {_first_line(error)}"
            progress.tick(plan.repeats + 2)
            continue
        if not plan.fresh_first_steps:
            row["first_step_s"][device.type] = first
            row["upstream_first_step_s"][device.type] = first_step_seconds(name, device, plan, upstream=True)
        if "state_measured" not in row:
            row["state_measured"], row["state_record"] = state_bytes_per_param(optimizer, model, config)
            row["fallback"] = fallback_share(spec, model, config)
        steps[name] = _ticking(optimizer.step, progress)
        progress.tick(2)
    row_names = [n for n in steps if n in rows]
    try:
        medians = round_robin_medians(steps, plan.repeats)
    except Exception as error:  # noqa: BLE001  # rare: a step that raises after its first one
        for name in row_names:
            rows[name]["step_ratio"][device.type] = f"n/a: {_first_line(error)}"
        return baseline_name
    baseline = medians.pop(baseline_name)
    for name in row_names:
        rows[name]["step_ratio"][device.type] = medians[name] / baseline
    return baseline_name


def _ticking(step: Callable[[], object], progress: _Progress) -> Callable[[], object]:
    def stepped() -> object:
        result = step()
        progress.tick()
        return result

    return stepped


# --- training --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Task:
    """A model (same init every run) and its loss on a batch of byte sequences."""

    label: str
    build: Callable[[], torch.nn.Module]
    loss: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]


def _llama_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))


def tasks(plan: Plan) -> list[Task]:
    """The built-in task (the demo's GPT) and the tiny Llama."""
    import transformers

    def gpt() -> torch.nn.Module:
        torch.manual_seed(0)
        return GPT(plan.gpt)

    def llama() -> torch.nn.Module:
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**plan.llama))

    return [
        Task("GPT (built-in task)", gpt, lambda m, b: m.loss(b)),  # type: ignore[operator]
        Task("Llama (HF, tiny)", llama, _llama_loss),
    ]


def _batches(source: torch.Tensor, plan: Plan, count: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(len(source) - plan.seq_len - 1, (count, plan.batch_size), generator=generator)
    return [torch.stack([source[s : s + plan.seq_len + 1] for s in row.tolist()]) for row in starts]


def train_one(spec: OptimizerSpec, lr: float, task: Task, init: torch.nn.Module, data: tuple[list[torch.Tensor], list[torch.Tensor]],
              device: torch.device, progress: _Progress) -> Row:  # fmt: skip
    """One run: ``{"valid": held-out loss or nan, "curve": train losses, "status"}``."""
    train, valid = data
    model = copy.deepcopy(init)
    try:
        optimizer = get_optimizer(_config(spec, lr, device), model)
    except Exception as error:  # noqa: BLE001  # a cell, not a crash
        progress.tick(len(train))
        return {"lr": lr, "valid": math.nan, "curve": [], "status": f"refused: {_first_line(error)}"}
    curve: list[float] = []
    status = "ok"
    for index, batch in enumerate(train):
        try:
            loss = task.loss(model, batch.to(device))
            optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
        except Exception as error:  # noqa: BLE001
            status = f"failed: step {index + 1}: {_first_line(error)}"
            break
        curve.append(loss.item())
        progress.tick()
        if not math.isfinite(curve[-1]):
            status = "diverged"
            break
    progress.tick(len(train) - len(curve))
    if status != "ok":
        return {"lr": lr, "valid": math.nan, "curve": curve, "status": status}
    with torch.no_grad():
        held_out = sum(task.loss(model, b.to(device)).item() for b in valid) / len(valid)
    return {"lr": lr, "valid": held_out if math.isfinite(held_out) else math.nan, "curve": curve,
            "status": "ok" if math.isfinite(held_out) else "diverged"}  # fmt: skip


def measure_training(rows: dict[str, Row], plan: Plan, device: torch.device, progress: _Progress) -> list[Row]:
    """Every ok row's sweep on every task, into ``row["tasks"][label]``; returns the tasks' facts."""
    data = stdlib_bytes(plan.data_bytes)
    split = int(0.9 * len(data))
    batches = (_batches(data[:split], plan, plan.steps, 0), _batches(data[split:], plan, plan.valid_batches, 1))
    facts = []
    for task in tasks(plan):
        init = task.build().to(device)
        facts.append({"label": task.label, "params": sum(p.numel() for p in init.parameters())})
        for name, row in rows.items():
            spec = get_spec(name)
            grid = lr_grid(spec, plan.lr_points)
            progress.add(len(grid) * plan.steps, f"{task.label}: {name}")
            if row["status"] != "ok":
                progress.tick(len(grid) * plan.steps)
                continue
            started = time.perf_counter()
            runs = [train_one(spec, lr, task, init, batches, device, progress) for lr in grid]
            row["train_s"][task.label] = time.perf_counter() - started
            finite = [run for run in runs if math.isfinite(run["valid"])]
            best = min(finite, key=lambda run: run["valid"]) if finite else None
            row["tasks"][task.label] = {"grid": list(grid), "runs": runs, "best_lr": best["lr"] if best else None}
    return facts


# --- the run ---------------------------------------------------------------------------------------


def _devices(choice: str) -> list[torch.device]:
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("`--device`: unavailable; got 'cuda'; expected 'cpu' or 'auto' (no GPU here)")
    gpu = choice in ("cuda", "auto") and torch.cuda.is_available()
    return [torch.device("cpu"), *([torch.device("cuda")] if gpu else [])]


def _names(only: str | None) -> list[str]:
    names = registered_names()
    if only is None:
        return names
    wanted = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in names]
    if unknown or not wanted:
        raise ValueError(f"`--only`: unknown optimizer names; got {unknown or only!r}; expected a comma-separated subset of {names}")
    return wanted


def run(*, names: list[str], devices: list[torch.device], plan: Plan, quick: bool, progress: bool = True) -> Row:
    """Measure every name; returns the results (``rows`` in ``names``' order, ``plan``, ``tasks``)."""
    started = time.perf_counter()
    rows: dict[str, Row] = {}
    baselines: dict[str, str] = {}
    phases: dict[str, float] = {}
    for name in names:
        spec = get_spec(name)
        rows[name] = {"name": name, "family": spec.family, "source": spec.source, "status": "ok", "step_ratio": {},
                      "first_step_s": {}, "upstream_first_step_s": {}, "tasks": {}, "train_s": {}, "fallback": "-",
                      "lr_grid": list(lr_grid(spec, plan.lr_points))}  # fmt: skip
    with tqdm(total=0, disable=not progress, unit="step", dynamic_ncols=True) as bar:
        tracker = _Progress(bar)
        for device in devices:
            phase = time.perf_counter()
            baselines[device.type] = measure_steps(rows, plan, device, tracker)
            phases[f"step time ({device.type})"] = time.perf_counter() - phase
            if plan.fresh_first_steps:
                phase = time.perf_counter()
                tracker.add(len(rows), f"first steps ({device.type})")
                for name, row in rows.items():
                    if row["status"] == "ok":
                        row["first_step_s"][device.type], row["upstream_first_step_s"][device.type] = _fresh_first_steps(name, device)
                    tracker.tick()
                phases[f"first steps ({device.type})"] = time.perf_counter() - phase
        phase = time.perf_counter()
        task_facts = measure_training(rows, plan, devices[-1], tracker)
        phases["training"] = time.perf_counter() - phase
    return {
        "rows": list(rows.values()), "tasks": task_facts, "devices": [d.type for d in devices], "baselines": baselines, "train_device": devices[-1].type,
        "plan": {"quick": quick, "timing_params": sum(p.numel() for p in GPT(plan.timing_model).parameters()),
                 "timing_model": [plan.timing_model.hidden_size, plan.timing_model.num_layers, plan.timing_model.max_seq_len],
                 "repeats": plan.repeats, "steps": plan.steps, "batch_size": plan.batch_size, "seq_len": plan.seq_len,
                 "valid_batches": plan.valid_batches, "lr_points": plan.lr_points, "fresh_first_steps": plan.fresh_first_steps},
        "phase_s": phases, "runtime_s": time.perf_counter() - started,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit status (2 with a one-line error)."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compare", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: the CPU, and the GPU when there is one")
    parser.add_argument("--only", help="comma-separated registered names (default: every one)")
    parser.add_argument("--quick", action="store_true", help="toy sizes, one lr, 3 steps: the whole pipeline in seconds")
    parser.add_argument("--steps", type=int, help="training steps per run (default: the plan's, 100; --quick: 3)")
    parser.add_argument("--out", help=f"folder for results.json and compare.png (default {DEFAULT_OUT})")
    parser.add_argument("--docs", help=f"markdown file whose marked block gets the table (default: {DOCS} for a full run of every name)")
    parser.add_argument("--no-docs", action="store_true", help="write no markdown file")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--first-step", help=argparse.SUPPRESS)  # the fresh-process worker of _fresh_first_step
    args = parser.parse_args(argv)
    try:
        devices = _devices(args.device)
        if args.first_step:
            device = devices[-1] if args.device != "cpu" else devices[0]
            ours = first_step_seconds(args.first_step, device, FULL, upstream=False)
            print(json.dumps({"optzoo": ours, "upstream": first_step_seconds(args.first_step, device, FULL, upstream=True)}))
            return 0
        names = _names(args.only)
        require_matplotlib()
        plan = QUICK if args.quick else FULL
        if args.steps is not None:
            if args.steps < 1:
                raise ValueError(f"`--steps`: must be positive; got {args.steps}; expected an integer >= 1")
            plan = dataclasses.replace(plan, steps=args.steps)
        docs = None if args.no_docs else Path(args.docs) if args.docs else (DOCS if not args.quick and args.only is None else None)
        if docs is not None:
            check_markers(docs)  # before the run, not after ten minutes of it
        results = run(names=names, devices=devices, plan=plan, quick=args.quick, progress=not args.no_progress)
    except (ValueError, ImportError, OSError) as error:
        print(f"benchmarks.compare: error: {str(error).splitlines()[0]}", file=sys.stderr)
        return 2
    results["command"] = " ".join(["python -m benchmarks.compare", *argv])
    results["environment"] = environment(devices[-1])
    out = Path(args.out) if args.out else DEFAULT_OUT
    out.mkdir(parents=True, exist_ok=True)
    plot = (docs.parent / "img" / "compare.png") if docs is not None else out / "compare.png"
    write_plot(results, plot)
    block = render_block(results, plot_link=os.path.relpath(plot, docs.parent) if docs is not None else plot.name)
    (out / "table.md").write_text(block)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    if docs is not None:
        write_docs(docs, block)
    print(block)
    print(f"wrote {out / 'results.json'}, {out / 'table.md'}, {plot}" + (f" and {docs}" if docs else "") + f"; {results['runtime_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

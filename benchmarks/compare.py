"""The comparison suite: step time, Newton–Schulz throughput, memory and convergence in one run.

Run: ``.venv/bin/python -m benchmarks.compare [--device cpu|cuda] [--out DIR] [--quick]`` from a
source checkout (the installed package does not ship the benchmarks). It prints one table per section,
writes ``results.json`` (the environment and every number) and four PNG plots to ``--out``
(default ``benchmarks/results/``). The full run takes about 4 minutes on a quiet 2-core CPU;
``--quick`` runs the same pipeline on toy sizes in seconds (the test uses it).

1. Step time: every optimizer through ``get_optimizer`` with its realistic routing (the standard
   overrides; Muon, AdaptiveMuon and SOAP hand embeddings, the output layer and 1-D params to
   Adam), beside torch's AdamW (foreach, fused), ``torch.optim.Muon`` (torch >= 2.9; 2-D params
   only, Newton–Schulz always in bf16) + fused AdamW for the rest, and emerging-optimizers'
   classes driven directly (Muon, AdaptiveMuon and SOAP over the same matrices + fused AdamW for
   the rest; Lion over everything). Gradients come from a seeded generator (no backward). Each
   candidate's first call (lazy state, emerging-optimizers' ``torch.compile``) is timed apart and
   kept out of the medians, which are round-robin (:func:`benchmarks._timing.round_robin_medians`).
   SOAP (upstream refreshes its eigenbasis every step: ~50x AdamW's step even at 0.9M params on a
   2-core CPU) runs on the smallest model only.
2. Newton–Schulz: GFLOP/s (counted by ``FlopCounterMode``) and fraction of plain ``torch.matmul``
   throughput on the same shapes (helpers of :mod:`benchmarks.bench_newton_schulz`).
3. Memory: optimizer state and main (master) params in bytes per model parameter, from the
   actual tensors after one step (as :mod:`benchmarks.bench_precision` counts them).
4. Convergence: a byte-level GPT trained on the standard library's source (:mod:`optzoo.demo`'s
   data) by each optimizer from the same init on the same batches, loss against steps and seconds,
   and a held-out loss at the end. Learning rates: :data:`TRAIN_RUNS`.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from benchmarks import bench_newton_schulz as ns_bench
from benchmarks._timing import round_robin_medians
from benchmarks.report import environment, require_matplotlib, tables, write_report
from optzoo import OptimizerConfig, get_optimizer
from optzoo.demo import stdlib_bytes
from optzoo.models import GPT, GPTConfig
from optzoo.optimizers import _emerging
from optzoo.optimizers.newton_schulz import (
    COEFFICIENT_SETS,
    newton_schulz,
    newton_schulz_flops,
)
from optzoo.optimizers.registry import fused_supported

Row = dict[str, Any]
OPTIMIZERS = ("adam", "sgd", "lion", "muon", "adaptive_muon", "soap")
DEFAULT_OUT = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Sizes and repeats of one run."""

    models: tuple[tuple[str, GPTConfig, int], ...]
    """Step-time models: (label, shape, round-robin repeats)."""
    soap_models: int = 1
    """SOAP is timed on the first this-many models only (upstream refreshes its eigenbasis every step)."""
    ns_shapes: tuple[tuple[int, int, int], ...]
    """Newton–Schulz (batch, rows, cols); ``quintic`` and ``polar_express`` at each."""
    ns_all_sets_shape: tuple[int, int, int]
    """Where every coefficient set is timed."""
    ns_repeats: int
    """Round-robin repeats per Newton–Schulz shape."""
    memory_model: GPTConfig
    """The model whose state is measured (bytes per param barely depend on its size)."""
    train_model: GPTConfig
    """The convergence model (byte-level: vocab 256)."""
    train_steps: int
    batch_size: int = 16
    """Sequences per training batch, each ``train_model.max_seq_len + 1`` bytes."""
    data_bytes: int = 4_000_000
    """Bytes of the standard library's source to read (``optzoo.demo.stdlib_bytes``); 10% held out."""
    valid_batches: int = 8
    """Held-out batches averaged for the final validation loss (the same ones for every optimizer)."""


def _gpt(hidden: int, layers: int, heads: int, seq: int = 128) -> GPTConfig:
    return GPTConfig(hidden_size=hidden, num_layers=layers, num_heads=heads, vocab_size=256, max_seq_len=seq)


FULL = Plan(
    models=(("0.9M", _gpt(128, 4, 4), 7), ("4.9M", _gpt(256, 6, 4), 7), ("19.2M", _gpt(512, 6, 8), 5)),
    ns_shapes=tuple(ns_bench.SHAPES),
    ns_all_sets_shape=(1, 1024, 1024),
    ns_repeats=5,
    memory_model=_gpt(128, 4, 4),
    train_model=_gpt(128, 2, 4),  # the demo's model: 0.48M params
    train_steps=200,
    valid_batches=16,
)
QUICK = Plan(
    models=(("tiny-a", _gpt(16, 1, 2, 16), 1), ("tiny-b", _gpt(32, 1, 2, 16), 1), ("tiny-c", _gpt(32, 2, 2, 16), 1)),
    ns_shapes=((1, 16, 32), (2, 16, 16)),
    ns_all_sets_shape=(1, 16, 32),
    ns_repeats=1,
    memory_model=_gpt(16, 1, 2, 16),
    train_model=_gpt(16, 1, 2, 16),
    train_steps=4,
    batch_size=2,
    data_bytes=50_000,
    valid_batches=1,
)

TRAIN_RUNS: dict[str, dict[str, Any]] = {
    "adam": {"lr": 3e-3, "decoupled_lr": 1e-3, "weight_decay": 0.1},  # optzoo.demo's AdamW
    "sgd": {"lr": 1.0, "weight_decay": 0.0},  # torch SGD's decay is L2: at 0.1 it would shrink weights by lr·0.1 a step
    "lion": {"lr": 1e-3, "decoupled_lr": 1e-3 / 3, "weight_decay": 0.1},
    "muon": {"lr": 3e-3, "decoupled_lr": 1e-3, "weight_decay": 0.1},  # the demo's: spectral scaling takes AdamW's lr
    # AdaMuon's second moment makes the orthogonalised update elementwise ~±1 before the spectral
    # scale, so it wants a far smaller lr; the Adam-routed embeddings keep decoupled_lr=1e-3.
    "adaptive_muon": {"lr": 1e-4, "decoupled_lr": 1e-3, "weight_decay": 0.1},
    "soap": {"lr": 1e-2, "decoupled_lr": 1e-2 / 3, "weight_decay": 0.1},
}
"""Convergence settings per optimizer: the best held-out loss of an lr sweep (3-5 points, 200 steps)
on this very task, so each optimizer is shown at its best grid point (docs/benchmarks.md lists the grid)."""


class _Progress:
    """One tqdm bar over the whole run; each section adds its units (timed calls, training steps)."""

    def __init__(self, bar: tqdm[Any]) -> None:
        self.bar = bar

    def add(self, units: int, section: str) -> None:
        self.bar.total = (self.bar.total or 0) + units
        self.bar.set_description(section)
        self.bar.refresh()

    def tick(self) -> None:
        self.bar.update(1)


class _Timed:
    """A step that ticks the progress bar and remembers its first call's duration."""

    def __init__(self, step: Callable[[], object], progress: _Progress, device: torch.device) -> None:
        self.step, self.progress, self.device, self.first_s = step, progress, device, float("nan")

    def __call__(self) -> object:
        started = time.perf_counter()
        result = self.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.first_s != self.first_s:  # nan: the first call
            self.first_s = time.perf_counter() - started
        self.progress.tick()
        return result


# --- 1. step time ------------------------------------------------------------------------------


def _model_with_grads(config: GPTConfig, device: torch.device, dtype: torch.dtype = torch.float32) -> GPT:
    torch.manual_seed(0)
    model = GPT(config).to(device=device, dtype=dtype)
    generator = torch.Generator().manual_seed(1)
    for param in model.parameters():
        param.grad = (torch.randn(param.shape, generator=generator) * 1e-3).to(device=device, dtype=dtype)
    return model


def _groups(opt: torch.optim.Optimizer, *keys: str, optimizer: str | None = None) -> list[dict[str, Any]]:
    """``opt``'s groups (optionally those routed to ``optimizer``) for a baseline built by hand."""
    return [
        {"params": g["params"], "lr": g["lr"], "weight_decay": g["weight_decay"], **{k: g[k] for k in keys}}
        for g in opt.param_groups
        if optimizer is None or g["optimizer"] == optimizer
    ]


def _paired(*opts: torch.optim.Optimizer) -> Callable[[], object]:
    return lambda: [opt.step() for opt in opts]


def _step_candidates(model: GPT, device: torch.device, *, soap: bool) -> dict[str, tuple[str, Callable[[], object]]]:
    """``{name: (source, step)}``; baselines get the same params, lrs and decay as optzoo's groups."""
    precision = "highest" if device.type == "cpu" else "medium"  # bf16 Newton–Schulz gains nothing on CPU
    base = OptimizerConfig(lr=1e-3, weight_decay=0.1, clip_grad=0.0, muon_fp32_matmul_prec=precision)
    ours = {name: get_optimizer(base.replace(optimizer=name), model) for name in OPTIMIZERS if soap or name != "soap"}
    kernel = {"fused": True} if fused_supported(list(model.parameters())) else {"foreach": True}

    def adamw_rest(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return torch.optim.AdamW(_groups(opt, "betas", "eps", optimizer="adam"), **kernel)  # type: ignore[arg-type]

    def matrices(opt: torch.optim.Optimizer, name: str) -> tuple[list[torch.Tensor], dict[str, Any]]:
        (group,) = _groups(opt, optimizer=name)  # one lr and decay for every hidden matrix here
        return group["params"], {"lr": group["lr"], "weight_decay": group["weight_decay"]}

    upstream = {"momentum": 0.95, "fp32_matmul_prec": precision}
    muon_params, muon_hp = matrices(ours["muon"], "muon")
    ada_params, ada_hp = matrices(ours["adaptive_muon"], "adaptive_muon")
    out: dict[str, tuple[str, Callable[[], object]]] = {
        "optzoo adam": ("optzoo", ours["adam"].step),
        "torch AdamW foreach": ("torch", torch.optim.AdamW(_groups(ours["adam"], "betas", "eps"), foreach=True).step),
    }
    if "fused" in kernel:
        out["torch AdamW fused"] = ("torch", torch.optim.AdamW(_groups(ours["adam"], "betas", "eps"), fused=True).step)
    out["optzoo sgd"] = ("optzoo", ours["sgd"].step)
    out["optzoo lion"] = ("optzoo", ours["lion"].step)
    out["emerging Lion"] = ("emerging-optimizers", _emerging.lion(_groups(ours["lion"], "betas")).step)
    out["optzoo muon"] = ("optzoo", ours["muon"].step)
    if hasattr(torch.optim, "Muon"):  # torch >= 2.9; 2-D only, Newton–Schulz always in bf16
        torch_muon = torch.optim.Muon(muon_params, momentum=0.95, nesterov=False, **muon_hp)
        out["torch Muon + AdamW"] = ("torch", _paired(torch_muon, adamw_rest(ours["muon"])))
    out["emerging Muon + AdamW"] = (
        "emerging-optimizers", _paired(_emerging.muon(muon_params, **muon_hp, **upstream), adamw_rest(ours["muon"])),
    )  # fmt: skip
    out["optzoo adaptive_muon"] = ("optzoo", ours["adaptive_muon"].step)
    out["emerging AdaptiveMuon + AdamW"] = (
        "emerging-optimizers",
        _paired(_emerging.adaptive_muon(ada_params, **ada_hp, **upstream), adamw_rest(ours["adaptive_muon"])),
    )
    if soap:
        soap_groups = _groups(ours["soap"], "betas", "eps", "shampoo_beta", optimizer="soap")
        out["optzoo soap"] = ("optzoo", ours["soap"].step)
        out["emerging SOAP + AdamW"] = (
            "emerging-optimizers", _paired(_emerging.soap(soap_groups, use_kl_shampoo=True), adamw_rest(ours["soap"])),
        )  # fmt: skip
    return out


def step_times(plan: Plan, device: torch.device, progress: _Progress) -> list[Row]:
    """One row per (model, candidate): median and first-call ms, and the ratio to torch AdamW foreach."""
    rows: list[Row] = []
    for index, (label, config, repeats) in enumerate(plan.models):
        model = _model_with_grads(config, device)
        size = sum(p.numel() for p in model.parameters())
        candidates = _step_candidates(model, device, soap=index < plan.soap_models)
        progress.add(len(candidates) * (repeats + 2), f"step time {label}")
        timed = {name: _Timed(step, progress, device) for name, (_, step) in candidates.items()}
        for step in timed.values():
            step()  # the first call alone: lazy state, torch.compile
        medians = round_robin_medians(timed, repeats)
        baseline = medians["torch AdamW foreach"]
        for name, (source, _) in candidates.items():
            rows.append({
                "model": label, "hidden": config.hidden_size, "layers": config.num_layers, "params": size,
                "candidate": name, "source": source, "repeats": repeats, "median_ms": medians[name] * 1e3,
                "first_call_ms": timed[name].first_s * 1e3, "vs_torch_adamw_foreach": medians[name] / baseline,
            })  # fmt: skip
        del candidates, timed, model
    return rows


# --- 2. Newton–Schulz ---------------------------------------------------------------------------


def newton_schulz_rates(plan: Plan, device: torch.device, progress: _Progress) -> list[Row]:
    """One row per (shape, implementation): ms, counted GFLOP, GFLOP/s and fraction of ``torch.matmul``."""
    rows: list[Row] = []
    for shape in plan.ns_shapes:
        torch.manual_seed(0)
        x = torch.randn(shape, device=device)
        sets = tuple(COEFFICIENT_SETS) if shape == plan.ns_all_sets_shape else ("quintic", "polar_express")
        candidates: dict[str, tuple[str, Callable[[], object]]] = {
            f"ours {name}": (name, lambda x=x, name=name: newton_schulz(x, steps=5, coefficient_type=name))  # type: ignore[misc]
            for name in sets
        }
        candidates["upstream quintic"] = ("quintic", ns_bench._upstream(x, 5, "quintic", "highest"))
        mm, mm_flops = ns_bench._mm_step(x)
        progress.add((len(candidates) + 1) * (plan.ns_repeats + 1) + len(candidates), f"Newton–Schulz {shape}")
        flops = {name: ns_bench._flops(step) for name, (_, step) in candidates.items()}
        for _ in candidates:
            progress.tick()
        timed = {"torch.matmul": _Timed(mm, progress, device)} | {n: _Timed(s, progress, device) for n, (_, s) in candidates.items()}
        medians = round_robin_medians(timed, plan.ns_repeats)
        mm_rate = mm_flops / medians["torch.matmul"] / 1e9
        standard = newton_schulz_flops(*shape[1:], steps=5, variant="standard", batch=shape[0])
        label = "×".join(map(str, shape if shape[0] > 1 else shape[1:]))
        rows.append({"shape": label, "implementation": "torch.matmul (one step's products)", "coefficients": "-",
                     "median_ms": medians["torch.matmul"] * 1e3, "gflop": mm_flops / 1e9, "gflops": mm_rate,
                     "fraction_of_mm": 1.0, "effective_gflops": mm_rate})  # fmt: skip
        for name, (coefficients, _) in candidates.items():
            rate = flops[name] / medians[name] / 1e9
            rows.append({"shape": label, "implementation": name.split()[0], "coefficients": coefficients,
                         "median_ms": medians[name] * 1e3, "gflop": flops[name] / 1e9, "gflops": rate,
                         "fraction_of_mm": rate / mm_rate, "effective_gflops": standard / medians[name] / 1e9})  # fmt: skip
    return rows


# --- 3. memory ------------------------------------------------------------------------------------

_PA = {"bf16": True, "use_precision_aware_optimizer": True}
_BF16_MOMENTS = {"exp_avg_dtype": torch.bfloat16, "exp_avg_sq_dtype": torch.bfloat16}
PRECISIONS: tuple[tuple[str, dict[str, Any], tuple[str, ...]], ...] = (
    ("fp32", {}, OPTIMIZERS),
    ("bf16, fp32 main params", {"bf16": True}, OPTIMIZERS),
    ("bf16 precision-aware, fp32 master", {**_PA, "store_param_remainders": False}, ("adam",)),
    ("bf16 precision-aware, fp32 master, bf16 moments", {**_PA, "store_param_remainders": False, **_BF16_MOMENTS}, ("adam",)),
    ("bf16 precision-aware, param remainders", _PA, ("adam",)),
    ("bf16 precision-aware, param remainders, bf16 moments", {**_PA, **_BF16_MOMENTS}, ("adam",)),
)
"""(label, config fields, optimizers it applies to); precision-aware settings exist for Adam only."""


def state_bytes(opt: torch.optim.Optimizer, model: torch.nn.Module) -> tuple[float, float]:
    """(optimizer state, main params) bytes per model param. Main: copies in the groups that are not
    model params, plus precision-aware Adam's ``master_param`` (fp32 copy or int16 remainder).
    Their sum is :func:`benchmarks.bench_precision._bytes_per_param`."""
    model_ids = {id(p) for p in model.parameters()}
    tensors = [(k, v) for s in opt.state.values() for k, v in s.items() if torch.is_tensor(v) and k != "step"]
    master = sum(v.numel() * v.element_size() for k, v in tensors if k == "master_param")
    state = sum(v.numel() * v.element_size() for k, v in tensors if k != "master_param")
    mains = sum(p.numel() * p.element_size() for g in opt.param_groups for p in g["params"] if id(p) not in model_ids)
    count = sum(p.numel() for p in model.parameters())
    return state / count, (mains + master) / count


def memory(plan: Plan, device: torch.device, progress: _Progress) -> list[Row]:
    """One row per (optimizer, precision): bytes per param after one step."""
    cases = [(label, fields, name) for label, fields, names in PRECISIONS for name in names]
    progress.add(len(cases), "memory")
    precision = "highest" if device.type == "cpu" else "medium"
    rows: list[Row] = []
    for label, fields, name in cases:
        dtype = torch.bfloat16 if fields.get("bf16") else torch.float32
        model = _model_with_grads(plan.memory_model, device, dtype)
        config = OptimizerConfig(optimizer=name, lr=1e-3, weight_decay=0.1, muon_fp32_matmul_prec=precision, **fields)
        opt = get_optimizer(config, model)
        opt.step()
        state, main = state_bytes(opt, model)
        weights = torch.finfo(dtype).bits / 8
        rows.append({"optimizer": name, "precision": label, "model_weights": weights, "state": state,
                     "main_params": main, "state_plus_main": state + main, "total_with_weights": weights + state + main})  # fmt: skip
        progress.tick()
    return rows


# --- 4. convergence --------------------------------------------------------------------------------


def _batches(source: torch.Tensor, plan: Plan, seed: int) -> Iterable[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    seq = plan.train_model.max_seq_len
    while True:
        starts = torch.randint(len(source) - seq - 1, (plan.batch_size,), generator=generator).tolist()
        yield torch.stack([source[s : s + seq + 1] for s in starts])


def _train_one(name: str, plan: Plan, device: torch.device, train: torch.Tensor, valid: torch.Tensor, progress: _Progress) -> Row:
    precision = "highest" if device.type == "cpu" else "medium"
    config = OptimizerConfig(optimizer=name, muon_fp32_matmul_prec=precision, **TRAIN_RUNS[name])
    torch.manual_seed(0)
    model = GPT(plan.train_model).to(device)
    warm = copy.deepcopy(model)  # one step on a throwaway copy: compile and lazy init stay off the clock
    warm.loss(next(iter(_batches(train, plan, 99))).to(device)).backward()  # type: ignore[no-untyped-call]
    get_optimizer(config, warm).step()
    optimizer = get_optimizer(config, model)
    losses, elapsed = [], []
    started = time.perf_counter()
    for _, batch in zip(range(plan.train_steps), _batches(train, plan, 0)):
        loss = model.loss(batch.to(device))
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        losses.append(loss.item())  # .item() synchronises a GPU
        elapsed.append(time.perf_counter() - started)
        progress.tick()
    with torch.no_grad():
        held_out = [model.loss(b.to(device)).item() for _, b in zip(range(plan.valid_batches), _batches(valid, plan, 1))]
    return {"optimizer": name, "settings": {k: v for k, v in TRAIN_RUNS[name].items()}, "train_loss": losses,
            "elapsed_s": elapsed, "valid_loss": sum(held_out) / len(held_out), "ms_per_step": elapsed[-1] / len(elapsed) * 1e3}  # fmt: skip


def convergence(plan: Plan, device: torch.device, progress: _Progress) -> list[Row]:
    data = stdlib_bytes(plan.data_bytes)
    split = int(0.9 * len(data))
    progress.add(len(OPTIMIZERS) * plan.train_steps, "convergence")
    return [_train_one(name, plan, device, data[:split], data[split:], progress) for name in OPTIMIZERS]


def run_suite(*, device: str | None = None, out: str | Path | None = None, quick: bool = False, progress: bool = True) -> Row:
    """Run the four sections, print their tables, write ``results.json`` and the PNGs; return the results.

    Raises:
        ValueError: ``device`` is not ``cpu`` or ``cuda``, or is ``cuda`` without a GPU.
        ImportError: matplotlib is missing.
    """
    name = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda") or (name == "cuda" and not torch.cuda.is_available()):
        raise ValueError(f"`--device`: unavailable; got {name!r}; expected 'cpu'" + (" or 'cuda'" if torch.cuda.is_available() else ""))
    require_matplotlib()
    dev, plan = torch.device(name), QUICK if quick else FULL
    target = Path(out) if out is not None else DEFAULT_OUT
    started = time.perf_counter()
    results: Row = {
        "environment": environment(dev),
        "plan": {
            "quick": quick, "models": [[label, c.hidden_size, c.num_layers, c.num_heads, repeats] for label, c, repeats in plan.models],
            "soap_models": plan.soap_models, "ns_repeats": plan.ns_repeats, "memory_params": sum(p.numel() for p in GPT(plan.memory_model).parameters()),
            "train_params": sum(p.numel() for p in GPT(plan.train_model).parameters()), "train_steps": plan.train_steps,
            "batch_size": plan.batch_size, "train_seq_len": plan.train_model.max_seq_len, "data_bytes": plan.data_bytes,
        },
    }  # fmt: skip
    with tqdm(total=0, disable=not progress, unit="step", dynamic_ncols=True) as bar:
        tracker = _Progress(bar)
        sections: list[tuple[str, Callable[[Plan, torch.device, _Progress], list[Row]]]] = [
            ("step_time", step_times), ("newton_schulz", newton_schulz_rates), ("memory", memory), ("convergence", convergence),
        ]  # fmt: skip
        results["section_s"] = {}
        for key, section in sections:
            section_started = time.perf_counter()
            results[key] = section(plan, dev, tracker)
            results["section_s"][key] = time.perf_counter() - section_started
    results["runtime_s"] = time.perf_counter() - started
    write_report(results, target)
    env = results["environment"]
    print(f"benchmarks.compare on {env['device_name']} ({env['device']}, {env['threads']} threads), torch {env['torch']}, "
          f"{'quick' if quick else 'full'} plan")  # fmt: skip
    for table in tables(results):
        print(f"\n{table}")
    took = ", ".join(f"{key} {seconds:.0f} s" for key, seconds in results["section_s"].items())
    print(f"\nwrote {target / 'results.json'} and {', '.join(results['plots'])}; {results['runtime_s']:.0f} s ({took})")
    return results


def main(argv: list[str] | None = None) -> int:
    """Run the suite from the command line; returns the exit status (2 with a one-line error)."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.compare", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available, else cpu")
    parser.add_argument("--out", help=f"output folder (default {DEFAULT_OUT})")
    parser.add_argument("--quick", action="store_true", help="toy sizes: the whole pipeline in seconds")
    args = parser.parse_args(argv)
    try:
        run_suite(device=args.device, out=args.out, quick=args.quick)
    except (ValueError, ImportError) as error:
        print(f"benchmarks.compare: error: {str(error).splitlines()[0]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

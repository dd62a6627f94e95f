"""Muon's step time: optzoo against ``torch.optim.Muon`` and emerging-optimizers' ``Muon``.

Run: ``.venv/bin/python -m benchmarks.bench_muon`` (``--quick``: toy sizes, one repeat, numbers
meaningless; ``--device cuda`` or ``cpu,cuda``: GPU columns). It prints two tables.

**Against torch.optim.Muon** (:func:`torch_comparison`): six candidates step the same model, each
its own copy, on two models: the params of GPT blocks (per layer two LayerNorms and the matrices
q, k, v, o (hidden × hidden), up (ffn × hidden) and down (hidden × ffn); hidden 1024, ffn 4096,
2 layers by default) and one MoE MLP (a LayerNorm, the router and two expert stacks
``[experts, out, in]``; 8 experts of 2816 × 1024 by default). The candidates:
``torch.optim.Muon`` with its defaults (its Newton–Schulz casts to bf16: torch 2.14 offers no
other precision), the same with that one cast patched to float32 (not a torch option; the
equal-precision reference), emerging-optimizers' ``Muon`` with its defaults
(``fp32_matmul_prec="medium"``) and at ``"highest"``, and optzoo's
``get_optimizer(OptimizerConfig(optimizer="muon"))`` with its defaults and at ``"highest"``
(``lr=0.02`` everywhere: optzoo requires one; the rest is each library's default). The two
reference classes take 2-D params only: they step each expert of a stack as its own 2-D param
(a view into the stack), and ``torch.optim.AdamW(fused=True)`` steps the 1-D params beside them,
as optzoo's routing does with its fused Adam. Every repeat writes fresh gradients (the same for
every candidate, untimed) before each step; candidates take turns within each repeat, each
repeat starting one candidate later (:func:`benchmarks._timing.round_robin`), after a first
step each that is timed apart (lazy state, optzoo's Newton–Schulz probe). A ratio is the median
over repeats of the candidate's time over ``torch.optim.Muon``'s defaults' in the same repeat;
the next column divides the two fastest steps (load only ever adds time).

**Ours against upstream at "highest"** (:func:`compare`): the 2-D weights of a GPT-style model,
built directly as tensors with gradients: per layer a fused QKV (3·hidden × hidden), the
attention output (hidden × hidden) and the MLP (ffn × hidden, hidden × ffn); the defaults
(hidden 1024, ffn 4096, 2 layers) give 25.2M params. Every candidate steps its own copy, all at
``fp32_matmul_prec="highest"`` (IEEE float32 matmuls), without a QKV split (upstream's Muon has
none): ours batched and per-tensor, upstream, for Muon and AdaptiveMuon.

Where ours gains: the Gram variant of Newton–Schulz on wide float32 matrices (0.66x the
standard loop's FLOPs at 1024 × 4096, 0.74x at 1024 × 3072), symmetric products kept as blocks
from 1024 rows (3/4 of the ``m × m`` FLOPs), and one batched call per exact shape.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.metadata
import math
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from unittest import mock

import pytest
import torch
from tabulate import tabulate
from torch import nn
from torch.optim import _muon as torch_muon_module

from benchmarks._timing import round_robin, round_robin_medians
from optzoo import OptimizerConfig, get_optimizer
from optzoo.optimizers import _emerging
from optzoo.optimizers import newton_schulz_probe as probe
from optzoo.optimizers.adaptive_muon import AdaptiveMuon
from optzoo.optimizers.muon import Muon

SETTINGS = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.01, "fp32_matmul_prec": "highest"}


def gpt_matrices(hidden: int, ffn: int, layers: int, device: torch.device) -> list[torch.Tensor]:
    """The 2-D weights of ``layers`` transformer layers, with random gradients."""
    generator = torch.Generator(device).manual_seed(0)
    shapes = [(3 * hidden, hidden), (hidden, hidden), (ffn, hidden), (hidden, ffn)] * layers
    params = []
    for shape in shapes:
        param = torch.nn.Parameter(torch.randn(shape, generator=generator, device=device) * 0.02)
        param.grad = torch.randn(shape, generator=generator, device=device) * 1e-3
        params.append(param)
    return params


def _copy(params: list[torch.Tensor]) -> list[torch.Tensor]:
    copies = []
    for param in params:
        copied = torch.nn.Parameter(param.detach().clone())
        copied.grad = param.grad.clone() if param.grad is not None else None
        copies.append(copied)
    return copies


def _synced(step: Callable[[], object], device: torch.device) -> Callable[[], object]:
    if device.type != "cuda":
        return step
    return lambda: (step(), torch.cuda.synchronize(device))


def candidates(params: list[torch.Tensor], moment2_method: str) -> dict[str, torch.optim.Optimizer]:
    """Ours (batched, per-tensor) and upstream, for Muon and AdaptiveMuon, each on its own copy."""
    adaptive = {**SETTINGS, "moment2_method": moment2_method}
    return {
        "ours Muon": Muon(_copy(params), **SETTINGS),  # type: ignore[arg-type]
        "ours Muon per-tensor": Muon(_copy(params), **SETTINGS, batched=False),  # type: ignore[arg-type]
        "upstream Muon": _emerging.muon(_copy(params), **SETTINGS),
        "ours AdaptiveMuon": AdaptiveMuon(_copy(params), **adaptive),  # type: ignore[arg-type]
        "upstream AdaptiveMuon": _emerging.adaptive_muon(_copy(params), **adaptive),
    }


def compare(
    *, hidden: int = 1024, ffn: int = 4096, layers: int = 2, moment2_method: str = "adamuon", repeats: int = 5, device: str = "cpu"
) -> tuple[int, list[list[object]]]:
    """Median step time per candidate, and its ratio to upstream's same algorithm."""
    dev = torch.device(device)
    params = gpt_matrices(hidden, ffn, layers, dev)
    optimizers = candidates(params, moment2_method)
    medians = round_robin_medians({name: _synced(opt.step, dev) for name, opt in optimizers.items()}, repeats)
    rows: list[list[object]] = []
    for name, seconds in medians.items():
        baseline = "upstream AdaptiveMuon" if "Adaptive" in name else "upstream Muon"
        rows.append([name, seconds * 1e3, seconds / medians[baseline]])
    return sum(p.numel() for p in params), rows


HEADERS = ["optimizer", "median step ms", "time vs upstream"]


# ---- against torch.optim.Muon ---------------------------------------------------------------

LR = 0.02
"""Every candidate's Muon lr (optzoo requires one; ``torch.optim.Muon(lr=0.02)`` is the usual port)."""
SCALAR_LR = 3e-4
"""The AdamW beside the reference classes (1-D params)."""


@dataclass(frozen=True, kw_only=True)
class Sizes:
    """The two models' shapes: GPT blocks and one MoE MLP."""

    hidden: int = 1024
    ffn: int = 4096
    layers: int = 2
    experts: int = 8
    expert_ffn: int = 2816


QUICK = Sizes(hidden=32, ffn=128, layers=2, experts=2, expert_ffn=88)
"""``--quick``: toy sizes that check the pipeline; the numbers mean nothing."""


class GPTBlock(nn.Module):
    """The params of one pre-norm GPT block: two LayerNorms, then q, k, v, o, up and down (no biases)."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(hidden)
        self.linear_q, self.linear_k, self.linear_v, self.linear_proj = (nn.Linear(hidden, hidden, bias=False) for _ in range(4))
        self.pre_mlp_layernorm = nn.LayerNorm(hidden)
        self.linear_fc1 = nn.Linear(hidden, ffn, bias=False)
        self.linear_fc2 = nn.Linear(ffn, hidden, bias=False)


class GPTBlocks(nn.Module):
    def __init__(self, sizes: Sizes) -> None:
        super().__init__()
        self.layers = nn.ModuleList(GPTBlock(sizes.hidden, sizes.ffn) for _ in range(sizes.layers))


class Experts(nn.Module):
    """The experts' weights as two stacks ``[experts, out, in]`` (up, down)."""

    def __init__(self, sizes: Sizes) -> None:
        super().__init__()
        self.linear_fc1 = nn.Parameter(torch.empty(sizes.experts, sizes.expert_ffn, sizes.hidden))
        self.linear_fc2 = nn.Parameter(torch.empty(sizes.experts, sizes.hidden, sizes.expert_ffn))


class MoEMLP(nn.Module):
    """The params of one MoE MLP: a LayerNorm, the router and the experts' stacks.

    The stacks sit in a module called ``experts`` beside the ``router``: that is how optzoo's
    routing knows a 3-D param for a stack of expert matrices (docs/roles.md); a 3-D param it
    cannot place goes to the scalar optimizer, not to Muon.
    """

    def __init__(self, sizes: Sizes) -> None:
        super().__init__()
        self.pre_mlp_layernorm = nn.LayerNorm(sizes.hidden)
        self.router = nn.Linear(sizes.hidden, sizes.experts, bias=False)
        self.experts = Experts(sizes)


MODELS: dict[str, Callable[[Sizes], nn.Module]] = {"GPT blocks": GPTBlocks, "MoE experts": MoEMLP}


def build_model(name: str, sizes: Sizes, device: torch.device) -> nn.Module:
    """``MODELS[name]`` with seeded weights (matrices ~ N(0, 0.02²), norms at 1 and 0) and zero gradients."""
    return with_zero_grads(seeded_model(name, sizes, device))


def with_zero_grads(model: nn.Module) -> nn.Module:
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    return model


def seeded_model(name: str, sizes: Sizes, device: torch.device) -> nn.Module:
    generator = torch.Generator(device).manual_seed(0)
    model = MODELS[name](sizes).to(device)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim >= 2:
                param.copy_(torch.randn(param.shape, generator=generator, device=device) * 0.02)
    return model


def matrices_and_rest(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """The params a 2-D-only Muon takes (a stack's matrices as 2-D params sharing its storage and
    gradient), and the others (for AdamW)."""
    matrices: list[nn.Parameter] = []
    rest: list[nn.Parameter] = []
    for param in model.parameters():
        if param.ndim == 2:
            matrices.append(param)
        elif param.ndim > 2:
            assert param.grad is not None  # build_model gives every param one
            for index in range(param.shape[0]):
                view = nn.Parameter(param.detach()[index])
                view.grad = param.grad[index]
                matrices.append(view)
        else:
            rest.append(param)
    return matrices, rest


def torch_newton_schulz_fp32(
    grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float
) -> torch.Tensor:
    """``torch.optim._muon._zeropower_via_newtonschulz`` (torch 2.14) in float32 where it casts to
    bf16, otherwise the same products; its argument checks left out."""
    a, b, c = ns_coefficients
    transposed = grad.size(0) > grad.size(1)
    ortho = grad.float().T if transposed else grad.float()
    ortho = ortho / ortho.norm().clamp(min=eps)  # not in place: ``float()`` of a float32 grad is the grad
    for _ in range(ns_steps):
        gram = ortho @ ortho.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        ortho = torch.addmm(ortho, gram_update, ortho, beta=a)
    return ortho.T if transposed else ortho


def _with_adamw(muon: torch.optim.Optimizer, rest: list[nn.Parameter]) -> Callable[[], object]:
    if not rest:
        return muon.step
    adamw = torch.optim.AdamW(rest, lr=SCALAR_LR, weight_decay=0.0, fused=True)
    return lambda: (muon.step(), adamw.step())


def _torch_muon(model: nn.Module) -> Callable[[], object]:
    matrices, rest = matrices_and_rest(model)
    return _with_adamw(torch.optim.Muon(matrices, lr=LR), rest)


def _torch_muon_fp32(model: nn.Module) -> Callable[[], object]:
    step = _torch_muon(model)

    def patched() -> object:
        with mock.patch.object(torch_muon_module, "_zeropower_via_newtonschulz", torch_newton_schulz_fp32):
            return step()

    return patched


def _emerging_muon(**options: str) -> Callable[[nn.Module], Callable[[], object]]:
    def build(model: nn.Module) -> Callable[[], object]:
        matrices, rest = matrices_and_rest(model)
        return _with_adamw(_emerging.muon(matrices, lr=LR, **options), rest)

    return build


def _optzoo_muon(**fields: str) -> Callable[[nn.Module], Callable[[], object]]:
    def build(model: nn.Module) -> Callable[[], object]:
        return get_optimizer(OptimizerConfig(optimizer="muon", lr=LR, **fields), model).step  # type: ignore[arg-type]

    return build


@dataclass(frozen=True)
class Candidate:
    label: str
    newton_schulz: str
    """What its Newton–Schulz computes in."""
    build: Callable[[nn.Module], Callable[[], object]]
    """A model (its own copy, with gradients) to its step."""


TORCH_DEFAULTS = "torch.optim.Muon, defaults"
TORCH_CANDIDATES = (
    Candidate(TORCH_DEFAULTS, "bf16 (a fixed cast; no option)", _torch_muon),
    Candidate("torch.optim.Muon, fp32 (patched)", "fp32 (the cast patched out; not a torch option)", _torch_muon_fp32),
    Candidate("emerging-optimizers Muon, defaults", '"medium": a bf16 loop (upstream casts)', _emerging_muon()),
    Candidate('emerging-optimizers Muon, "highest"', '"highest" (IEEE fp32)', _emerging_muon(fp32_matmul_prec="highest")),
    Candidate("optzoo muon, defaults", '"medium": bf16 loop or fp32, optzoo\'s choice', _optzoo_muon()),
    Candidate('optzoo muon, "highest"', '"highest" (IEEE fp32)', _optzoo_muon(muon_fp32_matmul_prec="highest")),
)  # fmt: skip


@dataclass(frozen=True)
class Measured:
    model: str
    candidate: Candidate
    device: str
    median_s: float
    first_s: float
    vs_torch: float
    """The median over repeats of its step time over ``torch.optim.Muon``'s defaults' in the same
    repeat (same model and device): drift between repeats cancels."""
    fastest_vs_torch: float
    """Its fastest step over ``torch.optim.Muon``'s defaults' fastest: on a shared machine, load
    only ever adds time, so the fastest steps are the nearest to a quiet machine's."""


class FreshGradients:
    """``before`` for :func:`round_robin`: new seeded gradients every repeat, the same for every
    candidate, written into its model's gradients; torch's float32 matmul precision reset to the
    run's, should a candidate have left it changed (a timing must not inherit another's setting)."""

    def __init__(self, models: dict[str, nn.Module], device: torch.device) -> None:
        self.models, self.device = models, device
        self.precision = torch.get_float32_matmul_precision()
        self.repeat: int | None = None
        self.values: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, repeat: int) -> None:
        model = self.models[name]
        if repeat != self.repeat:
            generator = torch.Generator(self.device).manual_seed(1000 + repeat)
            self.repeat = repeat
            self.values = {
                key: torch.randn(param.shape, generator=generator, device=self.device) * 1e-3
                for key, param in model.named_parameters()
            }
        for key, param in model.named_parameters():
            assert param.grad is not None  # candidates step the grads in place, never drop them
            param.grad.copy_(self.values[key])
        if torch.get_float32_matmul_precision() != self.precision:
            torch.set_float32_matmul_precision(self.precision)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def torch_comparison(
    sizes: Sizes = Sizes(), *, devices: tuple[str, ...] = ("cpu",), repeats: int = 5
) -> list[Measured]:
    """Every :data:`TORCH_CANDIDATES` entry on every model of :data:`MODELS` and every device."""
    measured: list[Measured] = []
    for device_name in devices:
        device = torch.device(device_name)
        for model_name in MODELS:
            base = seeded_model(model_name, sizes, device)
            models = {c.label: with_zero_grads(copy.deepcopy(base)) for c in TORCH_CANDIDATES}
            del base
            steps = {c.label: _synced(c.build(models[c.label]), device) for c in TORCH_CANDIDATES}
            times = round_robin(steps, repeats, before=FreshGradients(models, device), rotate=True)
            medians, fastest = times.median, {name: min(t) for name, t in times.samples.items()}
            measured.extend(
                Measured(
                    model_name, c, device.type, medians[c.label], times.first[c.label],
                    times.median_ratio(c.label, TORCH_DEFAULTS), fastest[c.label] / fastest[TORCH_DEFAULTS],
                )
                for c in TORCH_CANDIDATES
            )  # fmt: skip
            del models, steps
    return measured


def parameter_counts(sizes: Sizes) -> dict[str, int]:
    return {name: sum(p.numel() for p in MODELS[name](sizes).parameters()) for name in MODELS}


def torch_table(measured: list[Measured]) -> str:
    """One row per model and candidate; per device its median step, ratio and first step."""
    devices = list(dict.fromkeys(m.device for m in measured))
    headers = ["model", "candidate", "Newton–Schulz in"]
    for device in devices:
        headers += [f"{device} step ms", f"{device} × torch defaults", f"{device} fastest × torch's", f"{device} first step ms"]
    rows: dict[tuple[str, str], list[object]] = {}
    for m in measured:
        row = rows.setdefault((m.model, m.candidate.label), [m.model, m.candidate.label, m.candidate.newton_schulz])
        row += [m.median_s * 1e3, m.vs_torch, m.fastest_vs_torch, m.first_s * 1e3]
    return str(tabulate(list(rows.values()), headers=headers, floatfmt=".2f", tablefmt="github"))


def cpu_description() -> str:
    """The CPU model (``/proc/cpuinfo``), its bf16-relevant flags, and torch's CPU capability."""
    model, flags = platform.processor() or "unknown CPU", set[str]()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    relevant = ", ".join(f"{flag} {'yes' if flag in flags else 'no'}" for flag in BF16_FLAGS)
    return f"{model} ({relevant}; torch CPU capability {torch.backends.cpu.get_cpu_capability()})"


BF16_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile", "avx512f", "avx2")
"""CPU flags that decide how fast bf16 matmuls run (oneDNN uses AVX512-BF16 or AMX tiles)."""


def machine_description(devices: tuple[str, ...]) -> str:
    lines = [f"CPU: {cpu_description()}; {torch.get_num_threads()} torch threads"]
    for device in devices:
        if device.startswith("cuda"):
            major, minor = torch.cuda.get_device_capability(device)
            lines.append(f"GPU: {torch.cuda.get_device_name(device)} (sm_{major}{minor})")
    lines.append(f"torch {torch.__version__}, emerging-optimizers {importlib.metadata.version('emerging-optimizers')}")
    return "\n".join(lines)


TORCH_NOTES = (
    "torch.optim.Muon has no setting for its Newton–Schulz precision (torch 2.14's "
    "`_zeropower_via_newtonschulz` casts to bf16 unconditionally): the fp32 row patches that one cast "
    "for this benchmark. torch.optim.Muon and emerging-optimizers' Muon take 2-D params only: they step "
    "each expert of a stack as its own 2-D param (a view into the stack), optzoo steps the stack; "
    "torch.optim.AdamW(fused=True) steps their 1-D params. optzoo's defaults include its grad-norm "
    "clip (clip_grad=1.0)."
)


# ---- every kernel the probe may pick ------------------------------------------------------------

SLOW_FIRST_RUN = 3.0
"""A kernel whose first run takes this many times the fastest first run is not repeated: it
cannot win, and on a CPU without bf16 units a bf16 run takes seconds."""


def shape_classes(sizes: Sizes) -> list[tuple[str, tuple[int, int, int]]]:
    """``(model, (batch, rows, cols))`` per batch Muon steps: same-shape matrices of a model batched, a stack whole."""
    classes: list[tuple[str, tuple[int, int, int]]] = []
    for model_name in MODELS:
        counts: dict[tuple[int, int], int] = {}
        for param in MODELS[model_name](sizes).parameters():
            if param.ndim == 3:
                classes.append((model_name, (param.shape[0], param.shape[1], param.shape[2])))
            elif param.ndim == 2 and min(param.shape) > sizes.experts:  # the router goes to AdamW
                counts[(param.shape[0], param.shape[1])] = counts.get((param.shape[0], param.shape[1]), 0) + 1
        classes.extend((model_name, (count, rows, cols)) for (rows, cols), count in counts.items())
    return list(dict.fromkeys(classes))


def kernel_comparison(sizes: Sizes, *, device: str = "cpu", repeats: int = 5, matmul_precision: str = "medium") -> list[list[object]]:
    """Per shape class: every allowed kernel's median time on the whole batch, and what the probe chose.

    The kernels take turns in each repeat (each first run timed apart, as the probe's warm-up is);
    the probe then runs on the same batch from an empty cache, unpinned.
    """
    rows: list[list[object]] = []
    dev = torch.device(device)
    settings = {"steps": 5, "coefficient_type": "quintic", "matmul_precision": matmul_precision}
    for model_name, (batch, rows_, cols) in shape_classes(sizes):
        x = torch.randn(batch, rows_, cols, generator=torch.Generator(dev).manual_seed(0), device=dev)
        kernels = probe.allowed_kernels(matmul_precision, x.dtype, dev, batch, min(rows_, cols))  # type: ignore[arg-type]

        def step(kernel: probe.Kernel, x: torch.Tensor = x) -> Callable[[], object]:
            return _synced(lambda: probe.run_kernel(x, kernel, **settings), dev)  # type: ignore[arg-type]

        first = {}
        for kernel in kernels:
            run = step(kernel)
            start = time.perf_counter()
            run()
            first[str(kernel)] = time.perf_counter() - start
        quickest = min(first.values())
        repeated = {str(k): step(k) for k in kernels if first[str(k)] <= SLOW_FIRST_RUN * quickest}
        medians = round_robin_medians(repeated, repeats) if repeats > 1 else {}
        seconds = {name: medians.get(name, first[name]) for name in first}
        with mock.patch.dict("os.environ", {probe.VARIANT_ENV: "probe"}):
            probe.clear_probe_cache()
            start = time.perf_counter()
            chosen = str(probe.choose_kernel(x, **settings))  # type: ignore[arg-type]
            probe_ms = (time.perf_counter() - start) * 1e3
        best = min(seconds.values())
        for name, value in seconds.items():
            rows.append([
                model_name, f"{batch} x {rows_} x {cols}", name, value * 1e3, value / best,
                "" if name in repeated else "one run", "chosen" if name == chosen else "", probe_ms if name == chosen else "",
            ])  # fmt: skip
    probe.clear_probe_cache()
    return rows


KERNEL_HEADERS = ["model", "batch", "kernel", "median ms", "x fastest", "timed", "probe", "probe ms"]


@pytest.mark.parametrize("batched", [True, False])
def test_muon_step_bench(benchmark: pytest.FixtureRequest, batched: bool) -> None:
    params = gpt_matrices(32, 128, 2, torch.device("cpu"))
    opt = Muon(params, **SETTINGS, batched=batched)  # type: ignore[arg-type]
    benchmark(opt.step)  # type: ignore[operator]


def test_kernel_comparison_runs() -> None:
    rows = kernel_comparison(QUICK, repeats=1)
    chosen = [row for row in rows if row[6] == "chosen"]
    assert [row[:2] for row in chosen] == [[model, f"{b} x {r} x {c}"] for model, (b, r, c) in shape_classes(QUICK)]


def test_compare_runs() -> None:
    count, rows = compare(hidden=16, ffn=64, layers=2, repeats=1)
    assert count == 2 * (3 * 16 * 16 + 16 * 16 + 2 * 64 * 16)
    assert [row[0] for row in rows] == [
        "ours Muon", "ours Muon per-tensor", "upstream Muon", "ours AdaptiveMuon", "upstream AdaptiveMuon",
    ]  # fmt: skip


def _devices(option: str, parser: argparse.ArgumentParser) -> tuple[str, ...]:
    if option == "auto":
        return ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
    devices = tuple(name.strip() for name in option.split(",") if name.strip())
    for name in devices:
        if torch.device(name).type not in ("cpu", "cuda"):
            parser.error(f"--device: {name!r} is not cpu or cuda; expected auto, cpu, cuda or a comma list")
        if name.startswith("cuda") and not torch.cuda.is_available():
            parser.error(f"--device: {name!r} asked for, but torch.cuda.is_available() is False here")
    return devices


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8, help="experts in the MoE stack (torch table)")
    parser.add_argument("--expert-ffn", type=int, default=2816, help="each expert's ffn size (torch table)")
    parser.add_argument("--moment2-method", default="adamuon", choices=["adamuon", "normuon", "namo"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="auto", help="auto (cpu, plus cuda where there is a GPU), cpu, cuda, or a comma list")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads before measuring (default: torch's)")
    parser.add_argument("--table", default="all", choices=["torch", "kernels", "upstream", "all"], help="which tables to print")
    parser.add_argument("--quick", action="store_true", help="toy sizes and one repeat: checks the pipeline, numbers meaningless")
    args = parser.parse_args(argv)
    devices = _devices(args.device, parser)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    sizes = QUICK if args.quick else Sizes(
        hidden=args.hidden, ffn=args.ffn, layers=args.layers, experts=args.experts, expert_ffn=args.expert_ffn
    )  # fmt: skip
    repeats = 1 if args.quick else args.repeats
    print(machine_description(devices))
    if args.table in ("torch", "all"):
        counts = parameter_counts(sizes)
        print(
            f"\nAgainst torch.optim.Muon: GPT blocks ({sizes.layers} layers, hidden {sizes.hidden}, ffn {sizes.ffn}; "
            f"{counts['GPT blocks']:,} params) and MoE experts ({sizes.experts} x {sizes.expert_ffn} x "
            f"{sizes.hidden}, two stacks, router, norm; {counts['MoE experts']:,} params); fp32 params, "
            f"fresh gradients every step; median of {repeats} round-robin repeats, first step timed apart"
        )
        measured = torch_comparison(sizes, devices=devices, repeats=repeats)
        print(torch_table(measured))
        print(TORCH_NOTES)
    if args.table in ("kernels", "all"):
        for device in devices:
            print(
                f"\nEvery Newton-Schulz kernel muon_fp32_matmul_prec='medium' allows, on {device}, per batch Muon steps "
                f"(the two models above); median of {repeats} round-robin repeats; the probe run after, from an empty cache"
            )
            print(tabulate(kernel_comparison(sizes, device=device, repeats=repeats), headers=KERNEL_HEADERS, floatfmt=".3g", tablefmt="github"))
    if args.table in ("upstream", "all"):
        hidden, ffn = (16, 64) if args.quick else (args.hidden, args.ffn)
        for device in devices:
            count, rows = compare(
                hidden=hidden, ffn=ffn, layers=args.layers, moment2_method=args.moment2_method, repeats=repeats, device=device
            )  # fmt: skip
            print(
                f"\nOurs against upstream on {device}: {count / 1e6:.1f}M params in {args.layers} layers "
                f"(hidden {hidden}, ffn {ffn}); fp32_matmul_prec=highest, quintic x 5, "
                f"AdaptiveMuon {args.moment2_method}; median of {repeats} round-robin repeats"
            )
            print(tabulate(rows, headers=HEADERS, floatfmt=".2f"))


if __name__ == "__main__":
    main()

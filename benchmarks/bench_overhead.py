"""What optzoo's step costs beyond its arithmetic: ratios to bare ``torch.optim.AdamW(fused=True)``.

Run: ``.venv/bin/python -m benchmarks.bench_overhead`` (about a minute). Every candidate steps its
own copy of the model with fixed gradients (re-attached before each step, as a backward would
leave them), and all take turns within each repeat (:func:`round_robin_medians`), so the ratios
hold on a loaded machine. The floors are torch's pieces alone: the norm read plus the fused step
(what clipping cannot avoid), and the two bf16 copies plus the fused step.
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable

import torch
from tabulate import tabulate
from torch import nn

from benchmarks._timing import round_robin_medians
from optzoo import OptimizerConfig, get_optimizer
from optzoo.optimizers.precision_adam import PrecisionAwareAdam

LR, WEIGHT_DECAY = 1e-3, 0.1


def stack_model(hidden: int, layers: int) -> nn.Sequential:
    """Linear + LayerNorm layers (the issue's 50.4M model at hidden 1024, 48 layers)."""
    torch.manual_seed(0)
    return nn.Sequential(*(m for _ in range(layers) for m in (nn.Linear(hidden, hidden), nn.LayerNorm(hidden))))


def small_params_model(count: int, size: int) -> nn.ParameterList:
    torch.manual_seed(0)
    return nn.ParameterList(nn.Parameter(torch.randn(size, size) * 0.02) for _ in range(count))


def _with_grads(model: nn.Module, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, list[torch.Tensor]]:
    """A copy of ``model`` in ``dtype`` and one fixed gradient per param."""
    copied = copy.deepcopy(model).to(dtype)
    generator = torch.Generator().manual_seed(1)
    grads = [(torch.randn(p.shape, generator=generator) * 1e-2).to(dtype) for p in copied.parameters()]
    return copied, grads


def _attaching(model: nn.Module, grads: list[torch.Tensor], step: Callable[[], object]) -> Callable[[], object]:
    params = list(model.parameters())

    def run() -> object:
        for param, grad in zip(params, grads, strict=True):
            param.grad = grad
        return step()

    return run


def _bare_fused(model: nn.Module) -> Callable[[], object]:
    replica, grads = _with_grads(model)
    opt = torch.optim.AdamW(replica.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    return _attaching(replica, grads, opt.step)


def _by_hand_clip(model: nn.Module) -> Callable[[], object]:
    replica, grads = _with_grads(model)
    opt = torch.optim.AdamW(replica.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    params = list(replica.parameters())

    def step() -> None:
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()

    return _attaching(replica, grads, step)


def _norm_floor(model: nn.Module) -> Callable[[], object]:
    """The least a clipped step reads: one norm pass over the grads, then the fused step."""
    replica, grads = _with_grads(model)
    opt = torch.optim.AdamW(replica.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)

    def step() -> None:
        torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        opt.step()

    return _attaching(replica, grads, step)


def _grad_scale_floor(model: nn.Module) -> Callable[[], object]:
    """One norm pass, then torch's fused step dividing by a ``grad_scale`` tensor: its kernel also
    writes the divided gradient back, one more pass than the plain fused step."""
    replica, grads = _with_grads(model)
    opt = torch.optim.AdamW(replica.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    scale = torch.tensor(2.0)

    def step() -> None:
        torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        opt.grad_scale = scale  # type: ignore[attr-defined]
        opt.step()

    return _attaching(replica, grads, step)


def _copies_floor(model: nn.Module) -> Callable[[], object]:
    """bf16 params with fp32 mains: the two copies (grad up, param down) and the fused step."""
    replica, grads16 = _with_grads(model, torch.bfloat16)
    params16 = list(replica.parameters())
    mains = [p.detach().float() for p in params16]
    opt = torch.optim.AdamW(mains, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)

    def step() -> None:
        for main, grad in zip(mains, grads16, strict=True):
            main.grad = grad.float()
        opt.step()
        with torch.no_grad():
            torch._foreach_copy_(params16, mains)

    return step


COMPILED: dict[str, PrecisionAwareAdam] = {}
"""The rows' ``PrecisionAwareAdam(compiled=True)`` optimizers, for their first-call (compile) time."""


def _optzoo(model: nn.Module, compiled: str | None = None, **fields: object) -> Callable[[], object]:
    """``get_optimizer``'s step; with ``compiled`` (the row's name), its precision-aware Adam takes
    the compiled update (an opt-in of that optimizer, not a config field)."""
    dtype = torch.bfloat16 if fields.get("bf16") else torch.float32
    replica, grads = _with_grads(model, dtype)
    opt = get_optimizer(OptimizerConfig(lr=LR, weight_decay=WEIGHT_DECAY, **fields), replica)  # type: ignore[arg-type]
    if compiled is not None:
        (inner,) = [o for o in getattr(opt, "optimizers", []) if isinstance(o, PrecisionAwareAdam)]
        inner.compiled = True
        COMPILED[compiled] = inner
    return _attaching(replica, grads, opt.step)


def _bf16_floor(model: nn.Module) -> Callable[[], object]:
    """What a clipped bf16 step with fp32 mains cannot avoid: the gradient copy into fp32 buffers
    kept between steps, one norm pass over them, the fused step dividing by ``grad_scale``, and
    the param copy back to bf16."""
    replica, grads16 = _with_grads(model, torch.bfloat16)
    params16 = list(replica.parameters())
    mains = [p.detach().float() for p in params16]
    buffers = [torch.empty_like(m) for m in mains]
    opt = torch.optim.AdamW(mains, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    scale = torch.tensor(2.0)

    def step() -> None:
        torch._foreach_copy_(buffers, grads16)
        torch.linalg.vector_norm(torch.stack(torch._foreach_norm(buffers)))
        for main, buffer in zip(mains, buffers, strict=True):
            main.grad = buffer
        opt.grad_scale = scale  # type: ignore[attr-defined]
        opt.step()
        with torch.no_grad():
            torch._foreach_copy_(params16, mains)

    return step


def _precision_aware_alone(model: nn.Module, compiled: str | None = None) -> Callable[[], object]:
    """PrecisionAwareAdam by itself on the bf16 params and their bf16 gradients: no fp32 gradient
    copy, no norm, no clip (the wrapper's share is the difference to the rows that use it)."""
    replica, grads = _with_grads(model, torch.bfloat16)
    opt = PrecisionAwareAdam(
        replica.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, master_weights=True, store_param_remainders=True,
        exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16, compiled=compiled is not None,
    )
    if compiled is not None:
        COMPILED[compiled] = opt
    return _attaching(replica, grads, opt.step)


PRECISION_AWARE = {
    "bf16": True, "use_precision_aware_optimizer": True, "exp_avg_dtype": torch.bfloat16,
    "exp_avg_sq_dtype": torch.bfloat16, "store_param_remainders": True,
}  # fmt: skip


def large_rows(hidden: int, layers: int) -> dict[str, Callable[[], object]]:
    model = stack_model(hidden, layers)
    return {
        "torch AdamW(fused=True), bare": _bare_fused(model),
        "clip_grad_norm_(foreach) + AdamW(fused=True), by hand": _by_hand_clip(model),
        "floor: grad norm + AdamW(fused=True)": _norm_floor(model),
        "floor: grad norm + AdamW(fused=True) with grad_scale": _grad_scale_floor(model),
        "optzoo adam, clip_grad=1": _optzoo(model, clip_grad=1.0),
        "optzoo adam, clip_grad=1, fold_clip_and_scale=False": _optzoo(model, clip_grad=1.0, fold_clip_and_scale=False),
        "optzoo adam, clip_grad=0": _optzoo(model, clip_grad=0.0),
        "floor: bf16 copies + AdamW(fused=True)": _copies_floor(model),
        "floor: bf16 copies into buffers + grad norm + AdamW(fused=True) with grad_scale": _bf16_floor(model),
        "optzoo adam, bf16 + fp32 main params, clip 1": _optzoo(model, bf16=True, clip_grad=1.0),
        "PrecisionAwareAdam alone (bf16 grads, no norm, no clip)": _precision_aware_alone(model),
        "PrecisionAwareAdam(compiled=True) alone": _precision_aware_alone(model, compiled="alone"),
        "optzoo adam, bf16 precision-aware (bf16 moments, remainders), clip 1": _optzoo(model, clip_grad=1.0, **PRECISION_AWARE),
        "same, PrecisionAwareAdam(compiled=True)": _optzoo(model, compiled="in the wrapper", clip_grad=1.0, **PRECISION_AWARE),
    }


def small_rows(count: int, size: int) -> dict[str, Callable[[], object]]:
    model = small_params_model(count, size)
    replica, grads = _with_grads(model)
    foreach = torch.optim.AdamW(replica.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, foreach=True)
    return {
        "torch AdamW(fused=True), bare": _bare_fused(model),
        "torch AdamW(foreach=True)": _attaching(replica, grads, foreach.step),
        "clip_grad_norm_(foreach) + AdamW(fused=True), by hand": _by_hand_clip(model),
        "floor: grad norm + AdamW(fused=True)": _norm_floor(model),
        "floor: grad norm + AdamW(fused=True) with grad_scale": _grad_scale_floor(model),
        "optzoo adam, clip_grad=1": _optzoo(model, clip_grad=1.0),
        "optzoo adam, clip_grad=1, fold_clip_and_scale=False": _optzoo(model, clip_grad=1.0, fold_clip_and_scale=False),
    }


def table(rows: dict[str, Callable[[], object]], repeats: int) -> list[list[object]]:
    medians = round_robin_medians(rows, repeats)
    baseline = medians["torch AdamW(fused=True), bare"]
    return [[name, seconds * 1e3, seconds / baseline] for name, seconds in medians.items()]


def test_overhead_table_runs_on_a_tiny_model() -> None:
    """The script's rows build and step (timings are for the script, not the suite)."""
    for rows in (large_rows(hidden=32, layers=2), small_rows(count=8, size=8)):
        result = table(rows, repeats=1)
        assert [row[0] for row in result] == list(rows)
        assert all(row[1] > 0 for row in result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--small-count", type=int, default=2000)
    parser.add_argument("--small-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    headers = ["step", "median (ms)", "vs bare fused AdamW"]
    size = sum(p.numel() for p in stack_model(args.hidden, args.layers).parameters())
    print(f"{torch.get_num_threads()} threads, torch {torch.__version__}, median of {args.repeats} steps, turns taken\n")
    print(f"Linear+LayerNorm stack, hidden {args.hidden}, {args.layers} layers: {size / 1e6:.1f}M params, float32 unless noted")
    print(tabulate(table(large_rows(args.hidden, args.layers), args.repeats), headers=headers, floatfmt=".2f"))
    for row, opt in COMPILED.items():  # each compiles its own variant (bf16 or fp32 gradients)
        seconds = opt.compile_seconds
        print(f"compiled update {row}: first call {seconds:.2f} s, compiling included" if seconds is not None
              else f"compiled update {row}: not compiled ({opt.compile_failure})")
    print(f"\n{args.small_count} params of {args.small_size}x{args.small_size}, float32")
    print(tabulate(table(small_rows(args.small_count, args.small_size), args.repeats), headers=headers, floatfmt=".2f"))


if __name__ == "__main__":
    main()

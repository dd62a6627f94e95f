"""torch.optim's contract, checked on every row of ``optim_db`` (optzoo's OptimizerInfo table).

The expectations come from torch: its ``Optimizer`` base (hooks, ``__getstate__``, state-dict
hooks, the loader turning a number ``step`` into a tensor, global step hooks once per step), its
error inputs (``get_error_inputs_for_all_optims``), and the same optimizer run on a contiguous
copy of each param (layouts) or from a float lr (tensor lr). The deliberate differences are in
``docs/torch-contract.md``; ``test_documented_differences`` asserts each one fails as written there.
"""

from __future__ import annotations

import contextlib
import copy
import io
import math
import pickle
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.optim import optimizer as torch_optimizer
from torch.optim.lr_scheduler import ReduceLROnPlateau, StepLR
from torch.testing._internal.common_optimizers import OptimizerInput, get_error_inputs_for_all_optims

from optzoo import OptimizerConfig, get_optimizer
from optzoo.optimizers.registry import get_spec
from tests.optzoo.optim_db import OptzooOptimizerInfo, ParamsModule, optim_db, wrapper_adapter

DB = optim_db()
CASES = [(row, inp) for row in DB for inp in row.optim_inputs()]
CASE_IDS = [f"{row.name}-{inp.desc}" for row, inp in CASES]
DEFAULTS = [(row, row.optim_inputs()[0]) for row in DB]
DEFAULT_IDS = [row.name for row in DB]


# ---- helpers --------------------------------------------------------------------------------------


def make_params(row: OptzooOptimizerInfo, dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    shapes = [(4, 6), (3, 5)] if row.matrices_only else [(4, 6), (4,), (3, 5)]
    return [torch.nn.Parameter(torch.randn(shape, generator=generator).to(dtype)) for shape in shapes]


def params_for(row: OptzooOptimizerInfo, inp: OptimizerInput, seed: int = 0) -> list[torch.nn.Parameter]:
    """The params a row's input is tried on: 16-bit ones where the input asks for fp16/bf16."""
    dtype = torch.bfloat16 if inp.kwargs.get("bf16") else torch.float16 if inp.kwargs.get("fp16") else torch.float32
    return make_params(row, dtype, seed)


def targets_for(params: list[torch.nn.Parameter], seed: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=generator, dtype=torch.float32) for p in params]


def loss_of(params: list[torch.nn.Parameter], targets: list[torch.Tensor]) -> torch.Tensor:
    return sum(((p.float() - t) ** 2).sum() for p, t in zip(params, targets, strict=True))  # type: ignore[return-value]


def build(row: OptzooOptimizerInfo, params: list[torch.nn.Parameter], inp: OptimizerInput, **extra: Any) -> torch.optim.Optimizer:
    return row.build(params, **inp.kwargs, **extra)


def train(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], targets: list[torch.Tensor], steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_of(params, targets)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def values(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    return [p.detach().clone() for p in params]


def assert_bitwise(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for index, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert a.dtype == b.dtype and a.shape == b.shape, index
        assert torch.equal(a, b), f"param {index}: max difference {(a.float() - b.float()).abs().max()}"


def state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v.detach().clone() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


# ---- copies ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize(("row", "inp"), CASES, ids=CASE_IDS)
def test_a_copy_steps_as_the_original(row: OptzooOptimizerInfo, inp: OptimizerInput, how: str) -> None:
    params = params_for(row, inp)
    targets = targets_for(params)
    opt = build(row, params, inp)
    train(opt, params, targets, 2)
    copied = copy.deepcopy((params, opt)) if how == "deepcopy" else pickle.loads(pickle.dumps((params, opt)))
    params2, opt2 = copied
    assert all(p2 is not p for p, p2 in zip(params, params2, strict=True))
    train(opt, params, targets, 2)
    train(opt2, params2, targets, 2)
    assert_bitwise(values(params2), values(params))
    assert_bitwise(state_tensors(opt2), state_tensors(opt))


@pytest.mark.parametrize(("row", "inp"), DEFAULTS, ids=DEFAULT_IDS)
def test_deepcopy_copies_every_public_attribute(row: OptzooOptimizerInfo, inp: OptimizerInput) -> None:
    # torch's test_deepcopy_copies_all_public_attrs
    params = params_for(row, inp)
    opt = build(row, params, inp)
    public = {k for k in vars(opt) if not k.startswith("_")}
    assert public <= set(vars(copy.deepcopy(opt)))


# ---- hooks ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("row", "inp"), DEFAULTS, ids=DEFAULT_IDS)
def test_step_hooks_run_once_per_step_global_outside_instance(row: OptzooOptimizerInfo, inp: OptimizerInput) -> None:
    # torch runs: global pre hooks, instance pre hooks, step, instance post hooks, global post hooks
    params = params_for(row, inp)
    targets = targets_for(params)
    opt = build(row, params, inp)
    calls: list[int] = []
    handles = [
        torch_optimizer.register_optimizer_step_pre_hook(lambda o, a, k: calls.append(0)),
        opt.register_step_pre_hook(lambda o, a, k: calls.append(1)),
        opt.register_step_post_hook(lambda o, a, k: calls.append(2)),
        torch_optimizer.register_optimizer_step_post_hook(lambda o, a, k: calls.append(5)),
    ]
    try:
        train(opt, params, targets, 1)
        assert calls == [0, 1, 2, 5]
        train(opt, params, targets, 1)
        assert calls == [0, 1, 2, 5] * 2
    finally:
        for handle in handles:
            handle.remove()
    assert not torch_optimizer._global_optimizer_pre_hooks and not torch_optimizer._global_optimizer_post_hooks


@pytest.mark.parametrize(("row", "inp"), DEFAULTS, ids=DEFAULT_IDS)
def test_state_dict_hooks_run_and_may_replace_the_dict(row: OptzooOptimizerInfo, inp: OptimizerInput) -> None:
    params = params_for(row, inp)
    targets = targets_for(params)
    opt = build(row, params, inp)
    train(opt, params, targets, 1)
    calls: list[str] = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("pre"))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "marker": 7})
    saved = opt.state_dict()
    assert calls == ["pre"] and saved["marker"] == 7
    del saved["marker"]
    saved = copy.deepcopy(saved)
    replacement = copy.deepcopy(saved)
    opt.register_load_state_dict_pre_hook(lambda o, sd: (calls.append("load-pre"), replacement)[1])
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load-post"))
    opt.load_state_dict({"not": "a state dict"})  # the pre-hook's return value is what is loaded
    assert calls == ["pre", "load-pre", "load-post"]


# ---- state dicts ----------------------------------------------------------------------------------


def _twin(row: OptzooOptimizerInfo, inp: OptimizerInput, dtype: torch.dtype = torch.float32) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
    params = params_for(row, inp, seed=5)
    return params, build(row, params, inp)


@pytest.mark.parametrize(("row", "inp"), CASES, ids=CASE_IDS)
def test_state_dict_round_trip_is_exact_and_resumes_bitwise(row: OptzooOptimizerInfo, inp: OptimizerInput) -> None:
    params = params_for(row, inp)
    targets = targets_for(params)
    opt = build(row, params, inp)
    train(opt, params, targets, 3)
    saved = copy.deepcopy(opt.state_dict())
    params2, opt2 = _twin(row, inp)
    with torch.no_grad():
        for p2, p in zip(params2, params, strict=True):
            p2.copy_(p)
    opt2.load_state_dict(copy.deepcopy(saved))
    reloaded = opt2.state_dict()
    assert _comparable(reloaded) == _comparable(saved)  # nothing added to or dropped from the groups
    train(opt, params, targets, 2)
    train(opt2, params2, targets, 2)
    assert_bitwise(values(params2), values(params))


def _comparable(state_dict: dict[str, Any]) -> Any:
    """A state dict with its tensors as lists, so two can be compared with ``==``."""
    if isinstance(state_dict, dict):
        return {k: _comparable(v) for k, v in state_dict.items()}
    if isinstance(state_dict, (list, tuple)):
        return type(state_dict)(_comparable(v) for v in state_dict)
    if isinstance(state_dict, torch.Tensor):
        return (str(state_dict.dtype), state_dict.float().tolist())
    return state_dict


@pytest.mark.parametrize(("row", "inp"), CASES, ids=CASE_IDS)
def test_a_number_step_in_a_checkpoint_loads_as_the_tensor_one(row: OptzooOptimizerInfo, inp: OptimizerInput) -> None:
    # torch's test_load_nontensor_step: checkpoints from torch < 1.12 hold `step` as a number
    params = params_for(row, inp)
    targets = targets_for(params)
    opt = build(row, params, inp)
    train(opt, params, targets, 2)
    saved = copy.deepcopy(opt.state_dict())
    as_numbers = copy.deepcopy(saved)
    found = 0
    for state in as_numbers["state"].values():
        if isinstance(state.get("step"), torch.Tensor):
            state["step"] = float(state["step"])
            found += 1
    results = []
    for checkpoint in (saved, as_numbers):
        params2, opt2 = _twin(row, inp)
        with torch.no_grad():
            for p2, p in zip(params2, params, strict=True):
                p2.copy_(p)
        opt2.load_state_dict(copy.deepcopy(checkpoint))
        train(opt2, params2, targets, 2)
        results.append(values(params2))
    assert_bitwise(results[1], results[0])


@pytest.mark.parametrize(("row", "inp"), DEFAULTS, ids=DEFAULT_IDS)
def test_a_checkpoint_without_kernel_keys_loads(row: OptzooOptimizerInfo, inp: OptimizerInput) -> None:
    # torch's test_can_load_older_state_dict: groups saved before foreach/fused/... existed
    params = params_for(row, inp)
    targets = targets_for(params)
    opt = build(row, params, inp)
    train(opt, params, targets, 2)
    saved = copy.deepcopy(opt.state_dict())
    for group in saved["param_groups"]:
        for key in ("foreach", "fused", "capturable", "differentiable", "maximize"):
            group.pop(key, None)
    params2, opt2 = _twin(row, inp)
    with torch.no_grad():
        for p2, p in zip(params2, params, strict=True):
            p2.copy_(p)
    opt2.load_state_dict(saved)
    train(opt, params, targets, 2)
    train(opt2, params2, targets, 2)
    assert_bitwise(values(params2), values(params))


@pytest.mark.parametrize(("row", "inp"), CASES, ids=CASE_IDS)
def test_a_state_dict_saves_and_loads_with_weights_only(row: OptzooOptimizerInfo, inp: OptimizerInput) -> None:
    # torch's test_save_load_equality_with_weights_only: torch.load(weights_only=True), torch's safe default
    params = params_for(row, inp)
    targets = targets_for(params)
    opt = build(row, params, inp)
    train(opt, params, targets, 2)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert _comparable(loaded) == _comparable(opt.state_dict())
    params2, opt2 = _twin(row, inp)
    with torch.no_grad():
        for p2, p in zip(params2, params, strict=True):
            p2.copy_(p)
    opt2.load_state_dict(loaded)
    train(opt, params, targets, 1)
    train(opt2, params2, targets, 1)
    assert_bitwise(values(params2), values(params))


@pytest.mark.parametrize(("row", "inp"), [(r, i) for r, i in DEFAULTS if not r.wrapper], ids=[r.name for r in DB if not r.wrapper])
def test_named_params_save_their_names_and_round_trip(row: OptzooOptimizerInfo, inp: OptimizerInput) -> None:
    # torch >= 2.6: optim_cls(model.named_parameters()) records `param_names` in each group
    params = make_params(row)
    targets = targets_for(params)
    opt = row.build([(f"w{i}", p) for i, p in enumerate(params)], **inp.kwargs)
    train(opt, params, targets, 2)
    saved = copy.deepcopy(opt.state_dict())
    assert saved["param_groups"][0]["param_names"] == [f"w{i}" for i in range(len(params))]
    params2 = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = row.build([(f"w{i}", p) for i, p in enumerate(params2)], **inp.kwargs)
    opt2.load_state_dict(saved)
    assert _comparable(opt2.state_dict()) == _comparable(saved)
    train(opt, params, targets, 1)
    train(opt2, params2, targets, 1)
    assert_bitwise(values(params2), values(params))


@pytest.mark.parametrize(("row", "inp"), [(r, i) for r, i in DEFAULTS if not r.wrapper], ids=[r.name for r in DB if not r.wrapper])
def test_param_groups_keep_their_own_lr(row: OptzooOptimizerInfo, inp: OptimizerInput) -> None:
    # torch's test_param_groups_lr: a group with lr 0 does not move, the other does
    params = make_params(row)
    targets = targets_for(params)
    opt = row.build([{"params": params[:1], "lr": 0.0}, {"params": params[1:]}], **{**inp.kwargs, "lr": 1e-2})
    before = values(params)
    train(opt, params, targets, 2)
    assert torch.equal(params[0].detach(), before[0])
    assert all(not torch.equal(p.detach(), b) for p, b in zip(params[1:], before[1:], strict=True))


# ---- stepping -------------------------------------------------------------------------------------


DIRECTION_CASES = [
    (row, inp, dtype) for row, inp in CASES for dtype in row.dtypes if dtype == torch.float32 or inp.desc == "default"
]  # other dtypes with each row's defaults


@pytest.mark.parametrize(
    ("row", "inp", "dtype"), DIRECTION_CASES, ids=[f"{r.name}-{i.desc}-{str(d)[6:]}" for r, i, d in DIRECTION_CASES]
)
def test_goes_the_right_direction(row: OptzooOptimizerInfo, inp: OptimizerInput, dtype: torch.dtype) -> None:
    # torch's test_forloop_goes_right_direction, on a quadratic
    params = params_for(row, inp) if dtype == torch.float32 else make_params(row, dtype)
    targets = targets_for(params)
    opt = build(row, params, inp)
    losses = train(opt, params, targets, 20)
    assert losses[-1] < losses[0], losses


@pytest.mark.parametrize(("row", "inp"), DEFAULTS, ids=DEFAULT_IDS)
def test_works_under_lr_schedulers(row: OptzooOptimizerInfo, inp: OptimizerInput) -> None:
    params = params_for(row, inp)
    targets = targets_for(params)
    opt = build(row, params, inp)
    lr = opt.param_groups[0]["lr"]
    schedulers: list[Callable[[torch.optim.Optimizer], Any]] = [
        lambda o: StepLR(o, gamma=0.5, step_size=1),
        lambda o: ReduceLROnPlateau(o, factor=0.5, patience=0),
    ]
    for make in schedulers:
        scheduler = make(opt)
        for _ in range(2):
            loss = train(opt, params, targets, 1)[0]
            scheduler.step(1.0) if isinstance(scheduler, ReduceLROnPlateau) else scheduler.step()  # type: ignore[func-returns-value]
        assert loss == loss
    assert all(g["lr"] < lr for g in opt.param_groups)


@pytest.mark.parametrize(("row", "inp"), DEFAULTS, ids=DEFAULT_IDS)
def test_no_grad_is_a_no_op(row: OptzooOptimizerInfo, inp: OptimizerInput) -> None:
    # torch's test_step_is_noop_when_params_have_no_grad and test_step_is_noop_for_zero_grads-like
    params = params_for(row, inp)
    opt = build(row, params, inp)
    before = values(params)
    opt.step()
    assert_bitwise(values(params), before)
    assert not any(opt.state.values())
    targets = targets_for(params)
    opt.zero_grad()
    loss_of(params[:1], targets[:1]).backward()  # the others have no gradient
    opt.step()
    assert_bitwise(values(params)[1:], before[1:])
    assert not torch.equal(params[0].detach(), before[0])


# Decay moves params without a gradient, and so does a projection onto a constraint set (SPEL, Sinkhorn-Muon).
NO_DECAY = [(row, inp) for row, inp in CASES if not inp.kwargs.get("weight_decay") and not row.constrained]


def _retracted_twice(row: OptzooOptimizerInfo, inp: OptimizerInput, opt: torch.optim.Optimizer, before: list[torch.Tensor]) -> list[torch.Tensor]:
    """``before`` after two zero-gradient steps of an algorithm whose every step retracts its
    matrices onto a manifold (the ``riemannian`` family: emerging-optimizers' oblique optimizers
    end each step with ``F.normalize(w, p=2, dim=dim, eps=eps)``): its params retracted twice, in
    float32 for 16-bit params (the fp32 main params), the others unchanged."""
    name = row.algorithm
    if name is None or get_spec(name).family != "riemannian":
        return before
    config = OptimizerConfig(optimizer=name, **inp.kwargs)
    dim, eps = getattr(config, f"{name}_dim"), getattr(config, f"{name}_eps")
    taken = {int(n[1:]) for g in opt.param_groups if g["optimizer"] == name for n in g["param_names"]}  # ParamsModule's p0, p1, ...
    assert taken, "no param went to the algorithm"
    expected = []
    for index, value in enumerate(before):
        if index in taken:
            retracted = torch.nn.functional.normalize(value.float(), p=2.0, dim=dim, eps=eps)
            value = torch.nn.functional.normalize(retracted, p=2.0, dim=dim, eps=eps).to(value.dtype)
        expected.append(value)
    return expected


@pytest.mark.parametrize(("row", "inp"), NO_DECAY, ids=[f"{r.name}-{i.desc}" for r, i in NO_DECAY])
def test_zero_gradients_leave_params_unchanged(row: OptzooOptimizerInfo, inp: OptimizerInput) -> None:
    # torch's test_step_is_noop_for_zero_grads: no weight decay, all-zero gradients. An algorithm
    # that keeps its matrices on a manifold retracts them onto it at every step, gradients or not.
    params = params_for(row, inp)
    extra = {"weight_decay": 0.0} if row.wrapper or "weight_decay" not in inp.kwargs else {}
    opt = build(row, params, inp, **extra)
    before = values(params)
    for _ in range(2):
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
    assert_bitwise(values(params), _retracted_twice(row, inp, opt, before))


@pytest.mark.parametrize(("row", "inp"), CASES, ids=CASE_IDS)
def test_zero_grad_and_repr(row: OptzooOptimizerInfo, inp: OptimizerInput) -> None:
    params = params_for(row, inp)
    targets = targets_for(params)
    opt = build(row, params, inp)
    assert repr(opt).startswith(type(opt).__name__)
    loss_of(params, targets).backward()
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in params)
    opt.zero_grad()
    assert all(p.grad is None for p in params)


@pytest.mark.parametrize(("row", "inp"), DEFAULTS, ids=DEFAULT_IDS)
def test_closure_is_evaluated_with_gradients(row: OptzooOptimizerInfo, inp: OptimizerInput) -> None:
    params = params_for(row, inp)
    targets = targets_for(params)
    opt = build(row, params, inp)
    before = values(params)
    seen: list[bool] = []

    def closure() -> torch.Tensor:
        seen.append(torch.is_grad_enabled())
        opt.zero_grad()
        loss = loss_of(params, targets)
        loss.backward()
        return loss

    with torch.no_grad():
        opt.step(closure)
    assert seen == [True]
    assert any(not torch.equal(a, b) for a, b in zip(values(params), before, strict=True))


@pytest.mark.parametrize("shape", ["0-d", "[1]", "[1, 1]"])
@pytest.mark.parametrize(("row", "inp"), [(r, i) for r, i in DEFAULTS if not r.wrapper], ids=[r.name for r in DB if not r.wrapper])
def test_a_one_element_tensor_lr_steps_as_the_float(row: OptzooOptimizerInfo, inp: OptimizerInput, shape: str) -> None:
    lr = torch.tensor(row.float_lr).reshape({"0-d": (), "[1]": (1,), "[1, 1]": (1, 1)}[shape])
    results = []
    for value in (row.float_lr, lr):
        params = make_params(row)
        targets = targets_for(params)
        opt = row.build(params, **{**inp.kwargs, "lr": value})
        train(opt, params, targets, 3)
        results.append(values(params))
    assert_bitwise(results[1], results[0])


# ---- errors ---------------------------------------------------------------------------------------


ERROR_CASES = [(row, err) for row in DB for err in row.error_inputs()]


@pytest.mark.parametrize(("row", "error"), ERROR_CASES, ids=[f"{r.name}-{e.optimizer_error_input.desc}" for r, e in ERROR_CASES])
def test_error_inputs(row: OptzooOptimizerInfo, error: Any) -> None:
    params = make_params(row)
    before = values(params)
    with pytest.raises(error.error_type, match=error.error_regex):
        row.build(params, **error.optimizer_error_input.kwargs)
    assert_bitwise(values(params), before)


TORCH_ERRORS = [(row, err) for row in DB if not row.wrapper for err in get_error_inputs_for_all_optims("cpu", torch.float32)]


@pytest.mark.parametrize(
    ("row", "error"), TORCH_ERRORS, ids=[f"{r.name}-{e.optimizer_error_input.desc}" for r, e in TORCH_ERRORS]
)
def test_torch_error_inputs_for_all_optimizers(row: OptzooOptimizerInfo, error: Any) -> None:
    # torch's own generic error inputs (on 1x1 params, which every class takes), as torch's test_errors runs them
    inp = error.optimizer_error_input
    params = inp.params if inp.params is not None else make_params(row)
    if issubclass(error.error_type, Warning):
        with pytest.warns(error.error_type, match=error.error_regex):
            row.build(params, **inp.kwargs)
    else:
        with pytest.raises(error.error_type, match=error.error_regex):
            row.build(params, **inp.kwargs)


# ---- global state ---------------------------------------------------------------------------------


def _legacy_matmul_precision() -> str:
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError as error:  # the legacy and per-backend APIs were mixed
        return f"raises: {error}"[:60]


def _global_state() -> dict[str, Any]:
    backends = torch.backends
    return {
        "rng": torch.get_rng_state().tolist(),
        "default dtype": torch.get_default_dtype(),
        "grad mode": torch.is_grad_enabled(),
        "float32 matmul precision": _legacy_matmul_precision(),
        "cuda matmul fp32_precision": backends.cuda.matmul.fp32_precision,
        "mkldnn matmul fp32_precision": backends.mkldnn.matmul.fp32_precision,
        "fp32_precision": backends.fp32_precision,
        "cudnn fp32_precision": backends.cudnn.fp32_precision,
        "deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
        "threads": torch.get_num_threads(),
        "anomaly mode": torch.is_anomaly_enabled(),
        "global step hooks": (len(torch_optimizer._global_optimizer_pre_hooks), len(torch_optimizer._global_optimizer_post_hooks)),
    }


@contextlib.contextmanager
def matmul_settings(legacy: str, *, tf32_off_after: bool = False) -> Iterator[None]:
    """torch's settings as a new process has them (``legacy`` set, the per-backend flags unset); or,
    with ``tf32_off_after``, the legacy API then a per-backend flag, as a user turning TF32 off after
    ``medium`` does: the backends' flags disagree and ``get_float32_matmul_precision`` raises."""
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(legacy)
    if tf32_off_after:
        torch.backends.cuda.matmul.allow_tf32 = False
        with pytest.raises(RuntimeError, match="mix of the legacy and new APIs"):
            torch.get_float32_matmul_precision()
    else:
        torch.backends.cuda.matmul.fp32_precision = "none"
        torch.backends.mkldnn.matmul.fp32_precision = "none"
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved)
        torch.backends.cuda.matmul.fp32_precision = "none"
        torch.backends.mkldnn.matmul.fp32_precision = "none"


def _steps_leave_global_state_as_found(row: OptzooOptimizerInfo, inp: OptimizerInput) -> list[float]:
    """Two training steps and a state-dict copy; the global state compared before and after; the losses."""
    params = params_for(row, inp)
    targets = targets_for(params)
    before = _global_state()
    opt = build(row, params, inp)
    losses = train(opt, params, targets, 2)
    copy.deepcopy(opt).state_dict()
    assert _global_state() == before
    return losses


@pytest.mark.parametrize(("row", "inp"), CASES, ids=CASE_IDS)
def test_global_torch_state_is_left_as_found(row: OptzooOptimizerInfo, inp: OptimizerInput) -> None:
    with matmul_settings("highest"):
        _steps_leave_global_state_as_found(row, inp)


@pytest.mark.parametrize(("row", "inp"), DEFAULTS, ids=DEFAULT_IDS)
def test_mixed_matmul_settings_step_and_are_left_as_found(row: OptzooOptimizerInfo, inp: OptimizerInput) -> None:
    with matmul_settings("medium", tf32_off_after=True):
        losses = _steps_leave_global_state_as_found(row, inp)
    assert all(math.isfinite(loss) for loss in losses)


# ---- documented differences -----------------------------------------------------------------------

DOC = Path(__file__).resolve().parents[2] / "docs" / "torch-contract.md"


def _documented() -> dict[str, tuple[str, str]]:
    """``{id: (exception type, message pattern)}`` from the table of docs/torch-contract.md."""
    rows = {}
    for line in DOC.read_text().splitlines():
        match = re.match(r"^\| (D\d+) \|.*\| `(\w+)`: `(.+)` \|$", line)
        if match:
            rows[match.group(1)] = (match.group(2), match.group(3))
    return rows


def _wrapper(name: str = "adam", **fields: Any) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
    params = [torch.nn.Parameter(torch.randn(4, 6)), torch.nn.Parameter(torch.randn(4))]
    return params, wrapper_adapter(name)(params, **fields)


def _d1() -> None:
    params, opt = _wrapper()
    opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(3))]})


def _d2() -> None:
    params, opt = _wrapper()
    result = opt.step(lambda: loss_of(params, targets_for(params)).backward())  # type: ignore[func-returns-value]
    raise AssertionError(f"step returned {result!r}")


def _d3() -> None:
    params = [torch.nn.Parameter(torch.randn(4, 6))]
    torch_state = torch.optim.AdamW(params).state_dict()
    _, opt = _wrapper()
    opt.load_state_dict(torch_state)


def _d4() -> None:
    OptimizerConfig(lr=1e-3, maximize=True)  # type: ignore[call-arg]


def _d5() -> None:
    OptimizerConfig(lr=torch.tensor(1e-3))  # type: ignore[arg-type]


def _d6() -> None:
    get_optimizer(OptimizerConfig(lr=1e-3, optimizer="lion"), ParamsModule([torch.nn.Parameter(torch.randn(4, 3, dtype=torch.complex64))]), trace=False)


def _d7() -> None:
    embedding = torch.nn.Embedding(10, 4, sparse=True)
    opt = get_optimizer(OptimizerConfig(lr=1e-3), embedding, trace=False)
    embedding(torch.tensor([1, 2])).sum().backward()
    opt.step()


def _d8() -> None:
    from optzoo.optimizers.muon import Muon

    Muon([torch.nn.Parameter(torch.randn(4))])


def _d9() -> None:
    from optzoo.optimizers.precision_adam import PrecisionAwareAdam

    PrecisionAwareAdam([torch.nn.Parameter(torch.randn(4))], differentiable=True)  # type: ignore[call-arg]


def _d10() -> None:
    params = [torch.nn.Parameter(torch.randn(4, 6, dtype=torch.bfloat16)), torch.nn.Parameter(torch.randn(4, dtype=torch.bfloat16))]
    opt = wrapper_adapter("adam")(params, bf16=True)
    loss_of(params, targets_for(params)).backward()
    opt.step()
    grads = [p.grad for p in params]
    opt.zero_grad(set_to_none=False)  # torch's zero gradients come back: the next step steps them (issue #24 item 17)
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 and not p.grad.any() for p in params)
    raise AssertionError(f"grads after step: {grads}")


def _d11() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = get_optimizer(OptimizerConfig(lr=1e-3, optimizer="muon"), model, trace=False)
    torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=4)


SCENARIOS: dict[str, Callable[[], None]] = {
    "D1": _d1, "D2": _d2, "D3": _d3, "D4": _d4, "D5": _d5, "D6": _d6, "D7": _d7, "D8": _d8, "D9": _d9, "D10": _d10,
    "D11": _d11,
}  # fmt: skip


def test_every_documented_difference_has_a_scenario() -> None:
    assert sorted(_documented()) == sorted(SCENARIOS)


@pytest.mark.parametrize("difference", sorted(SCENARIOS))
def test_documented_differences(difference: str) -> None:
    error_type, pattern = _documented()[difference]
    expected = {"TypeError": TypeError, "ValueError": ValueError, "AssertionError": AssertionError}[error_type]
    with pytest.raises(expected, match=pattern):
        SCENARIOS[difference]()


# ---- rows for algorithms registered later -----------------------------------------------------------


def test_an_algorithm_registered_later_gets_a_row_and_keeps_the_contract() -> None:
    from optzoo.optimizers.registry import OptimizerSpec, elementwise_cost, per_element_state, register, unregister

    register(
        OptimizerSpec(
            name="radam_for_contract", description="torch's RAdam", source="torch", family="adam", elementwise=True,
            update_cost=elementwise_cost, shapes="any", state_bytes=per_element_state(2, step=True),
            config_fields=(), instance_fields=(),
            group_options=lambda fields: {}, build=lambda groups, instance: torch.optim.RAdam(groups),
        )
    )  # fmt: skip
    try:
        rows = {row.name: row for row in optim_db()}
        row = rows["get_optimizer[radam_for_contract]"]
        for inp in row.optim_inputs():
            for how in ("deepcopy", "pickle"):
                test_a_copy_steps_as_the_original(row, inp, how)
            test_state_dict_round_trip_is_exact_and_resumes_bitwise(row, inp)
            test_a_number_step_in_a_checkpoint_loads_as_the_tensor_one(row, inp)
            test_goes_the_right_direction(row, inp, torch.float32)
        default = row.optim_inputs()[0]
        test_step_hooks_run_once_per_step_global_outside_instance(row, default)
        test_state_dict_hooks_run_and_may_replace_the_dict(row, default)
        test_no_grad_is_a_no_op(row, default)
    finally:
        unregister("radam_for_contract")


@pytest.mark.parametrize("name", ["lion", "soap"])
def test_a_missing_emerging_optimizers_names_the_module(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from optzoo.optimizers import _emerging

    module = {"lion": "emerging_optimizers.scalar_optimizers.lion", "soap": "emerging_optimizers.soap.soap"}[name]
    monkeypatch.setitem(__import__("sys").modules, module, None)  # `import` of it now raises ImportError
    _emerging._upstream_class.cache_clear()
    try:
        with pytest.raises(ImportError, match=r"^the module `emerging_optimizers` \(package emerging-optimizers==0\.3\.0\) is required"):
            wrapper_adapter(name)([torch.nn.Parameter(torch.randn(4, 6))])
    finally:
        _emerging._upstream_class.cache_clear()

"""Every memory layout of a parameter gets the update its contiguous copy gets (issue #23, item 1).

A parameter may be any strided tensor: transposed, channels-last, a view with gaps between its
elements (``randn(10, 5, 2)[..., 0]``), or empty. Each kernel here must update each element as it
updates the same element of a ``.contiguous()`` copy given the same gradient: bit for bit where
both run the same kernel, and to fp32 rounding against torch's default AdamW otherwise. The
parameter keeps its storage and strides, so the model sees the update.

torch's fused CPU kernels walk their tensors in memory order (``data_ptr`` to ``numel``), so a
param with gaps handed to them as is gets its update written across the gaps. They also take the
last ``numel % 8`` (AVX2; 16 with AVX-512) elements in memory order through a scalar loop that
rounds differently (see ``PrecisionAwareAdam._compiles``): a transposed param puts other elements
there than its contiguous copy does. The bit-for-bit tests therefore use sizes that are whole
vectors (multiples of 16); the tests against torch's default AdamW use odd sizes, tails included.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch import nn

from optzoo import OptimizerConfig, get_optimizer
from optzoo._common import dense_layout, fused_supported
from optzoo.optimizers.adaptive_muon import AdaptiveMuon
from optzoo.optimizers.muon import Muon
from optzoo.optimizers.precision_adam import PrecisionAwareAdam
from optzoo.optimizers.registry import get_spec

LAYOUTS = [
    "contiguous", "transposed", "gapped_last", "gapped_cols", "channels_last", "gapped_channels_last",
    "empty_rows", "empty_cols",
]  # fmt: skip
GAPPED = {"gapped_last", "gapped_cols", "gapped_channels_last"}
WHOLE_VECTORS = {"2-D": (4, 12), "4-D": (2, 3, 4, 2), "empty_rows": (0, 12), "empty_cols": (4, 0)}
"""Sizes of 48 elements: no scalar tail in torch's fused kernels, whatever the layout."""
ODD = {"2-D": (5, 7), "4-D": (3, 2, 5, 3), "empty_rows": (0, 7), "empty_cols": (5, 0)}
STEPS = 3

# Two kernels that differ (torch's fused against its for-loop or foreach) round each of Adam's or
# SGD's few fp32 operations differently, by an ulp or so. Each step rounds the new value once in
# each (an ulp of it: the rtol of 4 ulps covers STEPS steps), and the update's own few-ulp error
# moves it by about lr * 2**-23 per step (the atol: STEPS steps of lr 1e-2, with room).
LR = 1e-2
KERNEL_ATOL, KERNEL_RTOL = 1e-8, 2**-21


def make_layout(name: str, dtype: torch.dtype = torch.float32, sizes: dict[str, tuple[int, ...]] = WHOLE_VECTORS) -> torch.Tensor:
    """Standard-normal values in layout ``name``, made in ``dtype`` (casting a view with gaps
    would give a contiguous tensor), of the shape ``sizes`` gives its kind."""
    kind = name if name.startswith("empty") else "4-D" if "channels_last" in name else "2-D"
    shape = sizes[kind]

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, dtype=dtype)

    if name in ("contiguous", "empty_rows", "empty_cols"):
        return randn(*shape)
    if name == "transposed":
        return randn(shape[1], shape[0]).t()
    if name == "gapped_last":  # the issue's example: every other element of the base
        return randn(*shape, 2)[..., 0]
    if name == "gapped_cols":
        return randn(shape[0], 2 * shape[1])[:, ::2]
    if name == "channels_last":
        return randn(*shape).to(memory_format=torch.channels_last)
    if name == "gapped_channels_last":  # every other channel of a channels-last tensor
        return randn(shape[0], 2 * shape[1], *shape[2:]).to(memory_format=torch.channels_last)[:, ::2]
    raise AssertionError(name)


def contiguous_twin(tensor: torch.Tensor) -> nn.Parameter:
    """The same values in a fresh contiguous tensor."""
    return nn.Parameter(tensor.detach().clone(memory_format=torch.contiguous_format))


def backward(params: Sequence[torch.Tensor], step: int) -> None:
    """Give each param the gradient ``c`` of ``(param * c).sum()``, through autograd (which lays
    it out as it lays out real gradients); the same ``c`` for twins."""
    generator = torch.Generator().manual_seed(step)
    for param in params:
        coefficient = torch.randn(param.shape, generator=generator).to(param.dtype)
        (param * coefficient).sum().backward()


def _step_twins(opt: torch.optim.Optimizer, twin_opt: torch.optim.Optimizer, param: torch.Tensor, twin: torch.Tensor) -> None:
    for step in range(STEPS):
        for o in (opt, twin_opt):
            o.zero_grad()
        backward([param], step)
        backward([twin], step)
        opt.step()
        twin_opt.step()


def assert_same_update(actual: torch.Tensor, expected: torch.Tensor, *, exact: bool) -> None:
    tolerance = {"atol": 0.0, "rtol": 0.0} if exact else {"atol": KERNEL_ATOL, "rtol": KERNEL_RTOL}
    torch.testing.assert_close(actual, expected, **tolerance)


def assert_kept(param: torch.Tensor, stride: tuple[int, ...], pointer: int) -> None:
    assert param.stride() == stride and param.data_ptr() == pointer, "the param must keep its storage and layout"


def _torch_kernel(opt: torch.optim.Optimizer) -> tuple[Any, Any]:
    group = opt.param_groups[0]
    return group.get("fused"), group.get("foreach")


@pytest.mark.parametrize("name", LAYOUTS)
def test_the_layouts_are_what_they_say(name: str) -> None:
    tensor = make_layout(name)
    assert dense_layout(tensor) == (name not in GAPPED)
    assert tensor.is_contiguous() == (name in ("contiguous", "empty_rows", "empty_cols"))
    assert nn.Parameter(tensor).stride() == tensor.stride()  # a Parameter keeps the layout it is given


@pytest.mark.parametrize("name", LAYOUTS)
def test_fused_kernels_are_offered_only_to_params_without_gaps(name: str) -> None:
    # dense layouts keep torch's fused kernel (the fast path); a param with gaps must not get it as is
    assert fused_supported([make_layout(name)]) == (name not in GAPPED)


# ---- torch's Adam, AdamW and SGD: optzoo's kernel choice, and torch's other two kernels ----------

TORCH_ALGORITHMS: dict[str, tuple[str, dict[str, Any], type[torch.optim.Optimizer], dict[str, Any]]] = {
    # name: (registry name, its instance fields, torch class, group options)
    "adamw": ("adam", {"decoupled_weight_decay": True}, torch.optim.AdamW, {"weight_decay": 0.1}),
    "adam_l2": ("adam", {"decoupled_weight_decay": False}, torch.optim.Adam, {"weight_decay": 0.1}),
    "sgd": ("sgd", {}, torch.optim.SGD, {"weight_decay": 0.1, "momentum": 0.9}),
}


def _build_torch(algorithm: str, kernel: str, param: torch.Tensor, **overrides: Any) -> torch.optim.Optimizer:
    registry_name, instance_fields, cls, options = TORCH_ALGORITHMS[algorithm]
    groups = [{"params": [param], "lr": LR, **options, **overrides}]
    if kernel == "optzoo":  # the kernel optzoo's registry picks (fused where torch has it)
        spec = get_spec(registry_name)
        instance = {f: getattr(OptimizerConfig(lr=LR), f) for f in spec.instance_fields} | instance_fields
        return spec.build(groups, instance)
    return cls(groups, foreach=kernel == "foreach")


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("kernel", ["optzoo", "foreach", "forloop"])
@pytest.mark.parametrize("algorithm", list(TORCH_ALGORITHMS))
def test_torch_kernels_update_every_layout_as_its_contiguous_copy(algorithm: str, kernel: str, name: str) -> None:
    param = nn.Parameter(make_layout(name))
    twin = contiguous_twin(param)
    stride, pointer = param.stride(), param.data_ptr()
    opt, twin_opt = _build_torch(algorithm, kernel, param), _build_torch(algorithm, kernel, twin)
    _step_twins(opt, twin_opt, param, twin)
    assert_kept(param, stride, pointer)
    assert_same_update(param, twin, exact=_torch_kernel(opt) == _torch_kernel(twin_opt))
    for key, value in twin_opt.state[twin].items():
        assert_same_update(opt.state[param][key], value, exact=_torch_kernel(opt) == _torch_kernel(twin_opt))


# ---- optzoo's precision-aware Adam --------------------------------------------------------------

PRECISIONS: dict[str, tuple[torch.dtype, dict[str, Any]]] = {
    "fp32": (torch.float32, {}),
    "bf16_master": (torch.bfloat16, {"master_weights": True}),
    "bf16_remainders": (torch.bfloat16, {"master_weights": True, "store_param_remainders": True}),
}
PA_KERNELS: dict[str, dict[str, bool]] = {
    "fused": {"fused": True},
    "foreach": {"fused": False, "foreach": True},
    "plain": {"fused": False, "foreach": False},
}


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("kernel", list(PA_KERNELS))
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_precision_aware_adam_updates_every_layout_as_its_contiguous_copy(precision: str, kernel: str, name: str) -> None:
    dtype, storage = PRECISIONS[precision]
    param = nn.Parameter(make_layout(name, dtype))
    twin = contiguous_twin(param)
    stride, pointer = param.stride(), param.data_ptr()

    def build(p: torch.Tensor) -> PrecisionAwareAdam:
        return PrecisionAwareAdam([p], lr=LR, weight_decay=0.1, **storage, **PA_KERNELS[kernel])

    opt, twin_opt = build(param), build(twin)
    _step_twins(opt, twin_opt, param, twin)
    assert_kept(param, stride, pointer)
    assert opt.param_groups[0]["fused"] == (kernel == "fused")  # a param with gaps keeps the group's kernel
    assert_same_update(param, twin, exact=True)
    for key, value in twin_opt.state[twin].items():
        assert_same_update(opt.state[param][key], value, exact=True)


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("kernel", list(PA_KERNELS))
def test_precision_aware_adam_on_fp32_params_is_torchs_default_adamw(kernel: str, name: str) -> None:
    param = nn.Parameter(make_layout(name, sizes=ODD))
    twin = contiguous_twin(param)
    opt = PrecisionAwareAdam([param], lr=LR, weight_decay=0.1, **PA_KERNELS[kernel])
    _step_twins(opt, torch.optim.AdamW([twin], lr=LR, weight_decay=0.1), param, twin)
    assert_same_update(param, twin, exact=kernel == "plain")  # plain: torch's for-loop, the CPU default


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUTS)
def test_compiled_precision_aware_adam_updates_every_layout_as_its_contiguous_copy(name: str) -> None:
    """Contiguous params whose size is a multiple of 16 take the compiled update, the others the
    fused kernel; the two give the same bits (``PrecisionAwareAdam``'s ``compiled``)."""
    param = nn.Parameter(make_layout(name, torch.bfloat16))
    twin = contiguous_twin(param)
    stride, pointer = param.stride(), param.data_ptr()

    def build(p: torch.Tensor) -> PrecisionAwareAdam:
        return PrecisionAwareAdam([p], lr=LR, weight_decay=0.1, master_weights=True, store_param_remainders=True, compiled=True)

    opt, twin_opt = build(param), build(twin)
    _step_twins(opt, twin_opt, param, twin)
    assert twin_opt.compile_seconds is not None or twin_opt.compile_failure is not None, "the twin takes the compiled update"
    assert_kept(param, stride, pointer)
    assert_same_update(param, twin, exact=True)
    for key, value in twin_opt.state[twin].items():
        assert_same_update(opt.state[param][key], value, exact=True)


# ---- the matrix and sign optimizers alone (the wrapper hands them dense copies; alone they take any) ---

def _layout_free(case: str, weight: torch.Tensor) -> bool:
    """Whether ``case`` steps ``weight`` bit for bit as its contiguous copy, so the twin is one.

    Not SOAP (emerging-optimizers 0.3.0) on a transposed matrix: its matmuls read the transposed
    gradient in another order and round differently, by ulps, and its first steps amplify any ulp
    to about lr (a gradient 1 ulp larger does the same on a contiguous matrix): eigh picks an
    arbitrary basis of the rank-deficient factors' null space, and Adam in that basis is not
    rotation invariant. Its twin then has the same layout: the test shows the wrapper hands SOAP
    the param and its gradient as SOAP would get them alone.
    """
    return not (case == "soap" and weight.dim() == 2 and not weight.is_contiguous())


ALONE: dict[str, Callable[[torch.Tensor], torch.optim.Optimizer]] = {
    "muon": lambda p: Muon([p], lr=LR, weight_decay=0.1),
    "adaptive_muon": lambda p: AdaptiveMuon([p], lr=LR, weight_decay=0.1),
    "lion": lambda p: get_spec("lion").build([{"params": [p], "lr": LR, "weight_decay": 0.1, "betas": (0.95, 0.98)}], {}),
    "soap": lambda p: get_spec("soap").build(
        [{"params": [p], "lr": LR, "weight_decay": 0.1, "betas": (0.9, 0.999), "eps": 1e-8, "shampoo_beta": 0.95}],
        {"soap_precondition_frequency": 1, "soap_use_kl_shampoo": True},
    ),
}


@pytest.mark.parametrize("name", ["contiguous", "transposed", "gapped_last", "gapped_cols"])
@pytest.mark.parametrize("algorithm", list(ALONE))
def test_matrix_and_sign_optimizers_alone_update_every_layout_as_its_contiguous_copy(algorithm: str, name: str) -> None:
    param = nn.Parameter(make_layout(name))
    twin = contiguous_twin(param) if _layout_free(algorithm, param) else nn.Parameter(param.detach().clone())
    stride, pointer = param.stride(), param.data_ptr()
    opt, twin_opt = ALONE[algorithm](param), ALONE[algorithm](twin)
    _step_twins(opt, twin_opt, param, twin)
    assert_kept(param, stride, pointer)
    assert_same_update(param, twin, exact=True)


# ---- the optzoo wrapper: get_optimizer over a model -----------------------------------------------

WRAPPED: dict[str, dict[str, Any]] = {
    "adamw": {"optimizer": "adam"},
    "adam_l2": {"optimizer": "adam", "decoupled_weight_decay": False},
    "adamw_precision_aware": {"optimizer": "adam", "use_precision_aware_optimizer": True},
    "sgd": {"optimizer": "sgd"},
    "lion": {"optimizer": "lion"},
    "muon": {"optimizer": "muon"},
    "adaptive_muon": {"optimizer": "adaptive_muon"},
    "soap": {"optimizer": "soap"},
}


class Holder(nn.Module):
    """``layers.0.weight`` in the layout it is given (a conv's for 4-D, so the Muon family takes
    it flattened), and a contiguous ``layers.0.bias`` beside it in the same group."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor) -> None:
        super().__init__()
        layer = nn.Conv2d(weight.shape[1], weight.shape[0], tuple(weight.shape[2:])) if weight.dim() == 4 else nn.Module()
        layer.weight = nn.Parameter(weight)
        layer.bias = nn.Parameter(bias)
        self.layers = nn.ModuleList([layer])


def _wrapped_twins(case: str, precision: str, name: str) -> tuple[Holder, Holder, OptimizerConfig]:
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    weight = make_layout(name, dtype)
    bias = torch.randn(weight.shape[0], dtype=dtype)
    twin_format = torch.contiguous_format if _layout_free(case, weight) else torch.preserve_format
    model, twin = Holder(weight, bias.clone()), Holder(weight.clone(memory_format=twin_format), bias.clone())
    # No clipping: the global norm sums the gradients in memory order, so its last bit depends on
    # the layout, and a clip coefficient would carry that bit into every update.
    fields = WRAPPED[case] | {"bf16": precision == "bf16", "lr": LR, "weight_decay": 0.1, "clip_grad": 0.0}
    if precision == "fp32" and fields.get("use_precision_aware_optimizer"):
        fields["store_param_remainders"] = False  # remainders complete bf16 params only
    return model, twin, OptimizerConfig(**fields)


def _wrapped(config: OptimizerConfig, model: nn.Module) -> Any:
    return get_optimizer(config.replace(standard_overrides=False), model, {}, trace=False, lint=False)


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("case", list(WRAPPED))
def test_get_optimizer_updates_every_layout_as_its_contiguous_copy(case: str, precision: str, name: str) -> None:
    model, twin, config = _wrapped_twins(case, precision, name)
    weight = model.layers[0].weight
    initial, stride, pointer = weight.detach().clone(), weight.stride(), weight.data_ptr()
    opt, twin_opt = _wrapped(config, model), _wrapped(config, twin)
    for step in range(STEPS):
        opt.zero_grad()
        twin_opt.zero_grad()
        backward(list(model.parameters()), step)
        backward(list(twin.parameters()), step)
        assert opt.step()[0] and twin_opt.step()[0]
    assert model.layers[0].weight is weight
    assert_kept(weight, stride, pointer)
    assert weight.numel() == 0 or not torch.equal(weight, initial), "the model's own param must see the update"
    assert_same_update(weight, twin.layers[0].weight, exact=True)
    assert_same_update(model.layers[0].bias, twin.layers[0].bias, exact=True)
    for inner in opt.optimizers:  # dense params keep torch's fused kernel, whatever their neighbours' layout
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)):
            assert inner.defaults["fused"] is True
    state, twin_state = opt.state_dict()["state"], twin_opt.state_dict()["state"]
    assert state.keys() == twin_state.keys()
    for param_name, values in twin_state.items():
        for key, value in values.items():
            assert_same_update(torch.as_tensor(state[param_name][key]), torch.as_tensor(value), exact=True)


@pytest.mark.parametrize("name", LAYOUTS)
def test_get_optimizer_adamw_is_torchs_default_adamw_on_the_contiguous_copy(name: str) -> None:
    weight = make_layout(name, sizes=ODD)
    model = Holder(weight, torch.randn(weight.shape[0]))
    twin = [contiguous_twin(p) for p in model.parameters()]
    opt = _wrapped(OptimizerConfig(lr=LR, weight_decay=0.1, clip_grad=0.0), model)
    reference = torch.optim.AdamW(twin, lr=LR, weight_decay=0.1)
    for step in range(STEPS):
        opt.zero_grad()
        reference.zero_grad()
        backward(list(model.parameters()), step)
        backward(twin, step)
        opt.step()
        reference.step()
    for param, expected in zip(model.parameters(), twin):
        assert_same_update(param, expected, exact=False)


def _step_wrapped(pairs: Sequence[tuple[Any, nn.Module]], steps: range) -> None:
    for step in steps:
        for opt, model in pairs:
            opt.zero_grad()
            backward(list(model.parameters()), step)
            assert opt.step()[0]


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("case", ["adamw", "adamw_precision_aware"])
def test_a_checkpoint_saved_beside_a_contiguous_param_resumes_on_any_layout(case: str, name: str) -> None:
    model, twin, config = _wrapped_twins(case, "fp32", name)
    twin_opt = _wrapped(config, twin)
    _step_wrapped([(twin_opt, twin)], range(STEPS))
    with torch.no_grad():
        for param, value in zip(model.parameters(), twin.parameters()):
            param.copy_(value)  # the model's layout, the twin's values: as a model checkpoint loads
    opt = _wrapped(config, model)
    opt.load_state_dict(copy.deepcopy(twin_opt.state_dict()))
    _step_wrapped([(opt, model), (twin_opt, twin)], range(STEPS, STEPS + 2))
    assert_same_update(model.layers[0].weight, twin.layers[0].weight, exact=True)


# ---- the issue's example: 20 steps of a least-squares fit ---------------------------------------

def _fit(make_optimizer: Callable[[nn.Module], Any], weight: torch.Tensor) -> list[float]:
    """Losses of 20 steps fitting ``weight`` (10 x 5) to a fixed linear map."""
    generator = torch.Generator().manual_seed(0)
    inputs, target_map = torch.randn(32, 5, generator=generator), torch.randn(10, 5, generator=generator)
    module = nn.Module()
    module.weight = nn.Parameter(weight)
    opt = make_optimizer(module)
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss = (inputs @ module.weight.t() - inputs @ target_map.t()).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


FITTERS: dict[str, Callable[[nn.Module], Any]] = {
    "get_optimizer_adamw": lambda m: _wrapped(OptimizerConfig(lr=0.05, weight_decay=0.0, clip_grad=0.0), m),
    "get_optimizer_sgd": lambda m: _wrapped(OptimizerConfig(optimizer="sgd", lr=0.05, weight_decay=0.0, clip_grad=0.0), m),
    "registry_adamw": lambda m: _build_torch("adamw", "optzoo", m.weight, lr=0.05, weight_decay=0.0),
    "precision_aware_adam_fused": lambda m: PrecisionAwareAdam(m.parameters(), lr=0.05, fused=True),
}


@pytest.mark.parametrize("fitter", list(FITTERS))
def test_the_issues_example_learns_as_torchs_default_adamw_does(fitter: str) -> None:
    base = torch.randn(10, 5, 2)
    expected = _fit(lambda m: torch.optim.AdamW(m.parameters(), lr=0.05, weight_decay=0.0), base[..., 0].clone())
    assert expected[-1] < 0.5 * expected[0]
    losses = _fit(FITTERS[fitter], base[..., 0])
    assert losses[-1] < 0.5 * losses[0], f"the loss must go down, as torch's default AdamW's does: {losses}"
    if "adam" in fitter:  # the same algorithm, other kernels: 20 steps of fp32 rounding apart
        assert losses[-1] == pytest.approx(expected[-1], rel=1e-4)


# ---- what cannot be stepped ----------------------------------------------------------------------

def test_a_param_whose_elements_share_memory_is_refused_by_name() -> None:
    model = Holder(torch.randn(1, 7).expand(5, 7), torch.zeros(5))
    with pytest.raises(ValueError, match=r"`layers\.0\.weight`: elements share memory .*; got strides \(0, 1\) for shape \(5, 7\)"):
        _wrapped(OptimizerConfig(lr=LR), model)

"""MixedPrecisionOptimizer.step: global-norm clipping, zero counting, timers, and data errors."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch

from optzoo import OptimizerConfig, ParamKey, get_optimizer
from tests.conftest import fill_grads, tiny_gpt, tokens, twin


def _steps_beside_torch_clipping(
    model: torch.nn.Module, config: OptimizerConfig, steps: int = 5
) -> Iterator[tuple[tuple[bool, float | None, int | None], float, torch.nn.Module]]:
    """Step ``model`` with ``config`` beside a twin clipped by ``clip_grad_norm_`` and stepped by
    fused AdamW, on the same gradients; yields ours, the reference norm and the twin each step."""
    reference_model = twin(model)
    ours = get_optimizer(config.replace(standard_overrides=False), model, {})
    reference = torch.optim.AdamW(reference_model.parameters(), lr=config.lr, weight_decay=config.weight_decay, fused=True)
    generator_a, generator_b = torch.Generator().manual_seed(2), torch.Generator().manual_seed(2)
    for _ in range(steps):
        fill_grads(list(model.parameters()), generator_a)
        fill_grads(list(reference_model.parameters()), generator_b)
        expected_norm = torch.nn.utils.clip_grad_norm_(list(reference_model.parameters()), config.clip_grad)
        result = ours.step()
        reference.step()
        yield result, float(expected_norm), reference_model


def test_clipping_in_passes_equals_torch_clip_grad_norm_then_adamw(odd_model: torch.nn.Module) -> None:
    config = OptimizerConfig(lr=1e-2, weight_decay=0.0, clip_grad=0.5, fold_clip_and_scale=False)
    for (success, norm, zeros), expected_norm, reference_model in _steps_beside_torch_clipping(odd_model, config):
        assert success is True and zeros is None
        assert norm == pytest.approx(expected_norm, rel=1e-6)
    for p, q in zip(odd_model.parameters(), reference_model.parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0)


def test_folded_clipping_rounds_each_gradient_once_and_stays_within_two_ulps_of_torch(odd_model: torch.nn.Module) -> None:
    """The fused kernel divides each gradient by 1/coefficient where torch multiplies it by the
    coefficient: one rounding against one, so the clipped gradients agree to 2 ulps. Adam's
    update is about lr per element whatever the gradient's scale, so a 2-ulp gradient moves each
    step by about lr * 2**-22: after 5 steps the params agree to 5 * lr * 2**-21."""
    config = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.5)
    for (success, norm, _), expected_norm, reference_model in _steps_beside_torch_clipping(odd_model, config):
        assert success is True and norm == pytest.approx(expected_norm, rel=1e-6)
        for p, q in zip(odd_model.parameters(), reference_model.parameters()):
            assert p.grad is not None and q.grad is not None  # the kernel wrote the clipped gradient back
            torch.testing.assert_close(p.grad, q.grad, atol=0, rtol=2**-22)
    for p, q in zip(odd_model.parameters(), reference_model.parameters()):
        torch.testing.assert_close(p, q, atol=5 * 1e-2 * 2**-21, rtol=2**-22)


@pytest.mark.parametrize("fold", [True, False])
def test_a_step_that_clips_nothing_is_torchs_adamw_bit_for_bit(odd_model: torch.nn.Module, fold: bool) -> None:
    config = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=1e6, fold_clip_and_scale=fold)
    reference_model = twin(odd_model)
    ours = get_optimizer(config.replace(standard_overrides=False), odd_model, {})
    reference = torch.optim.AdamW(reference_model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    generator_a, generator_b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    for _ in range(3):
        fill_grads(list(odd_model.parameters()), generator_a)
        fill_grads(list(reference_model.parameters()), generator_b)
        assert ours.step()[0] is True
        reference.step()
    for p, q in zip(odd_model.parameters(), reference_model.parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0)


def test_clip_coefficient_is_megatrons_and_applies_only_below_one() -> None:
    param = torch.nn.Parameter(torch.zeros(4))
    model = torch.nn.Module()
    model.register_parameter("weight", param)
    opt = get_optimizer(OptimizerConfig(optimizer="sgd", lr=1.0, sgd_momentum=0.0, weight_decay=0.0, clip_grad=1.0), model, {})
    param.grad = torch.tensor([3.0, 4.0, 0.0, 0.0])  # norm 5 -> scaled by 1 / (5 + 1e-6)
    _, norm, _ = opt.step()
    assert norm == 5.0
    torch.testing.assert_close(param.detach(), -torch.tensor([3.0, 4.0, 0.0, 0.0]) / (5.0 + 1e-6), atol=0, rtol=0)
    param.grad = torch.tensor([0.5, 0.0, 0.0, 0.0])  # norm below clip_grad: untouched
    before = param.detach().clone()
    opt.step()
    torch.testing.assert_close(param.detach(), before - torch.tensor([0.5, 0.0, 0.0, 0.0]), atol=0, rtol=0)


def test_no_clipping_and_no_norm_when_clip_grad_is_zero(gpt: torch.nn.Module) -> None:
    opt = get_optimizer(OptimizerConfig(lr=1e-3, clip_grad=0.0), gpt)
    gpt.loss(tokens()).backward()
    grads = [p.grad.clone() for p in gpt.parameters()]
    assert opt.step() == (True, None, None)
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, gpt.parameters()))


def test_num_zeros_in_grad_is_counted() -> None:
    model = torch.nn.Linear(3, 2)
    opt = get_optimizer(OptimizerConfig(lr=1e-3, log_num_zeros_in_grad=True), model)
    model.weight.grad = torch.tensor([[0.0, 1.0, 0.0], [2.0, 0.0, 3.0]])
    model.bias.grad = torch.tensor([0.0, 0.0])
    assert opt.step()[2] == 5


def test_params_without_grads_are_skipped(gpt: torch.nn.Module) -> None:
    opt = get_optimizer(OptimizerConfig(lr=1e-3), gpt)
    gpt.output_layer.weight.grad = torch.ones_like(gpt.output_layer.weight)
    before = gpt.embedding.word_embeddings.weight.detach().clone()
    opt.step()
    assert torch.equal(before, gpt.embedding.word_embeddings.weight)
    assert gpt.embedding.word_embeddings.weight not in opt.state


def test_sparse_gradient_raises_and_changes_nothing() -> None:
    model = tiny_gpt()
    opt = get_optimizer(OptimizerConfig(lr=1e-2), model, {ParamKey(name="decoder.*"): {"optimizer": "lion"}})
    model.loss(tokens()).backward()
    opt.step()
    model.loss(tokens()).backward()
    params_before = [p.detach().clone() for p in model.parameters()]
    state_before = {p: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    model.output_layer.weight.grad = model.output_layer.weight.grad.to_sparse()
    with pytest.raises(ValueError, match=r"`output_layer.weight`: sparse gradients are not supported; got a sparse torch.sparse_coo gradient"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(params_before, model.parameters()))
    for p, s in state_before.items():
        assert all(torch.equal(v, opt.state[p][k]) for k, v in s.items())


def test_closure_is_evaluated_with_grad_enabled(gpt: torch.nn.Module) -> None:
    opt = get_optimizer(OptimizerConfig(lr=1e-3), gpt)
    batch = tokens()
    calls = []

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = gpt.loss(batch)
        loss.backward()
        calls.append(loss.item())
        return loss

    success, norm, _ = opt.step(closure)
    assert success and len(calls) == 1 and norm is not None and norm > 0


def test_timers_time_the_step_phases(gpt: torch.nn.Module) -> None:
    events: list[tuple[str, str, object]] = []

    class Timer:
        def __init__(self, name: str) -> None:
            self.name = name

        def start(self, barrier: bool = False) -> None:
            events.append(("start", self.name, barrier))

        def stop(self) -> None:
            events.append(("stop", self.name, None))

    def timers(name: str, log_level: int = 0) -> Timer:
        assert log_level == 1
        return Timer(name)

    opt = get_optimizer(OptimizerConfig(lr=1e-3, timers=timers, barrier_with_L1_time=True, log_num_zeros_in_grad=True), gpt)
    gpt.loss(tokens()).backward()
    opt.step()
    phases = [
        "optimizer-copy-to-main-grad", "optimizer-unscale-and-check-inf", "optimizer-clip-main-grad",
        "optimizer-count-zeros", "optimizer-inner-step", "optimizer-copy-main-to-model-params",
    ]
    assert events == [e for phase in phases for e in (("start", phase, True), ("stop", phase, None))]


def test_zero_grad_clears_every_group(gpt: torch.nn.Module) -> None:
    opt = get_optimizer(OptimizerConfig(lr=1e-3), gpt, {ParamKey(name="*.weight"): {"optimizer": "sgd"}})
    gpt.loss(tokens()).backward()
    opt.zero_grad()
    assert all(p.grad is None for p in gpt.parameters())


# ---- folded clip and loss scale (fold_clip_and_scale) ------------------------------------------

from torch.overrides import TorchFunctionMode  # noqa: E402

HOST_READS = ("item", "__float__", "__bool__", "__int__", "tolist")


class CountHostReads(TorchFunctionMode):
    """Every tensor value read on the host (a device sync on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if getattr(func, "__name__", "") in HOST_READS:
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _train(model: torch.nn.Module, config: OptimizerConfig, steps: int, *, seed: int = 5, grad_scale: float = 1.0) -> list[tuple[bool, float | None]]:
    opt = get_optimizer(config.replace(standard_overrides=False), model, {})
    generator = torch.Generator().manual_seed(seed)
    results = []
    for _ in range(steps):
        for param in model.parameters():
            param.grad = (torch.randn(param.shape, generator=generator) * grad_scale).to(param.dtype)
        success, norm, _ = opt.step()
        results.append((success, norm))
    return results


@pytest.mark.parametrize("optimizer", ["lion", "muon", "soap", "sgd"])
def test_folding_is_bitwise_the_passes_where_the_factor_is_one_multiply(optimizer: str) -> None:
    """Without a fused grad_scale kernel the factor is one foreach multiply by the same
    coefficient the clip pass uses: bitwise the separate passes. Fused kernels (SGD, and the adam
    that takes Muon's and SOAP's other params) divide instead: 2 ulps per gradient."""
    config = OptimizerConfig(optimizer=optimizer, lr=1e-2, clip_grad=0.5)
    folded, passes = tiny_gpt(), tiny_gpt()
    passes.load_state_dict(folded.state_dict())
    opt = get_optimizer(config.replace(standard_overrides=False), folded, {})
    in_kernel = {name for g in opt.param_groups if g["optimizer"] in ("adam", "sgd") for name in g["param_names"]}
    assert _train(folded, config, 3) == _train(passes, config.replace(fold_clip_and_scale=False), 3)
    for (name, p), q in zip(folded.named_parameters(), passes.parameters(), strict=True):
        if name in in_kernel:
            torch.testing.assert_close(p, q, atol=3 * 1e-2 * 2**-21, rtol=2**-21)
        else:
            torch.testing.assert_close(p, q, atol=0, rtol=0, msg=name)
    assert (optimizer in ("sgd",)) == (len(in_kernel) == len(list(folded.parameters())))


@pytest.mark.parametrize("precision", [{"fp16": True}, {"bf16": True}, {"fp16": True, "loss_scale": 1024.0}])
@pytest.mark.parametrize("adam", [{}, {"use_precision_aware_optimizer": True, "store_param_remainders": False}])
def test_a_power_of_two_loss_scale_without_clipping_is_folded_bit_for_bit(precision: dict[str, object], adam: dict[str, object]) -> None:
    """Dividing by a power-of-two scale in the kernel is exact, as is the passes' multiply by its
    inverse, so fp16/bf16 steps that clip nothing are bitwise the same either way."""
    dtype = torch.float16 if precision.get("fp16") else torch.bfloat16
    config = OptimizerConfig(lr=1e-2, clip_grad=1e6, **precision, **adam)  # type: ignore[arg-type]
    folded = tiny_gpt().to(dtype)
    passes = twin(folded)
    results = _train(folded, config, 4, grad_scale=1e-3)
    assert results == _train(passes, config.replace(fold_clip_and_scale=False), 4, grad_scale=1e-3)
    assert all(success for success, _ in results)
    for p, q in zip(folded.parameters(), passes.parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0)


@pytest.mark.parametrize(
    "fields", [{}, {"bf16": True}, {"fp16": True, "loss_scale": 1024.0}, {"bf16": True, "use_precision_aware_optimizer": True}]
)
def test_a_folded_step_reads_the_device_once_and_the_passes_up_to_twice(fields: dict[str, object]) -> None:
    dtype = torch.float16 if fields.get("fp16") else torch.bfloat16 if fields else torch.float32
    scale = float(fields.get("loss_scale", 1.0))  # type: ignore[arg-type]
    for fold, most in ((True, 1), (False, 2 if fields.get("fp16") else 1)):
        model = tiny_gpt().to(dtype)
        opt = get_optimizer(OptimizerConfig(lr=1e-2, clip_grad=0.1, fold_clip_and_scale=fold, **fields), model, {})  # type: ignore[arg-type]
        for seed in (0, 1):  # the first step builds the state; the second is measured
            generator = torch.Generator().manual_seed(seed)
            for param in model.parameters():
                param.grad = (torch.randn(param.shape, generator=generator) * scale).to(dtype)
            with CountHostReads() as counter:
                success, norm, _ = opt.step()
        assert success is True and norm is not None and norm > 0.1
        assert len(counter.reads) == most, (fold, counter.reads)


@pytest.mark.parametrize("fields", [{}, {"bf16": True}, {"fp16": True}])
@pytest.mark.parametrize("optimizer", ["adam", "sgd", "lion", "muon"])
def test_a_folded_step_with_an_inf_grad_changes_nothing(fields: dict[str, object], optimizer: str) -> None:
    dtype = torch.float16 if fields.get("fp16") else torch.bfloat16 if fields else torch.float32
    model = tiny_gpt().to(dtype)
    opt = get_optimizer(OptimizerConfig(optimizer=optimizer, lr=1e-2, clip_grad=0.1, **fields), model, {})  # type: ignore[arg-type]
    fill_grads(list(model.parameters()), torch.Generator().manual_seed(0))
    assert opt.step()[0] is True
    before = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
    fill_grads(list(model.parameters()), torch.Generator().manual_seed(1))
    next(model.parameters()).grad.view(-1)[3] = float("inf")  # type: ignore[union-attr]
    assert opt.step() == (False, None, None)
    after = opt.state_dict(), model.state_dict()
    for old, new in zip(before, after, strict=True):
        flat_old, flat_new = _tensors(old), _tensors(new)
        assert flat_old.keys() == flat_new.keys()
        for key in flat_old:
            assert torch.equal(flat_old[key], flat_new[key]), key


def _tensors(tree: object, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    if isinstance(tree, dict):
        return {k: v for key, value in tree.items() for k, v in _tensors(value, f"{prefix}.{key}").items()}
    if isinstance(tree, (list, tuple)):
        return {k: v for i, value in enumerate(tree) for k, v in _tensors(value, f"{prefix}[{i}]").items()}
    return {}


# ---- step_on_device: the skip decision without a host read ------------------------------------


@pytest.mark.parametrize(
    "fields",
    [
        {"clip_grad": 0.1},
        {"clip_grad": 1e6},
        {"clip_grad": 0.0},
        {"clip_grad": 0.1, "bf16": True},
        {"clip_grad": 0.1, "fp16": True, "loss_scale": 1024.0},
        {"clip_grad": 0.1, "bf16": True, "use_precision_aware_optimizer": True},
        {"clip_grad": 0.1, "optimizer": "sgd"},
    ],
)
def test_step_on_device_is_step_bit_for_bit_and_reads_nothing(fields: dict[str, object]) -> None:
    dtype = torch.float16 if fields.get("fp16") else torch.bfloat16 if fields.get("bf16") else torch.float32
    scale = float(fields.get("loss_scale", 1.0))  # type: ignore[arg-type]
    config = OptimizerConfig(lr=1e-2, weight_decay=0.1, **fields)  # type: ignore[arg-type]
    on_host, on_device = tiny_gpt().to(dtype), None
    on_device = twin(on_host)
    host_opt, device_opt = get_optimizer(config, on_host, {}), get_optimizer(config, on_device, {})
    for seed in range(3):
        for model in (on_host, on_device):
            generator = torch.Generator().manual_seed(seed)
            for param in model.parameters():
                param.grad = (torch.randn(param.shape, generator=generator) * scale).to(dtype)
        success, norm, _ = host_opt.step()
        with CountHostReads() as counter:
            device_success, device_norm, zeros = device_opt.step_on_device()
        assert counter.reads == []
        assert device_success.dtype == torch.bool and device_success.shape == () and zeros is None
        assert bool(device_success) is success is True
        assert (device_norm is None) == (norm is None)
        if norm is not None:
            assert device_norm is not None and float(device_norm) == norm
    for p, q in zip(on_host.parameters(), on_device.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=0, rtol=0)
    assert _tensors(host_opt.state_dict()["state"]).keys() == _tensors(device_opt.state_dict()["state"]).keys()
    for key, value in _tensors(host_opt.state_dict()["state"]).items():
        assert torch.equal(value, _tensors(device_opt.state_dict()["state"])[key]), key


@pytest.mark.parametrize("fields", [{}, {"bf16": True}, {"bf16": True, "use_precision_aware_optimizer": True}, {"optimizer": "sgd"}])
def test_step_on_device_with_an_inf_grad_changes_nothing(fields: dict[str, object]) -> None:
    dtype = torch.bfloat16 if fields.get("bf16") else torch.float32
    model = tiny_gpt().to(dtype)
    opt = get_optimizer(OptimizerConfig(lr=1e-2, clip_grad=0.1, **fields), model, {})  # type: ignore[arg-type]
    fill_grads(list(model.parameters()), torch.Generator().manual_seed(0))
    assert bool(opt.step_on_device()[0]) is True
    before = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
    fill_grads(list(model.parameters()), torch.Generator().manual_seed(1))
    next(model.parameters()).grad.view(-1)[3] = float("nan")  # type: ignore[union-attr]
    success, norm, _ = opt.step_on_device()
    assert bool(success) is False and norm is not None and not bool(torch.isfinite(norm))
    for old, new in zip(before, (opt.state_dict(), model.state_dict()), strict=True):
        flat_old, flat_new = _tensors(old), _tensors(new)
        assert flat_old.keys() == flat_new.keys()
        for key in flat_old:
            assert torch.equal(flat_old[key], flat_new[key]), key


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"optimizer": "lion"}, r"inner optimizer Lion \(lion\)"),
        ({"optimizer": "muon"}, r"inner optimizer Muon \(muon\)"),
        ({"fp16": True}, r"a DynamicGradScaler \(its hysteresis is host logic\)"),
        ({"log_num_zeros_in_grad": True}, r"log_num_zeros_in_grad=True"),
        ({"fold_clip_and_scale": False}, r"fold_clip_and_scale=False"),
    ],
)
def test_step_on_device_names_what_needs_the_host_and_changes_nothing(fields: dict[str, object], named: str) -> None:
    dtype = torch.float16 if fields.get("fp16") else torch.float32
    model = tiny_gpt().to(dtype)
    opt = get_optimizer(OptimizerConfig(lr=1e-2, **fields), model, {})  # type: ignore[arg-type]
    fill_grads(list(model.parameters()), torch.Generator().manual_seed(0))
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"^`step_on_device`: these need the host; got .*" + named):
        opt.step_on_device()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_step_on_device_refuses_the_compiled_precision_aware_update() -> None:
    """``PrecisionAwareAdam(compiled=True)`` skips on a host read of ``found_inf``."""
    from optzoo.optimizers.precision_adam import PrecisionAwareAdam

    model = tiny_gpt().to(torch.bfloat16)
    fields = {"bf16": True, "use_precision_aware_optimizer": True, "store_param_remainders": True}
    opt = get_optimizer(OptimizerConfig(lr=1e-2, **fields), model, {})  # type: ignore[arg-type]
    (inner,) = [o for o in opt.optimizers if isinstance(o, PrecisionAwareAdam)]
    inner.compiled = True
    fill_grads(list(model.parameters()), torch.Generator().manual_seed(0))
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"^`step_on_device`: these need the host; got inner optimizer PrecisionAwareAdam "
                       r"\(adam\) with compiled=True \(it reads found_inf on the host\); expected "):
        opt.step_on_device()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())

"""REKLS, PSGD-Pro and the oblique optimizers through get_optimizer: each equals emerging-optimizers'
class stepped directly on the same params (fp32, and bf16 with fp32 main params), takes 2-D
matrices only (the rest goes to ``muon_scalar_optimizer``, saying why), and validates its fields by name."""

from __future__ import annotations

import copy
import zlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
import transformers
from emerging_optimizers.psgd.psgd import PSGDPro
from emerging_optimizers.riemannian_optimizers.normalized_optimizer import ObliqueAdam, ObliqueSGD
from emerging_optimizers.soap.rekls import REKLS

from optzoo import OptimizerConfig, ParamKey, get_optimizer, resolve_group_configs
from tests.conftest import fill_grads, train_with_resumed_twin, twin

CONFIGS = {
    "rekls": OptimizerConfig(
        optimizer="rekls", lr=3e-3, weight_decay=0.1, rekls_beta1=0.8, rekls_beta2=0.9, rekls_eps=1e-7, rekls_shampoo_beta=0.9, clip_grad=0.0,
    ),
    "psgd_pro": OptimizerConfig(
        optimizer="psgd_pro", lr=3e-3, weight_decay=0.1, psgd_pro_momentum=0.8, psgd_pro_beta_lip=0.7, psgd_pro_precond_lr=0.2,
        psgd_pro_min_precond_lr=0.05, psgd_pro_precond_init_scale=0.5, psgd_pro_damping_noise_scale=0.01,
        psgd_pro_warmup_steps=3, psgd_pro_max_update_rms=0.5, clip_grad=0.0,
    ),
    "oblique_sgd": OptimizerConfig(
        optimizer="oblique_sgd", lr=3e-2, weight_decay=0.1, oblique_sgd_momentum=0.8, oblique_sgd_dim=1, oblique_sgd_eps=1e-6, clip_grad=0.0,
    ),
    "oblique_adam": OptimizerConfig(
        optimizer="oblique_adam", lr=3e-2, weight_decay=0.1, oblique_adam_beta1=0.8, oblique_adam_beta2=0.95, oblique_adam_dim=0,
        oblique_adam_eps=1e-6, oblique_adam_correct_bias=False, clip_grad=0.0,
    ),
}  # fmt: skip
NAMES = list(CONFIGS)


def _psgd(params: list[torch.Tensor], group: dict[str, Any]) -> torch.optim.Optimizer:
    keys = ("lr", "weight_decay", "momentum", "beta_lip", "precond_lr", "min_precond_lr")
    return PSGDPro(
        [{"params": params, **{k: group[k] for k in keys}}], precond_init_scale=0.5, damping_noise_scale=0.01, warmup_steps=3,
        max_update_rms=0.5,
    )  # fmt: skip


UPSTREAM: dict[str, Callable[[list[torch.Tensor], dict[str, Any]], torch.optim.Optimizer]] = {
    "rekls": lambda params, g: REKLS([{"params": params, **{k: g[k] for k in ("lr", "weight_decay", "betas", "eps", "shampoo_beta")}}], lr=g["lr"]),
    "psgd_pro": _psgd,
    "oblique_sgd": lambda params, g: ObliqueSGD([{"params": params, **{k: g[k] for k in ("lr", "weight_decay", "momentum", "dim", "eps")}}]),
    "oblique_adam": lambda params, g: ObliqueAdam(
        [{"params": params, **{k: g[k] for k in ("lr", "weight_decay", "betas", "dim", "eps", "correct_bias")}}]
    ),
}
"""Upstream's class built directly, with the hyperparameters optzoo put in the group (each
also checked against the config's fields in :func:`test_groups_carry_the_fields_as_upstream_names_them`)."""


class Reference:
    """Upstream stepped directly on ``params`` (name -> tensor): PSGD one instance per param, each
    step under torch's generator seeded with ``crc32("<name>:<step>")`` (optzoo's documented noise
    seed), with upstream's ``torch.compile``d functions run as plain torch ops; the others one instance."""

    def __init__(self, name: str, groups: list[dict[str, Any]], params: dict[str, torch.Tensor]) -> None:
        self.name, self.steps = name, 0
        if name == "psgd_pro":
            self.each = [(n, UPSTREAM[name]([params[n]], g)) for g in groups for n in g["param_names"]]
        else:
            self.each = [("", UPSTREAM[name]([params[n] for n in g["param_names"]], g)) for g in groups]

    def step(self) -> None:
        for param_name, optimizer in self.each:
            if self.name == "psgd_pro":
                torch.manual_seed(zlib.crc32(f"{param_name}:{self.steps}".encode()))
                with torch._dynamo.config.patch(disable=True):
                    optimizer.step()
            elif self.name == "rekls":  # upstream's with dynamo off: what optzoo runs for CPU params
                with torch._dynamo.config.patch(disable=True):
                    optimizer.step()
            else:
                optimizer.step()
        self.steps += 1

    def state(self, param: torch.Tensor) -> dict[str, Any]:
        return next(o.state[param] for _, o in self.each if param in o.state)


def _same_state(ours: dict[str, Any], theirs: dict[str, Any], msg: str) -> None:
    assert set(theirs) <= set(ours), msg
    for key, value in theirs.items():
        if isinstance(value, list):
            for index, (a, b) in enumerate(zip(ours[key], value, strict=True)):
                torch.testing.assert_close(a, b, atol=0, rtol=0, msg=f"{msg} {key}[{index}]")
        elif isinstance(value, torch.Tensor):
            torch.testing.assert_close(ours[key], value, atol=0, rtol=0, msg=f"{msg} {key}")
        else:
            assert ours[key] == value, (msg, key)


@pytest.mark.parametrize("name", NAMES)
def test_equals_the_upstream_class_on_the_matrices_bit_for_bit(name: str, odd_model: torch.nn.Module) -> None:
    """Same arithmetic, same order: REKLS and PSGD run upstream's functions eagerly (optzoo's CPU
    path; upstream's class with dynamo off) and the oblique
    classes plain torch, so the results are equal bit for bit, params and state, over 8 steps."""
    reference_model = twin(odd_model)
    ours = get_optimizer(CONFIGS[name], odd_model, {})
    groups = [g for g in ours.param_groups if g["optimizer"] == name]
    assert [n for g in groups for n in g["param_names"]] == [
        "layers.0.qkv.weight", "layers.0.proj.weight", "layers.1.qkv.weight", "layers.1.proj.weight",
    ]  # fmt: skip
    by_name = dict(reference_model.named_parameters())
    reference = Reference(name, groups, by_name)
    generator_a, generator_b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    for _ in range(8):
        fill_grads(list(odd_model.parameters()), generator_a)
        fill_grads(list(reference_model.parameters()), generator_b)
        torch.manual_seed(99)  # optzoo's PSGD noise does not depend on the caller's generator
        assert ours.step()[0]
        reference.step()
    for group in groups:
        for param_name, param in zip(group["param_names"], group["params"]):
            torch.testing.assert_close(param, by_name[param_name], atol=0, rtol=0, msg=param_name)
            _same_state(ours.state[param], reference.state(by_name[param_name]), param_name)


@pytest.mark.parametrize("name", NAMES)
def test_bf16_steps_fp32_main_params_as_upstream_steps_fp32_copies(name: str) -> None:
    """bf16 params with fp32 main params: the main params equal upstream's class stepped on fp32
    copies with the bf16 gradients widened, bit for bit, and the model params are those rounded."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3)).to(torch.bfloat16)
    masters = {n: torch.nn.Parameter(p.detach().float().clone()) for n, p in model.named_parameters()}
    ours = get_optimizer(CONFIGS[name].replace(bf16=True), model, {ParamKey(name="*.weight"): {"optimizer": name}}, trace=False)
    groups = [g for g in ours.param_groups if g["optimizer"] == name]
    assert [n for g in groups for n in g["param_names"]] == ["0.weight", "2.weight"]
    reference = Reference(name, groups, masters)
    generator = torch.Generator().manual_seed(7)
    for _ in range(6):
        fill_grads(list(model.parameters()), generator)
        for param_name, p in model.named_parameters():
            masters[param_name].grad = p.grad.float()
        assert ours.step()[0]
        reference.step()
    main = {entry.name: entry.main for entry in ours.param_map.local}
    for param_name in ("0.weight", "2.weight"):
        assert main[param_name].dtype == torch.float32
        torch.testing.assert_close(main[param_name], masters[param_name].detach(), atol=0, rtol=0, msg=param_name)
        assert torch.equal(model.get_parameter(param_name), masters[param_name].detach().to(torch.bfloat16)), param_name


def test_groups_carry_the_fields_as_upstream_names_them(odd_model: torch.nn.Module) -> None:
    expected = {
        "rekls": {"betas": (0.8, 0.9), "eps": 1e-7, "shampoo_beta": 0.9},
        "psgd_pro": {"momentum": 0.8, "beta_lip": 0.7, "precond_lr": 0.2, "min_precond_lr": 0.05},
        "oblique_sgd": {"momentum": 0.8, "dim": 1, "eps": 1e-6},
        "oblique_adam": {"betas": (0.8, 0.95), "dim": 0, "eps": 1e-6, "correct_bias": False},
    }
    for name, options in expected.items():
        ours = get_optimizer(CONFIGS[name], odd_model, {})
        for group in (g for g in ours.param_groups if g["optimizer"] == name):
            assert {k: group[k] for k in options} == options, name
    psgd = next(o for o in get_optimizer(CONFIGS["psgd_pro"], odd_model, {}).optimizers if type(o).__name__ == "PSGDPro")
    assert (psgd.precond_init_scale, psgd.damping_noise_scale, psgd.warmup_steps, psgd.max_update_rms) == (0.5, 0.01, 3, 0.5)
    assert psgd.weight_decay_method == "decoupled"


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_round_trip_continues_identically_on_matrices(name: str, odd_model: torch.nn.Module) -> None:
    """Resumed after step 2 of 6 from a copy of the state dict: the same params, bit for bit (PSGD's
    noise too: it is drawn from the param's name and step, not from the caller's generator)."""
    _, resumed = train_with_resumed_twin(odd_model, CONFIGS[name], steps=6, resume_after=2)
    for (param_name, p), q in zip(odd_model.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), param_name


def test_psgd_noise_is_the_params_own_whatever_the_callers_generator() -> None:
    results = []
    for caller_seed in (0, 1):
        torch.manual_seed(5)
        model = torch.nn.Linear(6, 4, bias=False)
        optimizer = get_optimizer(CONFIGS["psgd_pro"], model, {ParamKey(name="*"): {"optimizer": "psgd_pro"}}, trace=False)
        generator = torch.Generator().manual_seed(2)
        for _ in range(3):
            fill_grads(list(model.parameters()), generator)
            torch.manual_seed(caller_seed)
            optimizer.step()
        results.append(model.weight.detach().clone())
        after = torch.rand(1)
        torch.manual_seed(caller_seed)
        assert torch.equal(after, torch.rand(1))  # the caller's generator is left as it was
    assert torch.equal(results[0], results[1])


def test_a_cpu_psgd_step_compiles_nothing(odd_model: torch.nn.Module) -> None:
    """Upstream ``torch.compile``s eight PSGD functions; CPU params run them eagerly."""
    from torch._dynamo.utils import counters

    optimizer = get_optimizer(CONFIGS["psgd_pro"], odd_model, {})
    torch._dynamo.reset()
    counters.clear()
    fill_grads(list(odd_model.parameters()), torch.Generator().manual_seed(1))
    optimizer.step()
    assert sum(counters["frames"].values()) == 0, dict(counters["frames"])


def test_psgd_steps_float64_params_with_float64_factors() -> None:
    """Upstream's float32 identity factors do not contract with a float64 momentum (RuntimeError in
    tensordot); optzoo keeps float64 factors for float64 params."""
    model = torch.nn.Linear(6, 4, bias=False).double()
    optimizer = get_optimizer(CONFIGS["psgd_pro"], model, {ParamKey(name="*"): {"optimizer": "psgd_pro"}}, trace=False)
    fill_grads(list(model.parameters()), torch.Generator().manual_seed(2))
    assert optimizer.step()[0]
    state = optimizer.state[model.weight]
    assert [q.dtype for q in state["Q"]] == [torch.float64] * 2 and state["exp_avg"].dtype == torch.float64
    assert torch.isfinite(model.weight).all()


def test_psgd_refuses_16_bit_params_without_main_params_by_name() -> None:
    model = torch.nn.Linear(6, 4, bias=False).to(torch.bfloat16)
    with pytest.raises(ValueError, match=(
        r"^`weight`: psgd_pro steps float32 or float64 params \(upstream's Kronecker factors are float32 and its "
        r"contractions need one dtype\); got a torch.bfloat16 param; expected bf16=True or fp16=True \(float32 main "
        r"params\), or a float32 model$"
    )):  # fmt: skip
        get_optimizer(CONFIGS["psgd_pro"], model, {ParamKey(name="*"): {"optimizer": "psgd_pro"}}, trace=False)


@pytest.mark.parametrize("name", ["oblique_sgd", "oblique_adam"])
def test_oblique_keeps_each_slice_on_the_unit_sphere(name: str) -> None:
    """The retraction after every step: unit-norm columns (dim 0) or rows (dim 1), from any start."""
    config = CONFIGS[name]
    dim = getattr(config, f"{name}_dim")
    model = torch.nn.Linear(7, 5, bias=False)
    optimizer = get_optimizer(config, model, {ParamKey(name="*"): {"optimizer": name}}, trace=False)
    fill_grads(list(model.parameters()), torch.Generator().manual_seed(4))
    optimizer.step()
    norms = model.weight.detach().double().norm(dim=dim)
    assert norms.shape == (model.weight.shape[1 - dim],)
    torch.testing.assert_close(norms, torch.ones_like(norms), atol=1e-6, rtol=0)


def _moe_with_conv() -> torch.nn.Module:
    config = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    model = transformers.Qwen3MoeForCausalLM(config)
    model.stem = torch.nn.Conv2d(3, 4, 3)  # a conv filter beside the transformer
    return model


@pytest.mark.parametrize("name", NAMES)
def test_expert_stacks_and_conv_filters_go_to_the_scalar_optimizer_saying_why(name: str) -> None:
    model = _moe_with_conv()
    groups, _ = resolve_group_configs(CONFIGS[name], model)
    by_name = {n: g for g in groups for n in g.param_names}
    stacks = [n for n, p in model.named_parameters() if p.dim() == 3]
    assert stacks and "stem.weight" in by_name
    for param_name in [*stacks, "stem.weight"]:
        group = by_name[param_name]
        assert group.optimizer == "adam", param_name
        assert group.auto_routed == f"auto: {name} takes 2-D only -> muon_scalar_optimizer='adam'", param_name
    assert by_name["model.layers.0.self_attn.q_proj.weight"].optimizer == name
    assert by_name["model.embed_tokens.weight"].optimizer == "adam"


@pytest.mark.parametrize("name", NAMES)
def test_a_rule_routing_a_stack_there_is_refused_by_name(name: str) -> None:
    model = _moe_with_conv()
    with pytest.raises(ValueError, match=rf"routed to {name} by rule #0 name='stem.weight'; got a param {name} does not take \(2-D only\)"):
        get_optimizer(CONFIGS[name], model, {ParamKey(name="stem.weight"): {"optimizer": name}})


@pytest.mark.parametrize(
    ("field", "value", "error", "message"),
    [
        ("rekls_beta1", 1.0, ValueError, r"`OptimizerConfig.rekls_beta1`: must lie in \[0, 1\); got 1.0; expected 0 <= rekls_beta1 < 1"),
        ("rekls_beta2", -0.1, ValueError, r"`OptimizerConfig.rekls_beta2`: must lie in \[0, 1\); got -0.1"),
        ("rekls_shampoo_beta", 1.5, ValueError, r"`OptimizerConfig.rekls_shampoo_beta`: must lie in \[0, 1\); got 1.5"),
        ("rekls_eps", 0.0, ValueError, r"`OptimizerConfig.rekls_eps`: must be positive; got 0.0; expected a float > 0"),
        ("rekls_eps", "1e-8", TypeError, r"`OptimizerConfig.rekls_eps`: wrong type; got '1e-8' \(str\)"),
        ("psgd_pro_momentum", 1.0, ValueError, r"`OptimizerConfig.psgd_pro_momentum`: must lie in \[0, 1\); got 1.0"),
        ("psgd_pro_beta_lip", -0.5, ValueError, r"`OptimizerConfig.psgd_pro_beta_lip`: must lie in \[0, 1\); got -0.5"),
        ("psgd_pro_precond_lr", 0.0, ValueError, r"`OptimizerConfig.psgd_pro_precond_lr`: must be positive; got 0.0; expected a float > 0"),
        ("psgd_pro_precond_init_scale", -1.0, ValueError, r"`OptimizerConfig.psgd_pro_precond_init_scale`: must be positive; got -1.0"),
        ("psgd_pro_min_precond_lr", -0.01, ValueError, r"`OptimizerConfig.psgd_pro_min_precond_lr`: must be non-negative; got -0.01; expected a float >= 0"),
        ("psgd_pro_damping_noise_scale", -0.1, ValueError, r"`OptimizerConfig.psgd_pro_damping_noise_scale`: must be non-negative; got -0.1"),
        ("psgd_pro_max_update_rms", float("nan"), ValueError, r"`OptimizerConfig.psgd_pro_max_update_rms`: must be finite; got nan"),
        ("psgd_pro_warmup_steps", 0, ValueError, r"`OptimizerConfig.psgd_pro_warmup_steps`: must be a positive integer; got 0; expected an int >= 1"),
        ("psgd_pro_warmup_steps", 10.0, TypeError, r"`OptimizerConfig.psgd_pro_warmup_steps`: wrong type; got 10.0 \(float\)"),
        ("oblique_sgd_momentum", 1.0, ValueError, r"`OptimizerConfig.oblique_sgd_momentum`: must lie in \[0, 1\); got 1.0"),
        ("oblique_sgd_dim", 2, ValueError, r"`OptimizerConfig.oblique_sgd_dim`: must be 0 or 1; got 2; expected 0 \(unit-norm columns\) or 1 \(unit-norm rows\)"),
        ("oblique_sgd_dim", True, TypeError, r"`OptimizerConfig.oblique_sgd_dim`: wrong type; got True \(bool\)"),
        ("oblique_sgd_eps", 0.0, ValueError, r"`OptimizerConfig.oblique_sgd_eps`: must be positive; got 0.0"),
        ("oblique_adam_beta1", 1.0, ValueError, r"`OptimizerConfig.oblique_adam_beta1`: must lie in \[0, 1\); got 1.0"),
        ("oblique_adam_beta2", 1.0, ValueError, r"`OptimizerConfig.oblique_adam_beta2`: must lie in \[0, 1\); got 1.0"),
        ("oblique_adam_dim", -1, ValueError, r"`OptimizerConfig.oblique_adam_dim`: must be 0 or 1; got -1"),
        ("oblique_adam_eps", -1e-8, ValueError, r"`OptimizerConfig.oblique_adam_eps`: must be positive; got -1e-08"),
        ("oblique_adam_correct_bias", 1, TypeError, r"`OptimizerConfig.oblique_adam_correct_bias`: wrong type; got 1 \(int\)"),
    ],
)  # fmt: skip
def test_fields_are_validated_by_name(field: str, value: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=f"^{message}"):
        OptimizerConfig(**{field: value})  # type: ignore[arg-type]


def test_a_per_group_field_is_validated_naming_the_group() -> None:
    model = torch.nn.Linear(6, 4)
    with pytest.raises(ValueError, match=r"param group #0 \(rules #0 name='\*'\): `OptimizerConfig.oblique_sgd_dim`: must be 0 or 1; got 3"):
        get_optimizer(CONFIGS["oblique_sgd"], model, {ParamKey(name="*"): {"oblique_sgd_dim": 3}})


def test_rekls_with_huge_finite_grads_skips_with_nothing_changed() -> None:
    """Gradients of 1e16 overflow REKLS's float32 factors G·Gᵀ (its eigh then fails to converge,
    as SOAP's): the step is skipped with params and state as they were, and the next equals a twin's."""
    model = torch.nn.Linear(6, 4, bias=False)
    config = CONFIGS["rekls"]
    rule = {ParamKey(name="*"): {"optimizer": "rekls"}}
    reference_model = twin(model)
    optimizer, reference = get_optimizer(config, model, rule, trace=False), get_optimizer(config, reference_model, rule, trace=False)
    generator = torch.Generator().manual_seed(1)
    grad = torch.randn(4, 6, generator=generator)
    for m, o in ((model, optimizer), (reference_model, reference)):
        m.weight.grad = grad.clone()
        assert o.step()[0]
    before = (model.weight.detach().clone(), {k: v.clone() if torch.is_tensor(v) else v for k, v in optimizer.state[model.weight].items()})
    model.weight.grad = torch.randn(4, 6, generator=generator) * 1e16
    assert optimizer.step()[0] is False
    assert torch.equal(model.weight, before[0])
    _same_state(optimizer.state[model.weight], before[1], "after the skipped step")
    grad = torch.randn(4, 6, generator=generator)
    for m, o in ((model, optimizer), (reference_model, reference)):
        m.weight.grad = grad.clone()
        assert o.step()[0]
    assert torch.equal(model.weight, reference_model.weight)


def test_a_verified_step_checks_the_tensors_psgd_keeps_in_lists() -> None:
    """A non-finite Kronecker factor (in PSGD's state list) makes the verified step a skip, with
    the params and state as they were, even while the param itself came out finite."""
    from optzoo.wrapper import step_guards

    model = torch.nn.Linear(6, 4, bias=False)
    optimizer = get_optimizer(CONFIGS["psgd_pro"], model, {ParamKey(name="*"): {"optimizer": "psgd_pro"}}, trace=False)
    inner = next(o for o in optimizer.optimizers if type(o).__name__ == "PSGDPro")
    fill_grads(list(model.parameters()), torch.Generator().manual_seed(1))
    assert optimizer.step()[0]
    kept = step_guards.snapshot(inner, [model.weight])
    assert any(t is inner.state[model.weight]["Q"][1] for t in step_guards.tensors_of(inner, kept))
    before = (model.weight.detach().clone(), [q.clone() for q in inner.state[model.weight]["Q"]])
    original = type(inner)._step_param

    def poisoning(self: Any, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        original(self, p, group, state)
        state["Q"][1][0, 0] = float("inf")  # as an overflowed factor fit would leave it

    fill_grads(list(model.parameters()), torch.Generator().manual_seed(2))
    type(inner)._step_param = poisoning
    try:
        assert optimizer.step()[0] is False
    finally:
        type(inner)._step_param = original
    assert torch.equal(model.weight, before[0])
    assert all(torch.equal(q, b) for q, b in zip(inner.state[model.weight]["Q"], before[1], strict=True))


@pytest.mark.parametrize(("name", "key"), [("oblique_sgd", "momentum_buffer"), ("oblique_adam", "exp_avg_sq"), ("rekls", "Q_L")])
def test_a_checkpoint_with_a_wrong_shaped_moment_is_refused_by_name_changing_nothing(name: str, key: str) -> None:
    model = torch.nn.Linear(6, 4, bias=False)
    optimizer = get_optimizer(CONFIGS[name], model, {ParamKey(name="*"): {"optimizer": name}}, trace=False)
    fill_grads(list(model.parameters()), torch.Generator().manual_seed(1))
    assert optimizer.step()[0]
    saved = copy.deepcopy(optimizer.state_dict())
    kept = {k: v.clone() if torch.is_tensor(v) else v for k, v in optimizer.state[model.weight].items()}
    saved["state"]["weight"][key] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=rf"`weight`: state `{key}` shape differs; got \(3, 3\) in the checkpoint; expected \("):
        optimizer.load_state_dict(saved)
    _same_state(optimizer.state[model.weight], kept, "after the refused load")

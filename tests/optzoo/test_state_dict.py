"""State dicts keyed by names: exact resume, reordered models, and clear mismatch errors."""

from __future__ import annotations

import copy
import io
import re

import pytest
import torch

from optzoo import OptimizerConfig, ParamKey, get_optimizer
from tests.conftest import tiny_gpt, tokens, twin

CONFIG = OptimizerConfig(lr=3e-3, decoupled_lr=1e-3, weight_decay=0.1)
OVERRIDES = {
    ParamKey(name="decoder.layers.*.mlp.linear_fc*.weight"): {"optimizer": "lion", "lr": 3e-4},
    ParamKey(name="decoder.layers.1.self_attention.*.weight"): {"optimizer": "sgd", "lr": 1e-2},
}


def _overrides() -> dict[ParamKey, dict[str, object]]:
    from optzoo import get_standard_config_overrides

    return {**get_standard_config_overrides(CONFIG), **OVERRIDES}


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, batches: list[torch.Tensor]) -> None:
    for batch in batches:
        opt.zero_grad()
        model.loss(batch).backward()
        opt.step()


def _roundtrip(state: dict[str, object]) -> dict[str, object]:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def test_resume_after_save_and_load_is_bitwise_identical() -> None:
    batches = [tokens() for _ in range(10)]
    straight = tiny_gpt()
    resumed = twin(straight)

    opt = get_optimizer(CONFIG, straight, _overrides())
    _train(straight, opt, batches)

    first_opt = get_optimizer(CONFIG, resumed, _overrides())
    _train(resumed, first_opt, batches[:5])
    model_state, opt_state = _roundtrip(resumed.state_dict()), _roundtrip(first_opt.state_dict())

    fresh = tiny_gpt()
    fresh.load_state_dict(model_state)
    fresh_opt = get_optimizer(CONFIG, fresh, _overrides())
    fresh_opt.load_state_dict(opt_state)
    _train(fresh, fresh_opt, batches[5:])

    assert {type(o).__name__ for o in fresh_opt.optimizers} == {"AdamW", "Lion", "SGD"}
    for (name, p), q in zip(straight.named_parameters(), fresh.parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0, msg=name)
    for (p, q) in zip(straight.parameters(), fresh.parameters()):
        for key, value in opt.state[p].items():
            torch.testing.assert_close(value, fresh_opt.state[q][key], atol=0, rtol=0)


def test_state_dict_is_keyed_by_names_and_round_trips_exactly(gpt: torch.nn.Module) -> None:
    opt = get_optimizer(CONFIG, gpt, _overrides())
    _train(gpt, opt, [tokens() for _ in range(2)])
    state = opt.state_dict()
    assert set(state["state"]) == {n for n, _ in gpt.named_parameters()}
    assert set(state["state"]["output_layer.weight"]) == {"step", "exp_avg", "exp_avg_sq"}
    assert set(state["state"]["decoder.layers.0.mlp.linear_fc1.weight"]) == {"exp_avg"}
    saved = copy.deepcopy(state)
    opt.param_groups[0]["lr"] = 123.0
    opt.load_state_dict(saved)
    again = opt.state_dict()
    assert again["param_groups"] == saved["param_groups"]
    for name, values in saved["state"].items():
        for key, value in values.items():
            torch.testing.assert_close(again["state"][name][key], value, atol=0, rtol=0)
            assert again["state"][name][key] is not value  # loaded as a copy, not aliased


class Reordered(torch.nn.Module):
    """The tiny GPT's modules registered in another order: same names, other positions."""

    def __init__(self) -> None:
        super().__init__()
        source = tiny_gpt()
        self.output_layer = source.output_layer
        self.decoder = source.decoder
        self.embedding = source.embedding

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        logits = self.output_layer(self.decoder(self.embedding(batch[:, :-1])))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def test_a_reordered_model_loads_by_name() -> None:
    model = tiny_gpt()
    opt = get_optimizer(CONFIG.replace(decoupled_lr=None, standard_overrides=False), model, {})
    _train(model, opt, [tokens() for _ in range(2)])

    other = Reordered()
    other.load_state_dict(model.state_dict())
    assert [n for n, _ in other.named_parameters()][0] == "output_layer.weight"
    other_opt = get_optimizer(CONFIG.replace(decoupled_lr=None, standard_overrides=False), other, {})
    other_opt.load_state_dict(_roundtrip(opt.state_dict()))
    by_name = dict(other.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(other_opt.state[by_name[name]]["exp_avg"], opt.state[param]["exp_avg"], atol=0, rtol=0)


def _snapshot(opt: torch.optim.Optimizer) -> tuple[list[dict[str, object]], dict[int, dict[str, torch.Tensor]]]:
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return copy.deepcopy(groups), {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}


@pytest.mark.parametrize(
    ("mutate", "pattern"),
    [
        (lambda s: s["state"].__setitem__("decoder.layers.9.mlp.linear_fc1.weight", {}),
         r"`state_dict`: state for unknown parameter; got 'decoder.layers.9.mlp.linear_fc1.weight'"),
        (lambda s: s["param_groups"][0]["param_names"].append("decoder.layers.9.extra.weight"),
         r"`state_dict`: parameter names do not match this model; got names only in the checkpoint: \[decoder.layers.9.extra.weight\]; expected also: \[\]"),
        (lambda s: s["param_groups"][0]["param_names"].remove("decoder.layers.0.mlp.linear_fc1.weight"),
         r"names only in the checkpoint: \[\]; expected also: \[decoder.layers.0.mlp.linear_fc1.weight\]"),
        (lambda s: s["param_groups"][0].__setitem__("optimizer", "sgd"),
         r"`state_dict`: param group #0 \(decoder.layers.0.self_attention.linear_qkv.weight, ...\) uses optimizer 'adam'; got 'sgd' in the checkpoint"),
        (lambda s: s.__setitem__("format", "torch"), r"`state_dict`: not an optzoo optimizer state dict; got format 'torch'"),
    ],
)
def test_mismatched_checkpoints_raise_and_change_nothing(gpt: torch.nn.Module, mutate: object, pattern: str) -> None:
    opt = get_optimizer(CONFIG, gpt)
    _train(gpt, opt, [tokens()])
    state = copy.deepcopy(opt.state_dict())
    mutate(state)  # type: ignore[operator]
    before = _snapshot(opt)
    with pytest.raises(ValueError, match=pattern):
        opt.load_state_dict(state)
    after = _snapshot(opt)
    assert before[0] == after[0]
    for key, values in before[1].items():
        assert all(torch.equal(v, after[1][key][k]) for k, v in values.items())


def test_changed_routing_is_a_clear_error(gpt: torch.nn.Module) -> None:
    opt = get_optimizer(CONFIG.replace(decoupled_lr=None, standard_overrides=False), gpt, {})
    _train(gpt, opt, [tokens()])
    other = get_optimizer(CONFIG.replace(decoupled_lr=None, standard_overrides=False), twin(gpt), {ParamKey(name="*.bias"): {"wd_mult": 0.0}})
    # Issue 28: the refusal names the params that moved (here every bias, to a group without weight decay).
    with pytest.raises(ValueError, match=r"`state_dict`: the routing \(param group and optimizer\) of 13 params differs from the checkpoint's; got "
                       r"decoder.layers.0.input_layernorm.bias: group #0 adam -> group #1 adam; .*; \.\.\. \(\+8 more\); expected the routing it was saved with"):
        other.load_state_dict(opt.state_dict())


def test_tied_parameter_loads_under_either_name(tied_gpt: torch.nn.Module) -> None:
    opt = get_optimizer(CONFIG, tied_gpt)
    _train(tied_gpt, opt, [tokens()])
    state = copy.deepcopy(opt.state_dict())
    # A checkpoint that recorded the tied tensor under its other name still loads.
    state["state"]["output_layer.weight"] = state["state"].pop("embedding.word_embeddings.weight")
    for group in state["param_groups"]:
        group["param_names"] = ["output_layer.weight" if n == "embedding.word_embeddings.weight" else n for n in group["param_names"]]
    fresh_opt = get_optimizer(CONFIG, twin(tied_gpt))
    fresh_opt.load_state_dict(state)
    weight = fresh_opt.param_groups[1]["params"][0]
    torch.testing.assert_close(fresh_opt.state[weight]["exp_avg"], opt.state[tied_gpt.embedding.word_embeddings.weight]["exp_avg"])


def test_the_kernel_choice_is_this_processs_not_the_checkpoints() -> None:
    """A checkpoint saved where Adam ran ``foreach`` (another device, or a distributed rank that
    owned none of a group's params) resumes on ``fused`` here, and exactly: the kernel is chosen
    per process, and fused CPU Adam rounds differently from foreach."""
    model = tiny_gpt()
    opt = get_optimizer(CONFIG, model)
    assert {g["fused"] for g in opt.param_groups if g["optimizer"] == "adam"} == {True}
    saved = copy.deepcopy(opt.state_dict())
    for group in saved["param_groups"]:
        group.update(fused=None, foreach=True)
    opt.load_state_dict(saved)
    assert [(g["fused"], g["foreach"]) for g in opt.param_groups] == [(True, None)] * len(opt.param_groups)
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in saved["param_groups"]]


# ---- wrapper prefixes and missing per-param state (issue 25, item 6) ----------------------------


def _trained(model: torch.nn.Module, config: OptimizerConfig) -> torch.optim.Optimizer:
    opt = get_optimizer(config, model)
    torch.manual_seed(3)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return opt


def _two_layers() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))


def _wrapped(kind: str, model: torch.nn.Module) -> torch.nn.Module:
    if kind == "compile":
        return torch.compile(model)  # an OptimizedModule: names gain `_orig_mod.` (never run, so never compiled)
    if kind == "data_parallel":
        return torch.nn.DataParallel(model)  # names gain `module.` (no GPU: it only wraps)
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model[0] = checkpoint_wrapper(model[0])  # type: ignore[index]  # `0._checkpoint_wrapped_module.weight`
    return model


@pytest.mark.parametrize("kind", ["compile", "data_parallel", "checkpoint_wrapper"])
def test_checkpoint_keys_are_canonical_and_load_across_wrappers(kind: str) -> None:
    bare_names = [name for name, _ in _two_layers().named_parameters()]  # the expectation: the bare model's names
    wrapped = _wrapped(kind, _two_layers())
    assert [name for name, _ in wrapped.named_parameters()] != bare_names  # the wrapper does add a component
    config = OptimizerConfig(lr=1e-2, optimizer="adam")
    saved = copy.deepcopy(_trained(wrapped, config).state_dict())
    assert sorted(saved["state"]) == sorted(bare_names)
    assert sorted(n for g in saved["param_groups"] for n in g["param_names"]) == sorted(bare_names)
    # torch's own API names them the same way (it keeps DataParallel's `module.`, which optzoo drops too)
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    other = _wrapped(kind, _two_layers())
    if kind != "data_parallel":
        assert sorted(get_optimizer_state_dict(other, _trained(other, config))["state"]) == sorted(bare_names)
    # wrapped -> bare, and bare -> wrapped, every tensor restored
    bare_opt = get_optimizer(config, _two_layers())
    bare_opt.load_state_dict(saved)
    rewrapped = get_optimizer(config, _wrapped(kind, _two_layers()))
    rewrapped.load_state_dict(copy.deepcopy(bare_opt.state_dict()))
    for opt in (bare_opt, rewrapped):
        got = opt.state_dict()["state"]
        for name, values in saved["state"].items():
            for key, value in values.items():
                assert torch.equal(got[name][key], value), (name, key)


def test_prefixed_checkpoint_keys_of_older_saves_still_load() -> None:
    """A checkpoint written with DDP's `module.` in its keys (before names were canonical) loads into the bare model."""
    config = OptimizerConfig(lr=1e-2, optimizer="adam")
    saved = copy.deepcopy(_trained(_two_layers(), config).state_dict())
    prefixed = {
        **saved,
        "state": {f"module.{n}": v for n, v in saved["state"].items()},
        "param_groups": [{**g, "param_names": [f"module.{n}" for n in g["param_names"]]} for g in saved["param_groups"]],
    }
    opt = get_optimizer(config, _two_layers())
    opt.load_state_dict(prefixed)
    assert torch.equal(opt.state_dict()["state"]["0.weight"]["exp_avg"], saved["state"]["0.weight"]["exp_avg"])


def test_checkpoint_missing_a_stepped_params_state_is_refused_before_anything_changes() -> None:
    config = OptimizerConfig(lr=1e-2, optimizer="adam")
    opt = _trained(_two_layers(), config)
    before = copy.deepcopy(opt.state_dict())
    damaged = copy.deepcopy(before)
    for value in damaged["state"]["0.weight"].values():
        if isinstance(value, torch.Tensor):
            value.add_(1.0)  # so a partial load would show
    del damaged["state"]["1.weight"], damaged["state"]["1.bias"]
    expected = (
        "`state_dict`: no optimizer state for params stepped here; got a checkpoint with state for 2 params but none for "
        "[1.weight, 1.bias]; expected state for every param this optimizer has state for (or a checkpoint saved before "
        "any step, without state)"
    )
    with pytest.raises(ValueError, match=re.escape(expected)):
        opt.load_state_dict(damaged)
    after = opt.state_dict()
    for name, values in before["state"].items():
        for key, value in values.items():
            assert torch.equal(after["state"][name][key], value), (name, key)


def test_checkpoint_without_any_state_still_loads() -> None:
    """Saved before the first step: no state at all, which torch.optim loads too (the moments restart)."""
    config = OptimizerConfig(lr=1e-2, optimizer="adam")
    fresh = copy.deepcopy(get_optimizer(config, _two_layers()).state_dict())
    assert fresh["state"] == {}
    opt = _trained(_two_layers(), config)
    opt.load_state_dict(fresh)
    assert opt.state_dict()["state"] == {}


def test_a_wrapper_built_as_ddp_drops_module_but_a_real_submodule_named_module_stays() -> None:
    """Megatron-Core's DDP and Float16Module wrap as torch's DDP does (one child `module`, no params of
    their own); a model whose own layer is called `module` keeps the name."""

    class Float16Module(torch.nn.Module):  # Megatron-Core's shape: self.module = model
        def __init__(self, module: torch.nn.Module) -> None:
            super().__init__()
            self.module = module

    class Owner(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = torch.nn.Linear(4, 4)
            self.head = torch.nn.Linear(4, 2)

    config = OptimizerConfig(lr=1e-2, optimizer="adam")
    wrapped = get_optimizer(config, Float16Module(_two_layers())).state_dict()
    assert sorted(n for g in wrapped["param_groups"] for n in g["param_names"]) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    own = get_optimizer(config, Owner()).state_dict()
    assert sorted(n for g in own["param_groups"] for n in g["param_names"]) == ["head.bias", "head.weight", "module.bias", "module.weight"]

"""use_precision_aware_optimizer through get_optimizer: typed state, remainders, skips, resume."""

from __future__ import annotations

import io

import pytest
import torch

from optzoo.optimizers.bf16_remainder import join_bf16_remainder
from optzoo.optimizers.precision_adam import PrecisionAwareAdam
from optzoo import OptimizerConfig, ParamKey, get_optimizer
from tests.conftest import tiny_gpt, tokens

REMAINDERS = OptimizerConfig(lr=3e-3, weight_decay=0.1, bf16=True, use_precision_aware_optimizer=True)


def _state_bytes_per_param(opt: torch.optim.Optimizer) -> float:
    params = [p for g in opt.param_groups for p in g["params"]]
    stored = sum(v.numel() * v.element_size() for s in opt.state.values() for k, v in s.items() if torch.is_tensor(v) and k != "step")
    return stored / sum(p.numel() for p in params)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, batches: list[torch.Tensor]) -> None:
    for batch in batches:
        opt.zero_grad()
        opt.scale_loss(model.loss(batch)).backward()  # type: ignore[attr-defined, operator]
        opt.step()


def test_bf16_with_remainders_keeps_int16_masters_and_steps_the_model_params() -> None:
    model = tiny_gpt().to(torch.bfloat16)
    opt = get_optimizer(REMAINDERS, model)
    assert [type(o) for o in opt.optimizers] == [PrecisionAwareAdam]
    assert all(entry.main is entry.model for entry in opt.param_map.local)
    assert [p for g in opt.param_groups for p in g["params"]] == [entry.main for entry in opt.param_map.local]
    _train(model, opt, [tokens() for _ in range(3)])
    weight = model.decoder.layers[0].mlp.linear_fc1.weight
    state = opt.state[weight]
    assert state["master_param"].dtype == torch.int16 and state["exp_avg"].dtype == torch.float32
    master = join_bf16_remainder(weight.detach(), state["master_param"])
    assert master.dtype == torch.float32 and not torch.equal(master, weight.float())
    # 4 (exp_avg) + 4 (exp_avg_sq) + 2 (remainder) bytes per parameter, against 4 + 4 + 4 with an fp32 master.
    assert _state_bytes_per_param(opt) == 10.0


def test_low_precision_moments_cut_state_bytes() -> None:
    config = REMAINDERS.replace(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    model = tiny_gpt().to(torch.bfloat16)
    opt = get_optimizer(config, model)
    _train(model, opt, [tokens()])
    assert {s["exp_avg"].dtype for s in opt.state.values()} == {torch.bfloat16}
    assert _state_bytes_per_param(opt) == 6.0
    fp32_master = get_optimizer(config.replace(store_param_remainders=False), tiny_gpt().to(torch.bfloat16))
    assert {type(o) for o in fp32_master.optimizers} == {PrecisionAwareAdam}


def test_equals_precision_aware_adam_driven_directly() -> None:
    model, direct_model = tiny_gpt().to(torch.bfloat16), tiny_gpt().to(torch.bfloat16)
    direct_model.load_state_dict(model.state_dict())
    config = REMAINDERS.replace(clip_grad=0.0)
    opt = get_optimizer(config.replace(standard_overrides=False), model, {})
    direct = PrecisionAwareAdam(
        direct_model.parameters(), lr=3e-3, weight_decay=0.1, master_weights=True, store_param_remainders=True,
    )
    for _ in range(5):
        batch = tokens()
        opt.zero_grad()
        model.loss(batch).backward()
        opt.step()
        direct.zero_grad()
        direct_model.loss(batch).backward()
        direct.step()
    for p, q in zip(model.parameters(), direct_model.parameters()):
        assert torch.equal(p, q)


def test_fp16_precision_aware_skips_overflow_without_touching_state() -> None:
    config = OptimizerConfig(lr=1e-3, fp16=True, use_precision_aware_optimizer=True, store_param_remainders=False, initial_loss_scale=2.0**10)
    model = tiny_gpt().half()
    opt = get_optimizer(config, model)
    _train(model, opt, [tokens()])
    snapshot = [v.clone() for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    params = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    opt.scale_loss(model.loss(tokens())).backward()
    model.output_layer.weight.grad[0, 0] = float("inf")
    assert opt.step() == (False, None, None)
    assert all(torch.equal(a, b) for a, b in zip(snapshot, [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]))
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))


def test_resume_with_remainders_is_bit_identical() -> None:
    batches = [tokens() for _ in range(6)]
    torch.manual_seed(7)
    straight = tiny_gpt().to(torch.bfloat16)
    torch.manual_seed(7)
    runner = tiny_gpt().to(torch.bfloat16)
    opt, runner_opt = get_optimizer(REMAINDERS, straight), get_optimizer(REMAINDERS, runner)
    _train(straight, opt, batches)
    _train(runner, runner_opt, batches[:3])
    buffer = io.BytesIO()
    torch.save({"model": runner.state_dict(), "opt": runner_opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    fresh = tiny_gpt().to(torch.bfloat16)
    fresh.load_state_dict(saved["model"])
    fresh_opt = get_optimizer(REMAINDERS, fresh)
    fresh_opt.load_state_dict(saved["opt"])
    assert fresh_opt.state[fresh.output_layer.weight]["master_param"].dtype == torch.int16
    _train(fresh, fresh_opt, batches[3:])
    for p, q in zip(straight.parameters(), fresh.parameters()):
        assert torch.equal(p, q)


def test_other_optimizers_are_refused_per_group() -> None:
    with pytest.raises(ValueError, match=r"param group #1 \(rules #0 name='\*.weight'\): `OptimizerConfig.optimizer`: use_precision_aware_optimizer supports adam only; got 'lion'; expected 'adam'"):
        get_optimizer(REMAINDERS.replace(standard_overrides=False), tiny_gpt().to(torch.bfloat16), {ParamKey(name="*.weight"): {"optimizer": "lion"}})


def test_remainders_need_bf16_params() -> None:
    model = tiny_gpt().to(torch.bfloat16)
    model.output_layer.float()
    with pytest.raises(ValueError, match=r"`output_layer.weight`: store_param_remainders needs bf16 parameters; got torch.float32"):
        get_optimizer(REMAINDERS, model)


@pytest.mark.parametrize("remainders", [True, False], ids=["remainders", "fp32-master"])
def test_reload_model_params_refreshes_the_optimizers_masters(remainders: bool) -> None:
    model = tiny_gpt().to(torch.bfloat16)
    opt = get_optimizer(REMAINDERS.replace(store_param_remainders=remainders, lr=0.0, weight_decay=0.0), model)
    _train(model, opt, [tokens()])
    loaded = tiny_gpt().to(torch.bfloat16).state_dict()
    model.load_state_dict(loaded)  # new weights, without the optimizer
    opt.reload_model_params()
    _train(model, opt, [tokens()])  # lr 0: the step must keep the loaded weights
    for name, param in model.named_parameters():
        assert torch.equal(param, loaded[name]), name


def test_the_compiled_update_in_the_wrapper_equals_the_eager_one_bit_for_bit() -> None:
    """Through the wrapper: fp32 decoupled gradients, the clip folded into ``grad_scale``, bf16
    moments; the compiled update (set on the inner optimizer) leaves the eager bits everywhere."""
    config = REMAINDERS.replace(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16, clip_grad=0.05)
    batches = [tokens() for _ in range(4)]
    runs = []
    for compiled in (True, False):
        torch.manual_seed(0)
        model = tiny_gpt().to(torch.bfloat16)
        opt = get_optimizer(config, model)
        (inner,) = opt.optimizers
        assert isinstance(inner, PrecisionAwareAdam)
        inner.compiled = compiled
        _train(model, opt, batches)
        assert compiled is False or (inner.compile_seconds is not None and inner.compile_failure is None)
        runs.append((model.state_dict(), {name: dict(s) for name, s in opt.state_dict()["state"].items()}))
    (model_c, state_c), (model_e, state_e) = runs
    for key, value in model_e.items():
        assert torch.equal(model_c[key].view(torch.int16), value.view(torch.int16)), key
    assert state_c.keys() == state_e.keys()
    for name, saved in state_e.items():
        for key, value in saved.items():
            if torch.is_tensor(value):
                assert torch.equal(state_c[name][key].view(torch.int16) if value.dtype == torch.bfloat16 else state_c[name][key],
                                   value.view(torch.int16) if value.dtype == torch.bfloat16 else value), (name, key)

"""fp16/bf16 params with fp32 main params: skipped overflow steps, tracking fp32, exact resume."""

from __future__ import annotations

import io

import pytest
import torch

from optzoo import (
    DynamicGradScaler,
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    OptimizerConfig,
    ParamKey,
    get_optimizer,
)
from tests.conftest import tiny_gpt, tokens, twin


def _regression_model(dtype: torch.dtype) -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return model.to(dtype)


def _regression_batch(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    inputs = torch.randn(64, 8, generator=generator)
    return inputs, 0.25 * inputs.sum(dim=1, keepdim=True)


def _snapshot(opt: torch.optim.Optimizer, model: torch.nn.Module) -> list[torch.Tensor]:
    tensors = [p.detach().clone() for p in model.parameters()]
    tensors += [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    tensors += [v.clone() for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return tensors


def _bitwise_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


def test_get_optimizer_picks_the_wrapper_and_fp32_main_params(gpt: torch.nn.Module) -> None:
    assert isinstance(get_optimizer(OptimizerConfig(lr=1e-3), gpt), FP32Optimizer)
    model = tiny_gpt().to(torch.bfloat16)
    opt = get_optimizer(OptimizerConfig(lr=1e-3, bf16=True), model)
    assert isinstance(opt, Float16OptimizerWithFloat16Params) and opt.grad_scaler is None
    mains = [p for g in opt.param_groups for p in g["params"]]
    assert all(p.dtype == torch.float32 for p in mains)
    by_name = dict(model.named_parameters())
    for group in opt.param_groups:
        for name, main in zip(group["param_names"], group["params"]):
            assert torch.equal(main, by_name[name].float()) and main is not by_name[name]
    # Routing attributes are visible on the main params too.
    embedding_main = next(p for g in opt.param_groups for n, p in zip(g["param_names"], g["params"]) if n == "output_layer.weight")
    assert embedding_main.is_embedding_or_output_parameter is True


def test_fp16_overflow_skips_the_step_and_backs_off_then_training_converges() -> None:
    model = _regression_model(torch.float16)
    config = OptimizerConfig(lr=1e-2, fp16=True, initial_loss_scale=2.0**8, hysteresis=1, loss_scale_window=20, weight_decay=0.0)
    opt = get_optimizer(config, model)
    assert isinstance(opt.grad_scaler, DynamicGradScaler)
    generator = torch.Generator().manual_seed(0)

    def step() -> tuple[float, tuple[bool, float | None, int | None]]:
        inputs, targets = _regression_batch(generator)
        loss = torch.nn.functional.mse_loss(model(inputs.half()).float(), targets)
        opt.zero_grad()
        opt.scale_loss(loss).backward()
        return loss.item(), opt.step()

    step()
    before = _snapshot(opt, model)
    inputs, targets = _regression_batch(generator)
    opt.zero_grad()
    opt.scale_loss(torch.nn.functional.mse_loss(model(inputs.half()).float(), targets)).backward()
    model[0].weight.grad[0, 0] = float("inf")  # an fp16 overflow
    assert opt.step() == (False, None, None)
    assert _bitwise_equal(before, _snapshot(opt, model))
    assert opt.get_loss_scale().item() == 2.0**7

    losses = [step()[0] for _ in range(300)]
    assert sum(losses[-20:]) / 20 < 0.1 * sum(losses[:20]) / 20


def test_a_huge_initial_scale_overflows_until_it_backs_off() -> None:
    model = _regression_model(torch.float16)
    opt = get_optimizer(OptimizerConfig(lr=1e-3, fp16=True), model)  # Megatron's 2**32 start
    generator = torch.Generator().manual_seed(1)
    results = []
    for _ in range(40):
        inputs, targets = _regression_batch(generator)
        opt.zero_grad()
        opt.scale_loss(torch.nn.functional.mse_loss(model(inputs.half()).float(), targets)).backward()
        results.append(opt.step()[0])
    assert results[0] is False and results[-1] is True
    assert opt.get_loss_scale().item() < 2.0**32


def test_one_scaler_for_every_inner_optimizer_an_inf_anywhere_skips_all() -> None:
    model = tiny_gpt().half()
    opt = get_optimizer(OptimizerConfig(lr=1e-3, fp16=True), model, {ParamKey(name="decoder.*"): {"optimizer": "lion"}})
    assert [type(o).__name__ for o in opt.optimizers] == ["AdamW", "Lion"]
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    model.decoder.layers[0].mlp.linear_fc1.weight.grad[0, 0] = float("nan")  # a Lion parameter
    before = _snapshot(opt, model)
    assert opt.step()[0] is False
    assert _bitwise_equal(before, _snapshot(opt, model))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_nan_gradients_never_reach_the_weights(precision: str) -> None:
    """Unlike Megatron-Core, bf16 (and fp32) without a loss scale still skip non-finite steps."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = _regression_model(dtype)
    opt = get_optimizer(OptimizerConfig(lr=1e-2, bf16=precision == "bf16"), model)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    model[2].bias.grad.fill_(float("nan"))
    before = _snapshot(opt, model)
    assert opt.step() == (False, None, None)
    assert _bitwise_equal(before, _snapshot(opt, model))


def test_bf16_tracks_an_fp32_reference_and_model_params_equal_rounded_main_params() -> None:
    reference = _regression_model(torch.float32)
    model = twin(reference).to(torch.bfloat16)
    config = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=1.0)
    reference_opt = get_optimizer(config, reference)
    opt = get_optimizer(config.replace(bf16=True), model)
    generator = torch.Generator().manual_seed(0)
    for _ in range(100):
        inputs, targets = _regression_batch(generator)
        for m, o, dtype in ((reference, reference_opt, torch.float32), (model, opt, torch.bfloat16)):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(inputs.to(dtype)).float(), targets).backward()
            assert o.step()[0]
        for entry in opt.param_map.local:
            assert torch.equal(entry.model, entry.main.to(torch.bfloat16))
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        # Only the bf16 forward/backward differs: weights (|w| < 0.5) stay within 4 bf16 ulps
        # there (ulp = 2**-9 at 0.25..0.5); measured ~1 ulp.
        torch.testing.assert_close(q.float(), p, atol=4 * 2**-9, rtol=0, msg=name)


def test_params_have_main_grad_reads_the_ddp_buffer() -> None:
    model = _regression_model(torch.bfloat16)
    opt = get_optimizer(OptimizerConfig(lr=0.1, bf16=True, clip_grad=0.0, weight_decay=0.0, optimizer="sgd", sgd_momentum=0.0), model, params_have_main_grad=True)
    for p in model.parameters():
        p.main_grad = torch.full(p.shape, 0.5, dtype=torch.float32)
    before = [p.float().clone() for p in model.parameters()]
    assert opt.step()[0]
    for old, p in zip(before, model.parameters()):
        assert torch.equal(p, (old - 0.05).to(torch.bfloat16))
    opt.zero_grad()
    assert all(torch.count_nonzero(p.main_grad) == 0 for p in model.parameters())
    del model[0].weight.main_grad
    with pytest.raises(ValueError, match=r"`0.weight`: params_have_main_grad=True but the parameter has no main_grad"):
        opt.step()


def test_reload_model_params_refreshes_main_params() -> None:
    model = _regression_model(torch.bfloat16)
    opt = get_optimizer(OptimizerConfig(lr=0.1, bf16=True), model)
    with torch.no_grad():
        model[0].weight.fill_(0.25)
    opt.reload_model_params()
    main = opt.param_groups[0]["params"][0]
    assert torch.equal(main, torch.full_like(main, 0.25))


def test_scale_loss_multiplies_by_the_loss_scale() -> None:
    opt = get_optimizer(OptimizerConfig(lr=1.0, fp16=True, loss_scale=64.0), _regression_model(torch.float16))
    assert opt.get_loss_scale().item() == 64.0
    assert opt.scale_loss(torch.tensor(0.5)).item() == 32.0
    unscaled = get_optimizer(OptimizerConfig(lr=1.0), _regression_model(torch.float32))
    assert unscaled.get_loss_scale().item() == 1.0


def test_param_dtype_must_match_the_precision_flag() -> None:
    with pytest.raises(ValueError, match=r"`0.weight`: parameter dtype does not match the config; got torch.bfloat16 with fp16=True; expected torch.float16 or torch.float32"):
        get_optimizer(OptimizerConfig(lr=1.0, fp16=True), _regression_model(torch.bfloat16))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, batches: list[torch.Tensor], inf_at: int | None) -> list[bool]:
    results = []
    for index, batch in enumerate(batches):
        opt.zero_grad()
        opt.scale_loss(model.loss(batch)).backward()  # type: ignore[attr-defined]
        if index == inf_at:
            model.output_layer.weight.grad[0, 0] = float("inf")
        results.append(opt.step()[0])
    return results


def _roundtrip(state: object) -> object:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_resume_is_bit_identical_with_an_overflow_skipped_step(precision: str) -> None:
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    config = OptimizerConfig(
        lr=3e-3, weight_decay=0.1, fp16=precision == "fp16", bf16=precision == "bf16",
        initial_loss_scale=2.0**10, loss_scale_window=3,
    )
    batches = [tokens() for _ in range(10)]
    straight = _init(dtype)
    opt = get_optimizer(config, straight)
    assert _train(straight, opt, batches, inf_at=2)[2] is False

    runner = _init(dtype)  # the same initial weights, trained for 5 steps then checkpointed
    runner_opt = get_optimizer(config, runner)
    _train(runner, runner_opt, batches[:5], inf_at=2)
    model_state = _roundtrip(runner.state_dict())
    opt_state = _roundtrip(runner_opt.state_dict())

    fresh = tiny_gpt().to(dtype)
    fresh.load_state_dict(model_state)  # type: ignore[arg-type]
    fresh_opt = get_optimizer(config, fresh)
    fresh_opt.load_state_dict(opt_state)  # type: ignore[arg-type]
    _train(fresh, fresh_opt, batches[5:], inf_at=None)

    for (name, p), q in zip(straight.named_parameters(), fresh.parameters()):
        assert torch.equal(p, q), name
    assert torch.equal(opt.get_loss_scale(), fresh_opt.get_loss_scale())
    for group, fresh_group in zip(opt.param_groups, fresh_opt.param_groups):
        for p, q in zip(group["params"], fresh_group["params"]):
            assert torch.equal(p, q)
            assert all(torch.equal(v, fresh_opt.state[q][k]) for k, v in opt.state[p].items())


def _init(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(1234)
    return tiny_gpt().to(dtype)


def test_loading_a_checkpoint_from_another_precision_is_a_clear_error() -> None:
    fp32_opt = get_optimizer(OptimizerConfig(lr=1e-3), tiny_gpt())
    bf16_opt = get_optimizer(OptimizerConfig(lr=1e-3, bf16=True), tiny_gpt().to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"`state_dict`: fp32 main params do not match this optimizer's; got \[\]; expected \[decoder.final_layernorm.bias, "):
        bf16_opt.load_state_dict(fp32_opt.state_dict())
    fp16_opt = get_optimizer(OptimizerConfig(lr=1e-3, fp16=True), tiny_gpt().half())
    with pytest.raises(ValueError, match=r"`state_dict`: grad scaler state is absent; got None; expected one"):
        fp16_opt.load_state_dict(bf16_opt.state_dict())

"""Per-group telemetry (``log_metrics``, ``optimizer.metrics()``) against float64 recomputation by hand.

Each expectation is recomputed from outside the telemetry: gradients read off the model before the
step (unscaled by the loss scale the test reads), the main params snapshotted from
``param_groups`` before and after, and the Newton–Schulz output recovered from Muon's update as
``(before - after) / (lr · √max(rows, cols))`` (``scale_mode="spectral"``, weight decay 0; Kimi,
arXiv:2502.16982), whose short-side Gram is compared with I in float64.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import transformers

from optzoo import NotOrthogonalizedWarning, OptimizerConfig, get_optimizer, metrics_to_floats
from optzoo.optimizers.muon import Muon
from tests.conftest import tiny_gpt

# float32 sums against float64 ones, and an update recovered from two float32 params: ~1e-6 relative.
RTOL = 1e-5
# The orthogonality error is recomputed from an update of ~lr · √max(r, c) recovered by subtracting
# float32 params of size ~1: ~1e-7 absolute error per entry on entries ~0.2.
ORTHO_RTOL = 1e-4


def _llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    model: torch.nn.Module = transformers.LlamaForCausalLM(config)
    return model


def _gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return tiny_gpt()


def _loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    if hasattr(model, "loss"):
        loss: torch.Tensor = model.loss(batch)
        return loss
    return model(input_ids=batch, labels=batch).loss.float()  # type: ignore[no-any-return]


MODELS: dict[str, Callable[[], torch.nn.Module]] = {"gpt": _gpt, "llama": _llama}
MUON = OptimizerConfig(
    lr=0.05, optimizer="muon", weight_decay=0.0, muon_scale_mode="spectral", muon_split_qkv=False,
    muon_fp32_matmul_prec="highest", log_metrics="per_param",
)  # fmt: skip


def _batch(seed: int) -> torch.Tensor:
    return torch.randint(32, (4, 8), generator=torch.Generator().manual_seed(seed))


def _group_key(groups: list[dict[str, Any]], index: int) -> str:
    """``<algorithm>/<k>``, written out here: the k-th group of its algorithm."""
    algorithm = groups[index]["optimizer"]
    return f"{algorithm}/{sum(1 for g in groups[:index] if g['optimizer'] == algorithm)}"


def _step_and_recompute(model: torch.nn.Module, opt: Any, seed: int) -> tuple[dict[str, float], dict[str, float]]:
    """One step; returns ``(metrics as floats, the same recomputed in float64)``."""
    opt.zero_grad()
    scale = float(opt.get_loss_scale())
    (_loss(model, _batch(seed)) * scale).backward()
    named = dict(model.named_parameters())
    groups = opt.param_groups
    grads = {name: named[name].grad.double() / scale for g in groups for name in g["param_names"] if named[name].grad is not None}
    before = {name: p.detach().double().clone() for g in groups for name, p in zip(g["param_names"], g["params"])}
    ok, _, _ = opt.step()
    assert ok
    after = {name: p.detach().double() for g in groups for name, p in zip(g["param_names"], g["params"])}
    expected: dict[str, float] = {}
    for index, group in enumerate(groups):
        key, names = _group_key(groups, index), group["param_names"]
        numel = sum(before[n].numel() for n in names)
        grad_sq = sum(float((grads[n] ** 2).sum()) for n in names if n in grads)
        update_sq = sum(float(((after[n] - before[n]) ** 2).sum()) for n in names)
        param_sq = sum(float((before[n] ** 2).sum()) for n in names)
        expected[f"{key}/grad_norm"] = math.sqrt(grad_sq)
        expected[f"{key}/update_rms"] = math.sqrt(update_sq / numel)
        expected[f"{key}/param_rms"] = math.sqrt(param_sq / numel)
        expected[f"{key}/update_rms_to_param_rms"] = math.sqrt(update_sq / numel) / math.sqrt(param_sq / numel)
        for n in names:
            size = before[n].numel()
            update_rms = math.sqrt(float(((after[n] - before[n]) ** 2).sum()) / size)
            param_rms = math.sqrt(float((before[n] ** 2).sum()) / size)
            expected[f"{key}/{n}/grad_norm"] = math.sqrt(float((grads[n] ** 2).sum())) if n in grads else 0.0
            expected[f"{key}/{n}/update_rms"] = update_rms
            expected[f"{key}/{n}/param_rms"] = param_rms
            expected[f"{key}/{n}/update_rms_to_param_rms"] = _ratio(update_rms, param_rms)
        if group["optimizer"] == "muon":
            expected[f"{key}/orthogonalized"] = float(sum(1 for n in names if n in grads))
            first = next(n for n in names if n in grads)  # the sample: the first matrix of the first param with a gradient
            rows, cols = before[first].shape
            u = (before[first] - after[first]) / (group["lr"] * math.sqrt(max(rows, cols)))
            gram = u @ u.T if rows <= cols else u.T @ u
            k = min(rows, cols)
            expected[f"{key}/orthogonality_error"] = float(torch.linalg.matrix_norm(gram - torch.eye(k, dtype=torch.float64))) / math.sqrt(k)
    return metrics_to_floats(opt.metrics()), expected


def _ratio(update_rms: float, param_rms: float) -> float:
    """IEEE division, as on the device: a zero-initialised bias has param RMS 0 before its first update."""
    if param_rms:
        return update_rms / param_rms
    return math.inf if update_rms else math.nan


def _assert_close(got: dict[str, float], expected: dict[str, float]) -> None:
    assert set(got) == set(expected)
    for key, value in expected.items():
        tolerance = ORTHO_RTOL if key.endswith("orthogonality_error") else RTOL
        assert got[key] == pytest.approx(value, rel=tolerance, abs=1e-12, nan_ok=True), key


@pytest.mark.parametrize("model_name", list(MODELS))
def test_muon_metrics_match_float64_recomputation(model_name: str) -> None:
    model = MODELS[model_name]()
    opt = get_optimizer(MUON, model)
    for seed in range(2):  # the second step has momentum and a changed param
        got, expected = _step_and_recompute(model, opt, seed)
        _assert_close(got, expected)
    assert got["muon/0/orthogonality_error"] > 0.01  # Newton-Schulz's output is only nearly orthogonal


@pytest.mark.parametrize(
    "config",
    [
        MUON.replace(bf16=True),  # fp32 main params: the update is measured on them
        OptimizerConfig(lr=1e-2, fp16=True, initial_loss_scale=2.0**12, log_metrics="per_param", clip_grad=0.1),  # a scale the grads carry; clipped
        OptimizerConfig(lr=1e-2, fold_clip_and_scale=False, fp16=True, initial_loss_scale=2.0**12, log_metrics="per_param", clip_grad=0.1),
    ],
    ids=["muon-bf16", "adam-fp16-scaled-clipped", "adam-fp16-unfolded"],
)
def test_mixed_precision_metrics_match_float64_recomputation(config: OptimizerConfig) -> None:
    """Grad norms are of the unscaled gradients before clipping, as ``step``'s global norm."""
    model = _gpt().to(torch.bfloat16 if config.bf16 else torch.float16)
    opt = get_optimizer(config, model)
    for seed in range(2):
        got, expected = _step_and_recompute(model, opt, seed)
        _assert_close(got, expected)


def test_step_on_device_metrics_match_float64_recomputation() -> None:
    model = _gpt()
    opt = get_optimizer(OptimizerConfig(lr=1e-2, log_metrics=True, clip_grad=0.5), model)
    opt.zero_grad()
    _loss(model, _batch(0)).backward()
    grads = [p.grad.double() for p in model.parameters()]
    before = [p.detach().double().clone() for p in model.parameters()]
    opt.step_on_device()
    named = dict(model.named_parameters())
    got = metrics_to_floats(opt.metrics())
    total = sum(float((g**2).sum()) for g in grads)
    assert sum(got[f"adam/{k}/grad_norm"] ** 2 for k in range(2)) == pytest.approx(total, rel=RTOL)
    update_sq = sum(float(((named[n].detach().double() - b) ** 2).sum()) for n, b in zip(named, before))
    numel = sum(p.numel() for p in model.parameters())
    by_group = [got[f"adam/{k}/update_rms"] ** 2 * sum(named[n].numel() for n in g["param_names"]) for k, g in enumerate(opt.param_groups)]
    assert sum(by_group) / numel == pytest.approx(update_sq / numel, rel=RTOL)


def test_metrics_are_device_tensors_and_keys_are_stable() -> None:
    model = _gpt()
    opt = get_optimizer(OptimizerConfig(lr=1e-2, optimizer="muon", log_metrics=True), model)
    assert opt.metrics() == {}  # before the first step
    _loss(model, _batch(0)).backward()
    opt.step()
    metrics = opt.metrics()
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in metrics.values())
    assert set(metrics) == {
        f"{group}/{name}" for group in ("muon/0", "adam/0", "adam/1")
        for name in ("grad_norm", "update_rms", "param_rms", "update_rms_to_param_rms")
    } | {"muon/0/orthogonality_error", "muon/0/orthogonalized"}  # fmt: skip
    assert metrics_to_floats(metrics)["muon/0/orthogonalized"] == 8.0  # tiny GPT: 2 layers x (qkv, proj, fc1, fc2)


def test_metrics_refused_when_off_and_nothing_recorded() -> None:
    model = _gpt()
    opt = get_optimizer(OptimizerConfig(lr=1e-2, optimizer="muon"), model)
    _loss(model, _batch(0)).backward()
    opt.step()
    assert opt._telemetry is None
    assert all(o.orthogonalization_record is None for o in opt.optimizers if isinstance(o, Muon))
    with pytest.raises(
        ValueError,
        match=re.escape(
            "`metrics`: telemetry is off; got OptimizerConfig.log_metrics=False; expected log_metrics=True "
            "(per group) or 'per_param' when get_optimizer builds the optimizer"
        ),
    ):
        opt.metrics()


@pytest.mark.parametrize(("value", "error"), [("per_parm", ValueError), (1, TypeError), (None, TypeError)])
def test_bad_log_metrics_refused_by_name(value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match=r"`OptimizerConfig\.log_metrics`: .*expected .*'per_param'"):
        OptimizerConfig(lr=1e-3, log_metrics=value)  # type: ignore[arg-type]


def test_an_interval_measures_every_nth_step_and_keeps_the_last_between() -> None:
    model = _gpt()
    opt = get_optimizer(MUON.replace(log_metrics_interval=3), model)
    got, expected = _step_and_recompute(model, opt, 0)  # step 1: measured
    _assert_close(got, expected)
    for seed in (1, 2):  # steps 2 and 3: not measured, step 1's kept
        assert _step_and_recompute(model, opt, seed)[0] == got
    got, expected = _step_and_recompute(model, opt, 3)  # step 4: measured
    _assert_close(got, expected)


@pytest.mark.parametrize(("value", "error"), [(0, ValueError), (True, TypeError), (2.0, TypeError)])
def test_bad_log_metrics_interval_refused_by_name(value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match=r"`OptimizerConfig\.log_metrics_interval`: .*"):
        OptimizerConfig(lr=1e-3, log_metrics=True, log_metrics_interval=value)  # type: ignore[arg-type]


def test_muon_param_without_orthogonalised_update_warns_after_first_step() -> None:
    model = _gpt()
    opt = get_optimizer(OptimizerConfig(lr=1e-2, optimizer="muon", log_metrics=True), model)
    missing = "decoder.layers.1.mlp.linear_fc2.weight"
    _loss(model, _batch(0)).backward()
    dict(model.named_parameters())[missing].grad = None
    expected = (
        f"`muon/0`: 1 param(s) routed to muon got no orthogonalised update in the first step; got {missing}; "
        "expected every param of the group to be orthogonalised (a param without a gradient, or one stepped by "
        "another path, is not): check requires_grad, the forward and the routing"
    )
    with pytest.warns(NotOrthogonalizedWarning) as caught:
        opt.step()
    assert [str(w.message) for w in caught if w.category is NotOrthogonalizedWarning] == [expected]
    assert metrics_to_floats(opt.metrics())["muon/0/orthogonalized"] == 7.0
    opt.zero_grad()
    _loss(model, _batch(1)).backward()
    dict(model.named_parameters())[missing].grad = None
    with warnings.catch_warnings():
        warnings.simplefilter("error", NotOrthogonalizedWarning)
        opt.step()  # once: after the first step


def test_no_warning_when_every_muon_param_is_orthogonalised() -> None:
    model = _gpt()
    opt = get_optimizer(OptimizerConfig(lr=1e-2, optimizer="muon", log_metrics=True), model)
    _loss(model, _batch(0)).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error", NotOrthogonalizedWarning)
        opt.step()


def test_metrics_to_floats_reads_tensors_and_keeps_numbers() -> None:
    assert metrics_to_floats({"a/0/x": torch.tensor(0.5, dtype=torch.float64), "b": 2.0}) == {"a/0/x": 0.5, "b": 2.0}


def test_torch_muon_counts_params_with_a_gradient_and_samples_nothing() -> None:
    """torch.optim.Muon orthogonalises every param with a gradient (its step skips only ``grad is None``)."""
    model = _gpt()
    opt = get_optimizer(OptimizerConfig(lr=1e-2, optimizer="torch_muon", log_metrics=True), model)
    _loss(model, _batch(0)).backward()
    dict(model.named_parameters())["decoder.layers.0.mlp.linear_fc1.weight"].grad = None
    with pytest.warns(NotOrthogonalizedWarning, match=r"got decoder\.layers\.0\.mlp\.linear_fc1\.weight;"):
        opt.step()
    metrics = metrics_to_floats(opt.metrics())
    assert metrics["torch_muon/0/orthogonalized"] == 7.0  # tiny GPT's 8 matrices, one without a gradient
    assert "torch_muon/0/orthogonality_error" not in metrics

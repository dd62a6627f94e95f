"""What frameworks that drive optzoo as a plain torch optimizer get from it (issue #25 item 5):
``optimizer.last_step`` read after Lightning's and Trainer's ``step()``, the warning when a framework
clips before optzoo clips again, and Lightning's ``BackboneFinetuning`` adding the backbone's params
mid-run through ``add_param_group``. Each runs the real framework on CPU."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from optzoo import OptimizerConfig, get_optimizer
from optzoo.wrapper.framework_contract import DoubleClippingWarning, LastStep

INF_AT = 2  # the optimizer step whose gradient gets an inf


class Net(torch.nn.Module):
    """A backbone (hidden matrices and a norm) and a head, with realistic names."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 8))
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        logits = self.head(torch.tanh(self.backbone(x)))
        if labels is None:
            return logits
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


def _data(n: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=generator), torch.randint(3, (n,), generator=generator)


# ---- last_step --------------------------------------------------------------------------------------


def _inject_inf(model: torch.nn.Module) -> None:
    grad = model.head.weight.grad  # type: ignore[union-attr]
    assert grad is not None
    grad[0, 0] = math.inf


def test_last_step_holds_what_step_returned_and_counts_skips() -> None:
    model = Net()
    opt = get_optimizer(OptimizerConfig(lr=1e-2, log_num_zeros_in_grad=True), model, trace=False)
    assert opt.last_step is None
    x, y = _data()
    outcomes = []
    for step in range(4):
        opt.zero_grad()
        model(x, y)["loss"].backward()
        if step == INF_AT:
            _inject_inf(model)
        outcomes.append((opt.step(), opt.last_step))
    for (success, norm, zeros), last in outcomes:
        assert (last.success, last.grad_norm, last.num_zeros) == (success, norm, zeros)
    assert [last.skipped_steps for _, last in outcomes] == [0, 0, 1, 1]
    assert [last.success for _, last in outcomes] == [True, True, False, True]
    with pytest.raises(AttributeError):
        opt.last_step = None  # type: ignore[misc]  # read-only
    state = opt.state_dict()
    assert "skipped_steps" not in state  # a run statistic, not state (docs/integrations.md)
    opt.load_state_dict(state)
    assert opt.last_step is not None and opt.last_step.skipped_steps == 1  # loading leaves it


def test_last_step_after_step_on_device_holds_device_tensors() -> None:
    model = Net()
    opt = get_optimizer(OptimizerConfig(lr=1e-2), model, trace=False)
    x, y = _data()
    for step in range(3):
        opt.zero_grad()
        model(x, y)["loss"].backward()
        if step == 1:
            _inject_inf(model)
        opt.step_on_device()
        last = opt.last_step
        assert isinstance(last, LastStep)
        assert isinstance(last.success, torch.Tensor) and last.success.dtype == torch.bool and last.success.dim() == 0
        assert isinstance(last.grad_norm, torch.Tensor) and isinstance(last.skipped_steps, torch.Tensor)
        assert bool(last.success) == (step != 1)
        assert int(last.skipped_steps) == (0 if step == 0 else 1)
    assert math.isinf(float(opt.last_step.grad_norm)) is False  # the last step was clean


class LitNet(L.LightningModule):
    def __init__(self, config: OptimizerConfig, *, inject_at: int | None = None) -> None:
        super().__init__()
        self.net = Net()
        self.config = config
        self.inject_at = inject_at
        self.seen: list[LastStep | None] = []
        self.opt: Any = None

    def training_step(self, batch: Any, batch_index: int) -> torch.Tensor:
        x, y = batch
        return self.net(x, y)["loss"]  # type: ignore[no-any-return]

    def on_after_backward(self) -> None:
        if self.inject_at is not None and self.global_step == self.inject_at:
            _inject_inf(self.net)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_index: int) -> None:
        self.seen.append(self.opt.last_step)

    def configure_optimizers(self) -> Any:
        self.opt = get_optimizer(self.config, self.net, trace=False)
        return self.opt


def _lightning_fit(module: L.LightningModule, tmp_path: Path, *, epochs: int = 1, callbacks: list[Any] | None = None, **trainer_args: Any) -> None:
    x, y = _data()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=epochs, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, callbacks=callbacks or [], **trainer_args,
    )  # fmt: skip
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=4))


def test_last_step_is_read_after_lightnings_automatic_optimization(tmp_path: Path) -> None:
    module = LitNet(OptimizerConfig(lr=1e-2), inject_at=INF_AT)
    _lightning_fit(module, tmp_path)
    assert [s.success for s in module.seen] == [True, True, False, True]  # type: ignore[union-attr]
    assert [s.skipped_steps for s in module.seen] == [0, 0, 1, 1]  # type: ignore[union-attr]
    assert module.seen[INF_AT].grad_norm is None and module.seen[-1].grad_norm > 0  # type: ignore[union-attr,operator]


def _hf_train(model: torch.nn.Module, opt: Any, tmp_path: Path, *, callbacks: list[Any] = (), **args: Any) -> Any:  # type: ignore[assignment]
    from transformers import Trainer, TrainingArguments

    x, y = _data()
    dataset = [{"x": x[i], "labels": y[i]} for i in range(len(x))]
    training_args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=4, per_device_train_batch_size=4, save_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, logging_steps=1, **args,
    )  # fmt: skip
    trainer = Trainer(model=model, args=training_args, train_dataset=dataset, optimizers=(opt, None), callbacks=list(callbacks))
    trainer.train()
    return trainer


def test_last_step_is_read_after_trainers_step(tmp_path: Path) -> None:
    from transformers import TrainerCallback

    model = Net()
    opt = get_optimizer(OptimizerConfig(lr=1e-2), model, trace=False)
    seen: list[LastStep | None] = []

    class Probe(TrainerCallback):
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == INF_AT:
                _inject_inf(model)

        def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            seen.append(opt.last_step)

    _hf_train(model, opt, tmp_path, callbacks=[Probe()], max_grad_norm=0.0)
    assert [s.success for s in seen] == [True, True, False, True]  # type: ignore[union-attr]
    assert opt.last_step is not None and opt.last_step.skipped_steps == 1


# ---- clipping twice ---------------------------------------------------------------------------------


def _double_clip_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, DoubleClippingWarning)]


@pytest.mark.parametrize("max_grad_norm", [0.3, 0.0])
def test_trainers_clip_and_optzoos_warn_once(max_grad_norm: float, tmp_path: Path) -> None:
    """Trainer clips with max_grad_norm > 0; with 0 it still calls clip_grad_norm_(params, inf) to
    read the norm (transformers' Trainer._get_grad_norm), which cuts nothing: no warning then."""
    model = Net()
    opt = get_optimizer(OptimizerConfig(lr=1e-2, clip_grad=1.0), model, trace=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _hf_train(model, opt, tmp_path, max_grad_norm=max_grad_norm)
    messages = _double_clip_warnings(caught)
    if max_grad_norm > 0:
        assert len(messages) == 1
        assert "max_grad_norm" in messages[0] and "clip_grad=1.0" in messages[0] and "clip_grad=0.0" in messages[0]
        where = [w.filename for w in caught if issubclass(w.category, DoubleClippingWarning)][0]
        assert "/optzoo/" not in where and "/torch/" not in where  # it points at the caller of step()
    else:
        assert messages == []


@pytest.mark.parametrize("gradient_clip_val", [0.05, None])
def test_lightnings_clip_and_optzoos_warn_once(gradient_clip_val: float | None, tmp_path: Path) -> None:
    module = LitNet(OptimizerConfig(lr=1e-2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _lightning_fit(module, tmp_path, gradient_clip_val=gradient_clip_val)
    messages = _double_clip_warnings(caught)
    if gradient_clip_val is not None:
        assert len(messages) == 1 and "gradient_clip_val" in messages[0]
    else:
        assert messages == []


def test_accelerates_clip_and_optzoos_warn_once() -> None:
    from accelerate import Accelerator

    model = Net()
    opt = get_optimizer(OptimizerConfig(lr=1e-2), model, trace=False)
    accelerator = Accelerator(cpu=True)
    model, prepared = accelerator.prepare(model, opt)
    x, y = _data()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            prepared.zero_grad()
            accelerator.backward(model(x, y)["loss"])
            accelerator.clip_grad_norm_(model.parameters(), 0.05)
            prepared.step()
    messages = _double_clip_warnings(caught)
    assert len(messages) == 1 and "accelerator.clip_grad_norm_" in messages[0]


def test_no_warning_without_optzoos_clip_or_for_a_change_of_some_gradients() -> None:
    x, y = _data()
    for clip_grad, change in [(0.0, "clip"), (1.0, "one grad halved"), (1.0, "grads set by hand")]:
        model = Net()
        opt = get_optimizer(OptimizerConfig(lr=1e-2, clip_grad=clip_grad), model, trace=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                opt.zero_grad()
                model(x, y)["loss"].backward()
                if change == "clip":
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
                elif change == "one grad halved":
                    model.head.weight.grad.mul_(0.5)  # type: ignore[union-attr]
                else:
                    for p in model.parameters():
                        p.grad = p.grad * 0.01  # type: ignore[operator]  # new tensors: not an in-place clip
                opt.step()
        assert _double_clip_warnings(caught) == [], change


# ---- add_param_group: Lightning's BackboneFinetuning ----------------------------------------------------

BACKBONE_DECAY = ["backbone.0.weight", "backbone.2.weight"]
BACKBONE_NO_DECAY = ["backbone.0.bias", "backbone.1.weight", "backbone.1.bias", "backbone.2.bias"]  # biases and the norm


class FineTuned(L.LightningModule):
    """A ``backbone`` (what ``BackboneFinetuning`` freezes, then unfreezes) and a ``head``."""

    def __init__(self, config: OptimizerConfig) -> None:
        super().__init__()
        net = Net()
        self.backbone, self.head = net.backbone, net.head
        self.config = config
        self.opt: Any = None
        self.groups_by_epoch: list[list[tuple[str, float, float, list[str]]]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.backbone(x)))  # type: ignore[no-any-return]

    def training_step(self, batch: Any, batch_index: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y)

    def on_train_epoch_end(self) -> None:
        self.groups_by_epoch.append([(g["optimizer"], g["lr"], g["weight_decay"], list(g["param_names"])) for g in self.opt.param_groups])

    def configure_optimizers(self) -> Any:
        self.opt = get_optimizer(self.config, self, trace=False)
        return self.opt


def test_backbone_finetuning_adds_the_backbone_as_routing_says_and_matches_torch_adamw(tmp_path: Path) -> None:
    from lightning.pytorch.callbacks import BackboneFinetuning

    lr = 1e-2
    module = FineTuned(OptimizerConfig(lr=lr, weight_decay=0.1, clip_grad=0.0))
    reference = Net()
    reference.load_state_dict({k: v.clone() for k, v in module.state_dict().items()})
    _lightning_fit(module, tmp_path, epochs=3, callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1)])

    # Lightning's own numbers (lightning/pytorch/callbacks/finetuning.py, BackboneFinetuning.finetune_function):
    # at the unfreeze epoch the backbone lr is lr * backbone_initial_ratio_lr (0.1); each later epoch
    # multiplies it by lambda_func (multiplicative: 2.0), set on param_groups[-1]: here on both backbone groups.
    head = [("adam", lr, 0.1, ["head.weight"]), ("adam", lr, 0.0, ["head.bias"])]
    assert module.groups_by_epoch[0] == head
    assert module.groups_by_epoch[1] == head + [("adam", lr * 0.1, 0.1, BACKBONE_DECAY), ("adam", lr * 0.1, 0.0, BACKBONE_NO_DECAY)]
    assert module.groups_by_epoch[2] == head + [("adam", lr * 0.1 * 2.0, 0.1, BACKBONE_DECAY), ("adam", lr * 0.1 * 2.0, 0.0, BACKBONE_NO_DECAY)]

    # torch.optim.AdamW over the same batches, the groups written by hand from the rules above
    by_name = dict(reference.named_parameters())
    flags = {k: v for k, v in module.opt.param_groups[0].items() if k in ("betas", "eps", "fused", "foreach")}
    for p in reference.backbone.parameters():
        p.requires_grad_(False)
    adamw = torch.optim.AdamW(
        [{"params": [by_name["head.weight"]], "weight_decay": 0.1}, {"params": [by_name["head.bias"]], "weight_decay": 0.0}], lr=lr, **flags
    )
    x, y = _data()
    for epoch in range(3):
        if epoch == 1:
            for p in reference.backbone.parameters():
                p.requires_grad_(True)
            adamw.add_param_group({"params": [by_name[n] for n in BACKBONE_DECAY], "lr": lr * 0.1, "weight_decay": 0.1})
            adamw.add_param_group({"params": [by_name[n] for n in BACKBONE_NO_DECAY], "lr": lr * 0.1, "weight_decay": 0.0})
        if epoch == 2:
            for group in adamw.param_groups[2:]:
                group["lr"] = lr * 0.1 * 2.0
        for start in range(0, len(x), 4):
            adamw.zero_grad()
            torch.nn.functional.cross_entropy(reference(x[start : start + 4]), y[start : start + 4]).backward()
            adamw.step()
    for name, p in module.named_parameters():
        torch.testing.assert_close(p, by_name[name], atol=0, rtol=0, msg=name)


def test_backbone_finetuning_puts_the_unfrozen_hidden_matrices_on_muon(tmp_path: Path) -> None:
    from lightning.pytorch.callbacks import BackboneFinetuning

    module = FineTuned(OptimizerConfig(lr=1e-2, weight_decay=0.1, optimizer="muon", muon_fp32_matmul_prec="highest"))
    before = {n: p.detach().clone() for n, p in module.backbone.named_parameters()}
    _lightning_fit(module, tmp_path, epochs=2, callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1)])
    added = module.groups_by_epoch[1][len(module.groups_by_epoch[0]) :]
    assert added == [("muon", 1e-3, 0.1, BACKBONE_DECAY), ("adam", 1e-3, 0.0, BACKBONE_NO_DECAY)]
    assert all(not torch.equal(before[n], p) for n, p in module.backbone.named_parameters())  # stepped in epoch 1
    muon = next(opt for opt in module.opt.optimizers if any(g["optimizer"] == "muon" for g in opt.param_groups))
    assert all("momentum_buffer" in muon.state[p] for p in (module.backbone[0].weight, module.backbone[2].weight))


def _ddp_clip_warnings(rank: int, world_size: int, framework_clip: bool) -> list[str]:
    torch.manual_seed(0)
    model = Net()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = get_optimizer(OptimizerConfig(lr=1e-2), model, trace=False)
    x, y = _data(seed=rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            opt.zero_grad()
            ddp(x, y)["loss"].backward()  # DDP copies its reduced buckets into .grad at the end of backward
            if framework_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()
    return _double_clip_warnings(caught)


@pytest.mark.slow
@pytest.mark.parametrize("framework_clip", [False, True])
def test_ddps_own_copy_into_grad_is_no_clip(framework_clip: bool) -> None:
    from tests.distributed.harness import run_ranks

    for messages in run_ranks(2, _ddp_clip_warnings, framework_clip):
        assert len(messages) == (1 if framework_clip else 0)


def test_hugging_faces_polynomial_schedule_reads_the_configs_lr_from_defaults() -> None:
    from transformers import get_polynomial_decay_schedule_with_warmup

    model = Net()
    opt = get_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.1, decoupled_lr=1e-3), model, trace=False)
    scheduler = get_polynomial_decay_schedule_with_warmup(opt, num_warmup_steps=0, num_training_steps=4, lr_end=1e-4, power=1.0)
    for _ in range(2):
        scheduler.step()
    # transformers' lambda: ((lr_init - lr_end) * (1 - 2/4) + lr_end) / lr_init, lr_init = defaults["lr"] = the config's lr
    factor = ((1e-2 - 1e-4) * 0.5 + 1e-4) / 1e-2
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([g["initial_lr"] * factor for g in opt.param_groups], rel=1e-12)

"""``transformers.Trainer`` + DDP + optzoo's distributed optimizers, on 2 gloo ranks: save, resume.

Trainer is driven for real: each spawned rank sets the variables ``torchrun`` would
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), so accelerate finds the process group the harness
made and Trainer wraps the model in ``DistributedDataParallel`` (gloo, CPU). Trainer saves the
optimizer with ``torch.save(optimizer.state_dict())`` on rank 0 alone and loads it on every rank
(transformers 5.x, ``Trainer._save_optimizer_and_scheduler`` / ``_load_optimizer_and_scheduler``).

The expectation comes from Trainer itself: a run that saves at step 2 and a run resumed from that
checkpoint (``resume_from_checkpoint``) end with the params and optimizer state of one
uninterrupted 4-step run, bit for bit (same data order, same arithmetic, state round-tripped
through ``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import datetime
import os
import re
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist

from optzoo import OptimizerConfig, get_optimizer
from tests.distributed.harness import run_ranks

pytestmark = pytest.mark.slow

WORLD_SIZE = 2
STEPS = 4
SAVE_AT = 2
CONFIGS = {
    "layer_wise_muon": OptimizerConfig(
        optimizer="muon", lr=1e-2, weight_decay=0.1, use_layer_wise_distributed_optimizer=True, muon_fp32_matmul_prec="highest"
    ),
    "zero1_adam": OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.1, use_distributed_optimizer=True),
}


class _Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        self.rows = torch.randint(256, (32, 16), generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[index], "labels": self.rows[index]}


def _as_torchrun(rank: int, world_size: int) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", OMP_NUM_THREADS="1",
    )  # fmt: skip


def _train(config: OptimizerConfig, output_dir: str, *, save: bool, resume: str | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """One Trainer run of ``STEPS`` steps; the final params and the optimizer's state dict (gathered on every rank)."""
    from transformers import Trainer, TrainingArguments

    from optzoo.hf import build_hf_model
    from optzoo.trainer import GatherOptimizerState, trainer_optimizer

    torch.manual_seed(0 if resume is None else 1)  # a resumed run must not depend on its own init
    model = build_hf_model("LlamaConfig")
    args = TrainingArguments(
        output_dir=output_dir, use_cpu=True, ddp_backend="gloo", report_to=[], max_steps=STEPS,
        per_device_train_batch_size=2, logging_steps=1, save_strategy="steps" if save else "no", save_steps=SAVE_AT,
        max_grad_norm=0.0, disable_tqdm=True, dataloader_num_workers=0, seed=5,
    )  # fmt: skip
    trainer = Trainer(
        model=model, args=args, train_dataset=_Tokens(), optimizer_cls_and_kwargs=trainer_optimizer(config),
        callbacks=[GatherOptimizerState()],
    )  # fmt: skip
    assert args.world_size == WORLD_SIZE  # Trainer runs distributed
    trainer.train(resume_from_checkpoint=resume)
    assert isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel)
    optimizer = trainer.optimizer.optimizer  # under accelerate's AcceleratedOptimizer
    assert type(optimizer).__name__ == "DistributedOptimizer"
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return params, _cloned(optimizer.state_dict())


def _cloned(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _cloned(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_cloned(v) for v in value)
    return value


def _save_and_resume(rank: int, world_size: int, name: str, root: str) -> dict[str, Any]:
    _as_torchrun(rank, world_size)
    config = CONFIGS[name]
    whole = _train(config, os.path.join(root, "whole"), save=False)
    saving = _train(config, os.path.join(root, "saving"), save=True)
    checkpoint = os.path.join(root, "saving", f"checkpoint-{SAVE_AT}")
    dist.barrier()  # rank 0 wrote the checkpoint
    files = sorted(os.listdir(checkpoint))
    resumed = _train(config, os.path.join(root, "resumed"), save=False, resume=checkpoint)
    return {"whole": whole, "saving": saving, "resumed": resumed, "files": files}


def _same(a: Any, b: Any, where: str = "") -> list[str]:
    """Where ``a`` and ``b`` differ (tensors bit for bit)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        return [] if same else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where} keys {sorted(set(a) ^ set(b))}"]
        return [d for k in a for d in _same(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        if len(a) != len(b):
            return [f"{where} length"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _same(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_trainer_saves_on_rank_0_and_resumes_to_the_uninterrupted_run_bitwise(name: str) -> None:
    with tempfile.TemporaryDirectory() as root:
        ranks = run_ranks(WORLD_SIZE, _save_and_resume, name, root, timeout=400)
    for rank, run in enumerate(ranks):
        assert "optimizer.pt" in run["files"] and "scheduler.pt" in run["files"], run["files"]
        whole_params, whole_state = run["whole"]
        for label in ("saving", "resumed"):
            params, state = run[label]
            assert _same(params, whole_params) == [], (rank, label)
            assert _same(state, whole_state) == [], (rank, label)
        steps = {int(v["step"]) for v in whole_state["state"].values() if "step" in v}
        assert steps == {STEPS}, steps  # the state is the 4-step one, on every rank


# ---- a collective state_dict called on one rank ----------------------------------------------


def _state_dict_on_rank_0_alone(rank: int, world_size: int) -> str | None:
    from optzoo.distributed import DistributedOptimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optimizer = get_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, use_layer_wise_distributed_optimizer=True), model)
    assert isinstance(optimizer, DistributedOptimizer)
    optimizer.state_dict_timeout = datetime.timedelta(seconds=2)
    message = None
    if rank == 0:
        with pytest.raises(RuntimeError) as raised:
            optimizer.state_dict()
        message = str(raised.value)
    dist.barrier()  # the other rank went on: it meets rank 0 at its next collective, which must be this one
    both = optimizer.state_dict()  # called together, it works (the failed call consumed no collective)
    assert set(both["state"]) == set() and len(both["param_groups"]) == len(optimizer.param_groups)
    return message


def test_a_state_dict_called_on_one_rank_raises_naming_the_absent_ranks_instead_of_hanging() -> None:
    messages = run_ranks(WORLD_SIZE, _state_dict_on_rank_0_alone, timeout=90)
    assert messages[1] is None
    assert re.fullmatch(
        r"`DistributedOptimizer\.state_dict`: a collective, called by rank 0 without the others; got no call from ranks \[1\] "
        r"within 2 s; expected every rank of the data-parallel group to call it \(.*optzoo\.trainer\.GatherOptimizerState "
        r"for transformers\.Trainer.*\)",
        messages[0] or "",
    ), messages[0]


# ---- when the callback gathers: Trainer's own flow objects, one process ------------------------


class _Counting:
    """Stands for optzoo's DistributedOptimizer: counts gather_state_dict calls."""

    def __init__(self) -> None:
        self.gathers = 0

    def gather_state_dict(self) -> None:
        self.gathers += 1


def test_the_callback_gathers_when_trainer_has_decided_to_save_through_accelerates_wrapper() -> None:
    from accelerate.optimizer import AcceleratedOptimizer
    from transformers import TrainerControl, TrainerState, TrainingArguments
    from transformers.trainer_callback import DefaultFlowCallback

    from optzoo.trainer import GatherOptimizerState

    inner = _Counting()
    wrapped = AcceleratedOptimizer.__new__(AcceleratedOptimizer)  # as Trainer holds it; only .optimizer is read
    wrapped.optimizer = inner
    callback, flow = GatherOptimizerState(), DefaultFlowCallback()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, use_cpu=True, report_to=[], save_strategy="steps", save_steps=2, max_steps=4)
        state, control = TrainerState(max_steps=4, save_steps=2, logging_steps=1, eval_steps=10), TrainerControl()  # as Trainer sets them from args
        for step in range(1, 5):  # Trainer's order: DefaultFlowCallback first, then the user's callbacks
            state.global_step = step
            control = flow.on_step_end(args, state, control)
            callback.on_step_end(args, state, control, optimizer=wrapped)
            control.should_save = False  # Trainer resets it after saving
        assert inner.gathers == 2  # steps 2 and 4, where DefaultFlowCallback set should_save
        best = TrainingArguments(
            output_dir=out, use_cpu=True, report_to=[], save_strategy="best", eval_strategy="steps", metric_for_best_model="loss"
        )
        callback.on_evaluate(best, state, TrainerControl(), optimizer=wrapped)
        callback.on_evaluate(args, state, TrainerControl(), optimizer=wrapped)
        assert inner.gathers == 3  # after an evaluation only under "best", where Trainer decides afterwards
        # a plain torch optimizer (one process, or DDP without the distributed flags) is left alone
        callback.on_step_end(args, state, TrainerControl(should_save=True), optimizer=torch.optim.SGD([torch.zeros(1, requires_grad=True)]))

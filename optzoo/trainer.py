"""``transformers.Trainer`` with optzoo: the optimizer factory, and saving the distributed optimizers.

Trainer builds its optimizer in ``create_optimizer`` from ``optimizer_cls_and_kwargs``;
:func:`trainer_optimizer` gives that pair for :func:`optzoo.get_optimizer`, so Trainer builds one
optzoo optimizer from the model it trains (and owns its lr scheduler, built on it).

Trainer saves the optimizer on rank 0 alone (``torch.save(optimizer.state_dict())`` in
``_save_optimizer_and_scheduler``) and loads it on every rank. The distributed optimizers
(``use_distributed_optimizer``, ``use_layer_wise_distributed_optimizer``) hold each param's state
on its owner rank, so their ``state_dict()`` is a collective: called on rank 0 alone it cannot
finish. :class:`GatherOptimizerState` gathers it on every rank when Trainer has decided to save,
before the save, and rank 0's ``state_dict()`` then returns it without a collective; loading needs
nothing (every rank loads the whole checkpoint and keeps what it owns). Without the callback, rank
0's ``state_dict()`` raises after ``DistributedOptimizer.state_dict_timeout`` instead of hanging.
"""

from __future__ import annotations

from typing import Any

import torch

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as error:  # pragma: no cover - the test extra installs it
    raise ImportError("`optzoo.trainer`: needs transformers; install it with `pip install optzoo[test]` or `pip install transformers`") from error

from optzoo.config import OptimizerConfig
from optzoo.factory import get_optimizer
from optzoo.wrapper.mixed_precision import MixedPrecisionOptimizer

__all__ = ["GatherOptimizerState", "OptzooOptimizerFactory", "trainer_optimizer"]


class OptzooOptimizerFactory:
    """Trainer's optimizer factory protocol (``transformers.trainer_optimizer.is_optimizer_factory``):
    Trainer calls ``OptzooOptimizerFactory()(model, **kwargs)``, which is ``get_optimizer(config, model, ...)``."""

    def __call__(self, model: torch.nn.Module, *, config: OptimizerConfig, **kwargs: Any) -> MixedPrecisionOptimizer:
        return get_optimizer(config, model, **kwargs)


def trainer_optimizer(config: OptimizerConfig, **get_optimizer_kwargs: Any) -> tuple[type[OptzooOptimizerFactory], dict[str, Any]]:
    """``Trainer(optimizer_cls_and_kwargs=...)`` for ``get_optimizer(config, model, **get_optimizer_kwargs)``.

    Trainer builds the optimizer from the model it trains, when training starts (after the process
    group is up), and builds its own lr scheduler on it (``lr_scheduler_type``, warmup). Under the
    distributed optimizers, pass :class:`GatherOptimizerState` in ``callbacks`` too.

    Args:
        config: The optimizer config.
        get_optimizer_kwargs: Passed on to :func:`optzoo.get_optimizer` (``config_overrides``,
            ``process_group``, ...).

    Example:
        >>> from transformers.trainer_optimizer import is_optimizer_factory
        >>> factory, kwargs = trainer_optimizer(OptimizerConfig(optimizer="muon", lr=0.02))
        >>> is_optimizer_factory(factory), sorted(kwargs)
        (True, ['config'])
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        >>> optimizer = factory()(model, **kwargs)  # what Trainer.create_optimizer does
        >>> [(g["optimizer"], g["param_names"]) for g in optimizer.param_groups]  # the last Linear is the head
        [('muon', ['0.weight']), ('adam', ['2.weight']), ('adam', ['0.bias', '2.bias'])]
    """
    if not isinstance(config, OptimizerConfig):
        raise TypeError(f"`config`: not an OptimizerConfig; got {type(config).__name__}; expected optzoo.OptimizerConfig")
    return OptzooOptimizerFactory, {"config": config, **get_optimizer_kwargs}


def _gatherer(optimizer: Any) -> Any:
    """The optimizer under Trainer's wrappers (accelerate's ``AcceleratedOptimizer``) that has
    ``gather_state_dict``, or ``None``."""
    seen: set[int] = set()
    while optimizer is not None and id(optimizer) not in seen:
        if callable(getattr(optimizer, "gather_state_dict", None)):
            return optimizer
        seen.add(id(optimizer))
        optimizer = getattr(optimizer, "optimizer", None)
    return None


class GatherOptimizerState(TrainerCallback):
    """Gather the distributed optimizers' state on every rank before Trainer saves it on rank 0.

    Trainer decides to save in its callbacks' ``on_step_end`` and ``on_epoch_end``
    (``control.should_save``, set by its ``DefaultFlowCallback``, which runs first), and under
    ``save_strategy="best"`` after evaluation; this callback then calls the optimizer's
    ``gather_state_dict()`` on every rank (a collective), so rank 0's ``state_dict()`` inside
    Trainer's save needs no other rank. Under ``"best"`` it gathers after every evaluation, since
    Trainer decides only afterwards whether to save. An optimizer without ``gather_state_dict``
    (one process, or DDP with a plain optimizer) is left alone.

    Example:
        ``Trainer(model, args, optimizer_cls_and_kwargs=trainer_optimizer(config), callbacks=[GatherOptimizerState()])``
    """

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if control.should_save:
            self._gather(kwargs.get("optimizer"))

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if control.should_save:
            self._gather(kwargs.get("optimizer"))

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if str(getattr(args.save_strategy, "value", args.save_strategy)) == "best":
            self._gather(kwargs.get("optimizer"))

    @staticmethod
    def _gather(optimizer: Any) -> None:
        found = _gatherer(optimizer)
        if found is not None:
            found.gather_state_dict()
